"""Placement, inside a stage's worker: the torch device and dtype its models load in.

The worker's GPUs were chosen before it started (``devices`` in the config, made its
``CUDA_VISIBLE_DEVICES`` by :mod:`omni_core.worker.devices`); :func:`place` turns that
and a ``dtype`` option into a :class:`Placement`. torch is imported only when called.
A stage reaches it as :meth:`omni_core.plugin.StageContext.place`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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


CPUINFO = "/proc/cpuinfo"
# the flags of a CPU that computes bfloat16 natively: x86's AVX-512 BF16 or AMX, Arm's BF16
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
CPU_BF16_ENV = "OMNI_CPU_BF16"  # 0 or 1: what cpu_has_bf16 says, whatever the flags


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively (its ``/proc/cpuinfo`` flags, or the
    text ``cpuinfo``): there a bfloat16 model runs about twice as fast as in float32;
    elsewhere bfloat16 is emulated and slower than float32. False where the flags cannot
    be read. ``OMNI_CPU_BF16=0`` (or ``1``) in the environment overrides what the flags
    say for this machine (the test suites set 0: their references are float32)."""
    if cpuinfo is None:
        forced = os.environ.get(CPU_BF16_ENV)
        if forced in ("0", "1"):
            return forced == "1"
        if forced is not None:
            raise ValueError(f"{CPU_BF16_ENV}={forced!r}: expected 0 or 1")
        try:
            with open(CPUINFO, encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):  # x86, Arm
            return not BF16_FLAGS.isdisjoint(value.split())
    return False


def default_dtype(device: str) -> str:
    """float32 on a CPU; bfloat16 on a GPU that has it (Ampere on), else float16."""
    if not device.startswith("cuda"):
        return "float32"
    import torch

    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def place(stage: str, devices: str | None, dtype: str | None = None) -> Placement:
    """The placement of a stage whose worker was given ``devices`` (its
    ``CUDA_VISIBLE_DEVICES``, see :func:`omni_core.worker.devices.resolve_devices`):
    ``""`` (``devices: cpu``) is the CPU; a device list is the first GPU of it (``cuda:0``
    in the worker, made the current device); ``None`` (no ``devices`` key) is the first
    GPU where torch sees one, else the CPU. ``dtype`` ``None`` or ``"auto"``: :func:`default_dtype`.

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
