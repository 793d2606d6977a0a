"""This family's named models, for ``omni models`` (entry point ``omni.models``)."""

from __future__ import annotations

from pathlib import Path

from omni_core.plugin import NamedModel, Reporter, cached

from omni_speech.checkpoint import TINY_OMNI, resolve


def named_models() -> list[NamedModel]:
    """The tiny Qwen2.5-Omni, built offline from configs with seeded random weights."""

    def pull(report: Reporter) -> Path:
        report("building it from its config with seeded random weights (offline)")
        return Path(resolve(TINY_OMNI))

    return [
        NamedModel(
            TINY_OMNI,
            "omni-speech-stages",
            "a tiny Qwen2.5-Omni (thinker, talker, token2wav) with random weights, for "
            "configs/omni_speech.yaml",
            lambda: cached(TINY_OMNI, "config.json"),
            pull,
            "build offline",
        )
    ]
