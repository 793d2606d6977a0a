"""AR engines behind one interface: tokenize, prefill (first token + KV), decode steps."""

from __future__ import annotations

import importlib.util
from typing import Any

ENGINES = ("transformers", "vllm")


def load_engine(
    name: str,
    model: str,
    dtype: str = "float32",
    threads: int | None = None,
    **vllm_options: Any,
) -> Any:
    """An engine by name; a missing engine is a clear error. ``vllm_options``
    (``kv_role``, ``kv_connector``, ``engine_args``) configure the vLLM engine only."""
    if name == "transformers":
        from omni_ar.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model, dtype=dtype, threads=threads)
    if name == "vllm":
        from omni_ar.engines.vllm_engine import INSTALL_HINT, VllmEngine

        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(INSTALL_HINT)
        return VllmEngine(model, dtype=dtype, threads=threads, **vllm_options)
    raise RuntimeError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
