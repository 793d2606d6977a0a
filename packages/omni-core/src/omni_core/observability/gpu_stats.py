"""A worker's GPU figures for its heartbeats: memory from torch's allocator (this process)
and utilisation from NVML (the device; ``nvidia-ml-py``, the ``omni-core[gpu]`` extra),
each where available. A worker that never touched CUDA reports nothing and imports
nothing."""

from __future__ import annotations

import logging
import sys
from typing import Any

from omni_core.events import StageStats

log = logging.getLogger("omni.worker")


def nvml_device(visible: str | None) -> tuple[str, int | str]:
    """How NVML finds the first GPU a worker sees: ("index", n) or ("uuid", "GPU-...")."""
    first = (visible or "0").split(",")[0].strip() or "0"
    if first.isdigit():
        return "index", int(first)
    return "uuid", first  # CUDA_VISIBLE_DEVICES may name devices by UUID


class GpuProbe:
    def __init__(self, visible: str | None) -> None:
        self.visible = visible
        self.nvml: Any = None
        self.handle: Any = None
        self.tried_nvml = False

    def sample(self, stats: StageStats) -> None:
        torch = sys.modules.get("torch")  # the stage imported it, or it does not use it
        if torch is None or not torch.cuda.is_initialized():
            return
        stats.gpu_mem_allocated_bytes = int(torch.cuda.memory_allocated())
        stats.gpu_mem_reserved_bytes = int(torch.cuda.memory_reserved())
        stats.gpu_util_pct = self._utilisation()

    def _utilisation(self) -> float | None:
        if not self.tried_nvml:
            self.tried_nvml = True
            try:
                import pynvml

                pynvml.nvmlInit()
                how, which = nvml_device(self.visible)
                self.handle = (
                    pynvml.nvmlDeviceGetHandleByIndex(which)
                    if how == "index"
                    else pynvml.nvmlDeviceGetHandleByUUID(which)
                )
                self.nvml = pynvml
            except Exception as e:  # not installed, no driver: memory figures only
                log.debug("no NVML utilisation: %s", e)
        if self.nvml is None:
            return None
        try:
            return float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except Exception:
            return None
