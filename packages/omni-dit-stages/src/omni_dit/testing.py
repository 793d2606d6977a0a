"""Helpers for tests and benchmarks of the DiT family: a stand-in text encoder and
pipeline configs over any SD3-layout model directory."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
from omni_core import Stage, StageEvent, StageInput


class HashEncodeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    width: int = 32  # the conditioning width (the DiT's joint_attention_dim)
    tokens: int = 8


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


def dit_config(
    model: str,
    *,
    width: int = 32,
    encode: bool = True,
    enabled: bool = True,
    sample: dict[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """hash_encode -> plan -> sample -> vae [-> encode], previews to the caller."""
    model_opts = {"model": model, "conditioning_width": width}  # the width: for tiny-sd3
    opts = {**model_opts, "threads": 1}
    stages = [
        {"name": "text", "kind": "dit.hash_encode", "options": {"width": width}},
        {"name": "plan", "kind": "dit.plan", "options": model_opts},
        {
            "name": "sample",
            "kind": "dit.sample",
            "client_stream": "previews",
            **(sample or {}),
            "options": opts,
        },
        {"name": "vae", "kind": "dit.vae", "options": opts},
    ]
    names = [s["name"] for s in stages]
    if encode:
        stages.append({"name": "encode", "kind": "dit.encode"})
        names.append("encode")
    return {
        "mrs": {"enabled": enabled},
        "heartbeat_interval_s": 0.1,
        "stages": stages,
        "edges": [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)],
        **top,
    }


def stock_pipeline(model: str, conditioning_width: int = 32) -> Any:
    """diffusers' own ``StableDiffusion3Pipeline`` from the same parts as the stages use
    (text encoders None: conditioning is given as embeddings): the reference."""
    from diffusers import StableDiffusion3Pipeline

    from omni_dit import models
    from omni_dit.architectures import architecture

    path = models.resolve_model(model, conditioning_width)
    arch = architecture(path)
    pipe = StableDiffusion3Pipeline(
        transformer=arch.load_transformer("float32", None),
        vae=arch.load_vae("float32", None),
        scheduler=models.load_scheduler(path),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stock_image(
    pipe: Any, embeds: Any, pooled: Any, image: dict[str, Any], output_type: str = "np"
) -> Any:
    """One image from ``pipe`` for conditioning ``(1, tokens, width)`` / ``(1, width)`` and
    a request's ``image`` fields; zeros stand for the negative prompt, as in plan."""
    import torch

    return pipe(
        prompt_embeds=embeds,
        pooled_prompt_embeds=pooled,
        negative_prompt_embeds=torch.zeros_like(embeds),
        negative_pooled_prompt_embeds=torch.zeros_like(pooled),
        width=image["width"],
        height=image["height"],
        num_inference_steps=image["steps"],
        guidance_scale=image.get("guidance", 1.0),
        generator=torch.Generator("cpu").manual_seed(image.get("seed", 0)),
        output_type=output_type,
    ).images[0]
