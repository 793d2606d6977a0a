"""Devices: which GPUs a stage worker sees (``devices`` in the config ->
``CUDA_VISIBLE_DEVICES``). Where a stage's models go inside the worker is
:mod:`omni_core.placement`'s."""

from __future__ import annotations

import os

from omni_core.config import PipelineConfig, split_worker


def resolve_devices(devices: str | int | None, parent_visible: str | None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` value for a worker, or None to inherit the parent's.

    * ``None``: inherit. ``"cpu"``: hide every GPU (``""``).
    * ``"0"`` / ``"1,2"``: that list of physical devices, as given.
    * an int: a logical index into the parent's visible list (``CUDA_VISIBLE_DEVICES=2,5,7``
      and ``devices: 1`` give ``"5"``); without a parent list it is the physical index.
    """
    if devices is None:
        return None
    if devices == "cpu":
        return ""
    if isinstance(devices, int):
        if parent_visible:
            visible = [d.strip() for d in parent_visible.split(",") if d.strip()]
            if devices >= len(visible):
                raise ValueError(
                    f"devices: logical index {devices} is out of range for "
                    f"CUDA_VISIBLE_DEVICES={parent_visible!r} ({len(visible)} visible)"
                )
            return visible[devices]
        return str(devices)
    return ",".join(d.strip() for d in devices.split(","))


def worker_devices(
    cfg: PipelineConfig, worker: str, parent: str | None = None, in_process: bool = False
) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` of ``worker`` (a stage's name, or ``STAGE#i``): its
    replica's ``devices`` entry resolved against ``parent``, this process's own list by
    default (see :func:`resolve_devices`); None: inherit.

    ``in_process`` (a stage run in the caller's process, which cannot give each stage its
    own view): ``devices: cpu`` is still the CPU (``""``), any GPU list this process's
    first GPU (``"0"``)."""
    stage, index = split_worker(worker)
    devices = cfg.worker_devices(stage, index)
    if in_process:
        return "" if devices == "cpu" else None if devices is None else "0"
    if parent is None:
        parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    return resolve_devices(devices, parent)
