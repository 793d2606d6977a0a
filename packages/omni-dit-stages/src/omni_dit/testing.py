"""Helpers for tests and benchmarks of the DiT family: pipeline configs over any model
directory, and diffusers' own pipelines as the reference (the stand-in text encoder,
``dit.hash_encode``, is omni-testing's)."""

from __future__ import annotations

from typing import Any


def dit_config(
    model: str,
    *,
    width: int = 32,
    encode: bool = True,
    enabled: bool = True,
    sample: dict[str, Any] | None = None,
    text: dict[str, Any] | None = None,
    image_defaults: dict[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """text -> plan -> sample -> vae [-> encode], previews to the caller.

    The text stage is ``dit.hash_encode`` of ``width``, or with ``text`` (its options,
    e.g. ``{}``) ``dit.text_encode`` on the checkpoint's own encoders."""
    model_opts = {"model": model, "conditioning_width": width}  # the width: for tiny-sd3
    opts = {**model_opts, "threads": 1}
    defaults = {"image_defaults": image_defaults or {}}
    if text is None:
        encoder = {"name": "text", "kind": "dit.hash_encode", "options": {"width": width}}
    else:
        encoder = {
            "name": "text",
            "kind": "dit.text_encode",
            "max_batch_size": 8,
            "options": {"model": model, "threads": 1, **defaults, **text},
        }
    stages = [
        encoder,
        {"name": "plan", "kind": "dit.plan", "options": {**model_opts, **defaults}},
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


def checkpoint_pipeline(model: str, **components: Any) -> Any:
    """diffusers' own pipeline for a complete checkpoint, loaded the way its users load
    it (``from_pretrained``, offline), progress bar off: the reference of the full layouts."""
    from diffusers import DiffusionPipeline

    from omni_dit import models

    path = models.resolve_model(model)
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def checkpoint_image(
    pipe: Any, request: dict[str, Any], output_type: str = "np", **extra: Any
) -> Any:
    """One image from a complete checkpoint's pipeline for a request as the stages take
    it (prompt, ``image`` fields); guidance arguments in the pipeline's own terms."""
    import torch

    image = request.get("image", {})
    flux = type(pipe).__name__ == "FluxPipeline"
    kwargs: dict[str, Any] = {}
    if image.get("guidance") is not None:
        kwargs["guidance_scale"] = image["guidance"]
    elif not flux:
        kwargs["guidance_scale"] = 1.0  # omni's SD3 default: no guidance unless asked
    if image.get("negative_prompt"):  # the API's "" stands for the pipeline's None
        kwargs["negative_prompt"] = image["negative_prompt"]
    if flux:
        kwargs["true_cfg_scale"] = image.get("true_cfg_scale", 1.0)
    return pipe(
        prompt=request["prompt"],
        width=image["width"],
        height=image["height"],
        num_inference_steps=image["steps"],
        generator=torch.Generator("cpu").manual_seed(image.get("seed", 0)),
        output_type=output_type,
        **kwargs,
        **extra,
    ).images[0]


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
