"""A Qwen2.5-Omni checkpoint, part by part: each stage loads only its own part.

The released checkpoint is one ``Qwen2_5OmniForConditionalGeneration`` directory, its
tensors prefixed ``thinker.``, ``talker.`` and ``token2wav.``, beside ``spk_dict.pt``
(the voices). transformers' own classes load each part from it; the token2wav part runs
in float32, as the model's own ``generate`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omni_core.plugin import build_once
from omni_hf import quiet_offline

Part = Literal["thinker", "talker", "token2wav"]
VOICES_FILE = "spk_dict.pt"
TINY_OMNI = "tiny-qwen2.5-omni"


@dataclass(frozen=True)
class Voice:
    """One of the checkpoint's voices: what the talker and token2wav are given."""

    name: str
    cond: Any  # torch (1, enc_emb_dim): token2wav's speaker conditioning
    ref_mel: Any  # torch (1, frames, mel): token2wav's reference mel
    bos_token: int  # the thinker token the talker's text stream starts with


def resolve(model: str) -> str:
    """A loadable directory for ``model``: a directory as it is, or the named tiny model
    (built once, offline)."""
    if Path(model).is_dir():
        return model
    if model == TINY_OMNI:
        return str(build_once(TINY_OMNI, _build_tiny, "config.json"))
    raise RuntimeError(
        f"model {model!r}: not a directory and not a named model ({TINY_OMNI}); give a "
        "Qwen2.5-Omni checkpoint directory (with spk_dict.pt)"
    )


def _build_tiny(target: Path) -> None:
    quiet_offline()
    from omni_speech.testing import build_tiny_omni

    build_tiny_omni(target)


def load_part(model: str, part: Part, device: str = "cpu", dtype: str = "float32") -> Any:
    """The checkpoint's ``part`` as transformers' own module, in eval mode on ``device``."""
    quiet_offline()
    import torch
    from transformers import (
        AutoConfig,
        Qwen2_5OmniTalkerForConditionalGeneration,
        Qwen2_5OmniThinkerForConditionalGeneration,
        Qwen2_5OmniToken2WavModel,
    )

    path = resolve(model)
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "model_type", None) != "qwen2_5_omni":
        raise RuntimeError(
            f"model {model!r}: a {getattr(config, 'model_type', '?')} checkpoint; the speech "
            "stages run Qwen2.5-Omni (model_type qwen2_5_omni)"
        )
    kwargs: dict[str, Any] = {}
    if part == "thinker":
        cls: Any = Qwen2_5OmniThinkerForConditionalGeneration
        sub = config.thinker_config
    elif part == "talker":
        cls, sub = Qwen2_5OmniTalkerForConditionalGeneration, config.talker_config
    else:  # its tensors sit under token2wav., its class's prefix is model.
        cls, sub = Qwen2_5OmniToken2WavModel, config.token2wav_config
        kwargs["key_mapping"] = {r"^token2wav\.": ""}
        dtype = "float32"
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the other parts' tensors are expected extras
    try:
        module = cls.from_pretrained(path, config=sub, dtype=getattr(torch, dtype), **kwargs)
    finally:
        hf_logging.set_verbosity(level)
    return module.to(device).eval()


def load_voices(model: str) -> dict[str, Voice]:
    """The checkpoint's voices (``spk_dict.pt``, tensors only: ``weights_only``)."""
    import torch

    file = Path(resolve(model)) / VOICES_FILE
    if not file.is_file():
        raise RuntimeError(f"model {model!r}: no {VOICES_FILE} (the voices) in {file.parent}")
    raw = torch.load(file, weights_only=True, map_location="cpu")
    return {
        str(name): Voice(str(name), v["cond"].float(), v["ref_mel"].float(), int(v["bos_token"]))
        for name, v in raw.items()
    }
