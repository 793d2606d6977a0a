"""The sampling schedule of one request, as diffusers' SD3 pipeline makes it."""

from __future__ import annotations

from typing import Any


def resolution_shift(seq_len: int, config: Any) -> float:
    """``mu`` of a dynamically shifted schedule: linear in the image's token count between
    (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.16)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return seq_len * slope + (base_shift - slope * base_len)


def make_scheduler(
    config: dict[str, Any], steps: int, latent_height: int, latent_width: int, patch_size: int
) -> Any:
    """A fresh scheduler from ``config`` with its timesteps set for ``steps`` (a scheduler
    keeps a step index, so every request, or batch of alike requests, gets its own)."""
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
        FlowMatchEulerDiscreteScheduler,
    )

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    kwargs = {}
    if scheduler.config.get("use_dynamic_shifting", None):
        seq_len = (latent_height // patch_size) * (latent_width // patch_size)
        kwargs["mu"] = resolution_shift(seq_len, scheduler.config)
    scheduler.set_timesteps(steps, device="cpu", **kwargs)
    return scheduler
