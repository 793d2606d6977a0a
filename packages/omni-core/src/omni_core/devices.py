"""Which GPUs a stage worker sees: ``devices`` in the config -> ``CUDA_VISIBLE_DEVICES``."""

from __future__ import annotations


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
