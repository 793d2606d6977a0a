"""AR engines behind one interface (:class:`~omni_ar.engines.protocol.Engine`): tokenize,
prefill (first token + KV), decode steps."""

from __future__ import annotations

import importlib.util
from typing import Any

from omni_ar.engines.protocol import Engine

ENGINES = ("transformers", "vllm")

# What the zygote imports for a stage on the transformers engine (transformers' top level
# is lazy: the modules that load a model and a tokenizer are named); SmolLM2 is a Llama.
TRANSFORMERS_PRELOAD = (
    "torch",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "omni_ar.engines.transformers_engine",
)


def load_engine(
    name: str,
    model: str,
    dtype: str = "float32",
    threads: int | None = None,
    device: str = "cpu",
    cpu_turns: str | None = None,
    **vllm_options: Any,
) -> Engine:
    """An engine by name, for a model on ``device`` (``"cpu"`` or ``"cuda:0"``, see
    :meth:`omni_core.plugin.StageContext.place`) in ``dtype`` (``"auto"``: bfloat16 on a CPU that
    computes it natively, else float32 (:mod:`omni_ar.engines.dtype`); on a GPU bfloat16
    or float16 for transformers, vLLM's own choice for vLLM); a missing
    engine is a clear error. ``cpu_turns``: engines naming the same turn compute in turns
    on the CPU (:mod:`omni_ar.engines.cpu_turns`). ``vllm_options`` (``kv_role``, ``kv_connector``,
    ``engine_args``, ``gpu_memory_utilization``, ``scheduling_policy``) configure the vLLM
    engine only."""
    if name == "transformers":
        from omni_ar.engines.transformers_engine import TransformersEngine

        return TransformersEngine(
            model, dtype=dtype, threads=threads, device=device, cpu_turns=cpu_turns
        )
    if name == "vllm":
        from omni_ar.engines.vllm_engine import INSTALL_HINT, VllmEngine

        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(INSTALL_HINT)
        return VllmEngine(
            model, dtype=dtype, threads=threads, device=device, cpu_turns=cpu_turns, **vllm_options
        )
    raise RuntimeError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
