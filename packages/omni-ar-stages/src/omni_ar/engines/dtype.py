"""What ``dtype: auto`` runs a text model in: the choice vLLM makes on its platforms.

On a CPU that computes bfloat16 natively (AVX-512 BF16 or AMX; Arm's BF16) bfloat16,
whatever the checkpoint's dtype (vLLM's CPU platform downcasts a float32 checkpoint too):
a decode step there is up to twice as fast as in float32 (SmolLM2, 8 in flight). On a
CPU without it float32, since bfloat16 would be emulated and slower. On a GPU bfloat16,
else float16. A config that names a dtype gets that one.
"""

from __future__ import annotations

from omni_core.plugin import cpu_has_bf16, default_dtype


def auto_dtype(device: str) -> str:
    """The dtype ``auto`` stands for on ``device`` (``"cpu"`` or ``"cuda:N"``)."""
    if device == "cpu" and cpu_has_bf16():
        return "bfloat16"
    return default_dtype(device)


def resolve_dtype(device: str, dtype: str) -> str:
    """``dtype``, or :func:`auto_dtype` for ``"auto"``."""
    return auto_dtype(device) if dtype == "auto" else dtype
