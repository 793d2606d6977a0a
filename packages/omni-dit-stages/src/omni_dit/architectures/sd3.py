"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): CLIP-L + CLIP-G + T5 text
encoders, ``SD3Transformer2DModel`` on ``(C, h, w)`` latents, guidance by a batch of
``[negative, positive]``."""

from __future__ import annotations

from typing import Any

from omni_dit.architectures.base import Architecture, TextOptions, TextPipeline
from omni_dit.params import ImageParams, ImageRequestError


class SD3(Architecture):
    pipeline_class = "StableDiffusion3Pipeline"
    transformer_class = "SD3Transformer2DModel"
    label = "Stable Diffusion 3"
    default_guidance = 1.0  # no guidance unless asked (the configs set the checkpoint's)
    max_sequence_length = 256

    @property
    def patch(self) -> int:
        return int(self.transformer_config["patch_size"])

    @property
    def multiple(self) -> int:
        return self.vae_scale * self.patch

    @property
    def max_side(self) -> int | None:
        pos = self.transformer_config.get("pos_embed_max_size")
        return int(pos) * self.patch * self.vae_scale if pos else None

    def check(self, p: ImageParams) -> None:
        if p.true_cfg_scale != 1.0:
            raise ImageRequestError(
                "field 'image.true_cfg_scale': Stable Diffusion 3 guides with "
                "'image.guidance'; true_cfg_scale is for Flux"
            )

    def guided(self, p: ImageParams) -> bool:
        return p.guidance > 1.0

    def cfg_scale(self, p: ImageParams) -> float:
        return p.guidance

    def initial_latents(self, p: ImageParams) -> Any:
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        channels = int(self.transformer_config["in_channels"])
        shape = (1, channels, p.height // self.vae_scale, p.width // self.vae_scale)
        # on the CPU by design: the same noise for a seed on every device (the sampler
        # moves it to its own)
        gen = torch.Generator("cpu").manual_seed(p.seed)
        return randn_tensor(shape, generator=gen, device=torch.device("cpu"), dtype=torch.float32)

    def scheduler(self, steps: int, latents: Any) -> Any:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        scheduler = self.new_scheduler()
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            h, w = latents.shape[-2:]
            c = scheduler.config
            kwargs["mu"] = calculate_shift(
                (h // self.patch) * (w // self.patch),
                c.get("base_image_seq_len", 256),
                c.get("max_image_seq_len", 4096),
                c.get("base_shift", 0.5),
                c.get("max_shift", 1.16),
            )
        retrieve_timesteps(scheduler, steps, latents.device, **kwargs)
        return scheduler

    def forward(
        self, transformer: Any, x: Any, t: Any, embeds: Any, pooled: Any, p: ImageParams
    ) -> Any:
        return transformer(
            hidden_states=x,
            timestep=t.expand(x.shape[0]),
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]

    def load_text_pipeline(
        self, dtype: str, variant: str | None, o: TextOptions, device: str = "cpu"
    ) -> TextPipeline:
        import torch
        from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

        # encode_prompt reads the transformer's config (the width of skipped T5 tokens):
        # a stand-in on the meta device has it without a byte of weights
        with torch.device("meta"):
            config = SD3Transformer2DModel.load_config(self.path / "transformer")
            stand_in = SD3Transformer2DModel.from_config(config)
        parts = ["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"]
        self.require_parts(parts + (["text_encoder_3", "tokenizer_3"] if o.use_t5 else []))
        skip = {} if o.use_t5 else {"text_encoder_3": None, "tokenizer_3": None}
        return self.text_pipeline(
            StableDiffusion3Pipeline, dtype, variant, o, device, transformer=stand_in, **skip
        )

    def encode(
        self, pipeline: TextPipeline, prompts: list[str], negatives: list[str] | None
    ) -> tuple[Any, Any, Any, Any]:
        o = pipeline.options
        embeds, neg, pooled, neg_pooled = pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=negatives is not None,
            negative_prompt=negatives,
            clip_skip=o.clip_skip,
            max_sequence_length=o.max_sequence_length or self.max_sequence_length,
        )
        return embeds, pooled, neg, neg_pooled
