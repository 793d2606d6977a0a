"""``dit.hash_encode``: a stand-in text encoder for the diffusion stages (conditioning
seeded by a hash of the prompt), so they run and are measured without a language model."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import msgspec
import numpy as np
from omni_core import Stage, StageEvent, StageInput


class HashEncodeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``dit.hash_encode``'s options."""

    width: int = 32  # the conditioning width (the DiT's joint_attention_dim)
    tokens: int = 8  # rows of prompt_embeds


def hash_conditioning(prompt: str, width: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic conditioning for a prompt: ``(tokens, width)`` and ``(width,)``."""
    rng = np.random.default_rng(zlib.crc32(prompt.encode()))
    embeds = rng.standard_normal((tokens, width), dtype=np.float32)
    return embeds, embeds.mean(axis=0)


class HashEncode(Stage):
    """``dit.hash_encode``: a stand-in text encoder (conditioning seeded by a hash of the
    prompt), so the diffusion stages can run and be measured without a language model."""

    Options = HashEncodeOptions

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            prompt = inp.request.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                yield inp.fail("field 'prompt': expected a non-empty string")
                continue
            embeds, pooled = hash_conditioning(prompt, self.options.width, self.options.tokens)
            yield inp.segment(arrays={"prompt_embeds": embeds, "pooled": pooled}, is_last=True)
