"""Devices: which GPUs a stage worker sees (``devices`` in the config ->
``CUDA_VISIBLE_DEVICES``), and, inside the worker, where a stage's models go
(:func:`place`: a torch device and a dtype). torch is imported only by :func:`place`."""

from __future__ import annotations

import os
from dataclasses import dataclass

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


class DeviceError(RuntimeError):
    """A stage asked for a device this worker does not have."""


DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Placement:
    """Where a stage's models live: a torch device, and the dtype they load in."""

    device: str  # "cpu" or "cuda:0" (the first GPU this worker sees)
    dtype: str  # one of DTYPES

    @property
    def is_gpu(self) -> bool:
        return self.device.startswith("cuda")


def default_dtype(device: str) -> str:
    """float32 on a CPU; bfloat16 on a GPU that has it (Ampere on), else float16."""
    if not device.startswith("cuda"):
        return "float32"
    import torch

    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def place(stage: str, devices: str | None, dtype: str | None = None) -> Placement:
    """The placement of a stage whose worker was given ``devices`` (its
    ``CUDA_VISIBLE_DEVICES``, see :func:`resolve_devices`): ``""`` (``devices: cpu``) is
    the CPU; a device list is the first GPU of it (``cuda:0`` in the worker, made the
    current device); ``None`` (no ``devices`` key) is the first GPU where torch sees one,
    else the CPU. ``dtype`` ``None`` or ``"auto"``: :func:`default_dtype`.

    Asking for a GPU that torch does not see is a :class:`DeviceError` naming the stage,
    what it asked for and what torch sees."""
    import torch

    if devices == "":
        device = "cpu"
    elif devices is None:
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    elif not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU build)"
        raise DeviceError(
            f"stage {stage!r}: devices {devices!r} asks for a GPU, but torch "
            f"{torch.__version__} sees none (built with {built}; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
            f"{torch.cuda.device_count()} device(s)); use devices: cpu to run it on the CPU"
        )
    else:
        device = "cuda:0"
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    if dtype in (None, "auto"):
        dtype = default_dtype(device)
    elif dtype not in DTYPES:
        raise DeviceError(f"stage {stage!r}: dtype {dtype!r}: expected auto or one of {DTYPES}")
    return Placement(device, dtype)
