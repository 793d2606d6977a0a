"""Flux.1 (``FluxPipeline``): CLIP-L (pooled) + T5 text encoders,
``FluxTransformer2DModel`` on latents packed 2 x 2 into ``(h/2 * w/2, 4C)`` tokens with
rotary position ids, a guidance embedding (``image.guidance``, 3.5 is FLUX.1-dev's
default) and a schedule shifted by the image's token count. ``image.true_cfg_scale`` > 1
adds classifier-free guidance against the negative prompt, as the pipeline's
``true_cfg_scale`` (the two predictions in one batch)."""

from __future__ import annotations

from typing import Any

from omni_dit import models
from omni_dit.architectures.base import Architecture, TextOptions, TextPipeline
from omni_dit.params import ImageParams


class Flux(Architecture):
    pipeline_class = "FluxPipeline"
    transformer_class = "FluxTransformer2DModel"
    label = "Flux.1"
    default_guidance = 3.5  # the pipeline's guidance_scale
    max_sequence_length = 512

    @property
    def multiple(self) -> int:
        return self.vae_scale * 2  # the VAE's scale, then packing 2 x 2

    def _latent_size(self, p: ImageParams) -> tuple[int, int]:
        return 2 * (p.height // self.multiple), 2 * (p.width // self.multiple)

    def guided(self, p: ImageParams) -> bool:
        # as the pipeline: true CFG needs a negative prompt (the API's "" stands for None)
        return p.true_cfg_scale > 1.0 and bool(p.negative_prompt)

    def cfg_scale(self, p: ImageParams) -> float:
        return p.true_cfg_scale

    def initial_latents(self, p: ImageParams) -> Any:
        import torch
        from diffusers import FluxPipeline
        from diffusers.utils.torch_utils import randn_tensor

        channels = int(self.transformer_config["in_channels"]) // 4
        h, w = self._latent_size(p)
        # on the CPU by design: the same noise for a seed on every device (the sampler
        # moves it to its own)
        gen = torch.Generator("cpu").manual_seed(p.seed)
        noise = randn_tensor(
            (1, channels, h, w), generator=gen, device=torch.device("cpu"), dtype=torch.float32
        )
        return FluxPipeline._pack_latents(noise, 1, channels, h, w)

    def scheduler(self, steps: int, latents: Any) -> Any:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        scheduler = self.new_scheduler()
        c = scheduler.config
        sigmas = None if c.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            latents.shape[1],
            c.get("base_image_seq_len", 256),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5),
            c.get("max_shift", 1.15),
        )
        retrieve_timesteps(scheduler, steps, latents.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def forward(
        self, transformer: Any, x: Any, t: Any, embeds: Any, pooled: Any, p: ImageParams
    ) -> Any:
        import torch
        from diffusers import FluxPipeline

        h, w = self._latent_size(p)
        image_ids = FluxPipeline._prepare_latent_image_ids(
            x.shape[0], h // 2, w // 2, x.device, x.dtype
        )
        text_ids = torch.zeros(embeds.shape[1], 3, device=x.device, dtype=x.dtype)
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full([1], p.guidance, device=x.device, dtype=torch.float32)
            guidance = guidance.expand(x.shape[0])
        timestep = t.expand(x.shape[0]).to(x.dtype)
        return transformer(
            hidden_states=x,
            timestep=timestep / 1000,
            guidance=guidance,
            pooled_projections=pooled,
            encoder_hidden_states=embeds,
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]

    def spatial(self, latents: Any, p: ImageParams) -> Any:
        from diffusers import FluxPipeline

        return FluxPipeline._unpack_latents(latents, p.height, p.width, self.vae_scale)

    def load_text_pipeline(
        self, dtype: str, variant: str | None, o: TextOptions, device: str = "cpu"
    ) -> TextPipeline:
        from diffusers import FluxPipeline

        for name, value, default in (("use_t5", o.use_t5, True), ("clip_skip", o.clip_skip, None)):
            if value != default:
                raise models.ModelError(f"option {name!r}: Flux's encode_prompt has no such choice")
        self.require_parts(["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"])
        return self.text_pipeline(FluxPipeline, dtype, variant, o, device, transformer=None)

    def encode(
        self, pipeline: TextPipeline, prompts: list[str], negatives: list[str] | None
    ) -> tuple[Any, Any, Any, Any]:
        o = pipeline.options

        def encode(texts: list[str]) -> tuple[Any, Any]:
            embeds, pooled, _ = pipeline.encode_prompt(
                prompt=texts,
                prompt_2=None,
                max_sequence_length=o.max_sequence_length or self.max_sequence_length,
            )
            return embeds, pooled

        embeds, pooled = encode(prompts)
        neg, neg_pooled = encode(negatives) if negatives is not None else (None, None)
        return embeds, pooled, neg, neg_pooled
