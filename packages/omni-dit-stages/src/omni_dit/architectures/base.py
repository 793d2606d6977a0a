"""What the DiT stages need from an architecture; the parts SD3 and Flux share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from omni_dit import models
from omni_dit.params import ImageParams


class TextOptions(msgspec.Struct, kw_only=True):
    """How ``dit.text_encode`` encodes, as the pipeline's ``encode_prompt`` takes it."""

    max_sequence_length: int | None = None  # T5 tokens; None: the pipeline's default
    use_t5: bool = True  # False: skip T5 (SD3 allows it; zeros stand for its tokens)
    clip_skip: int | None = None  # CLIP layers skipped from the end (SD3)


@dataclass(frozen=True)
class TextPipeline:
    """A diffusers pipeline with its text encoders loaded for ``options`` on ``device``:
    what :meth:`Architecture.encode` encodes with."""

    pipe: Any
    options: TextOptions
    device: str

    def encode_prompt(self, **kwargs: Any) -> Any:
        """The pipeline's own ``encode_prompt`` on its device, in inference mode."""
        import torch

        with torch.inference_mode():
            return self.pipe.encode_prompt(device=torch.device(self.device), **kwargs)


class Architecture:
    """One diffusers architecture, read from a checkpoint directory's configs (no
    weights are loaded until a ``load_*`` call)."""

    pipeline_class: ClassVar[str]  # the diffusers pipeline it mirrors
    transformer_class: ClassVar[str]  # the diffusers class of its transformer
    label: ClassVar[str]
    default_guidance: ClassVar[float]  # image.guidance when a request leaves it out
    max_sequence_length: ClassVar[int]  # T5 tokens when the options leave it out

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        import diffusers

        self.path = path
        self.index = index  # model_index.json
        name = index.get("scheduler", [None, None])[1]
        self.scheduler_class = getattr(diffusers, str(name), None)
        if self.scheduler_class is None:
            raise models.ModelError(
                f"model {str(path)!r}: scheduler class {name!r} is not in diffusers"
            )
        self.transformer_config = models.read_config(path, "transformer")
        self.vae_config = models.read_config(path, "vae")
        self.scheduler_config = models.read_config(path, "scheduler")
        self.vae_scale = 2 ** (len(self.vae_config["block_out_channels"]) - 1)
        self.embeds_width = int(self.transformer_config["joint_attention_dim"])
        self.pooled_width = int(self.transformer_config["pooled_projection_dim"])

    # -- plan ---------------------------------------------------------------------

    @property
    def multiple(self) -> int:
        """Width and height must be multiples of this many pixels."""
        raise NotImplementedError

    @property
    def max_side(self) -> int | None:
        """The largest side the transformer's positions reach, if bounded."""
        return None

    def check(self, p: ImageParams) -> None:
        """Reject fields this architecture has no use for (ImageRequestError)."""

    def with_defaults(self, p: ImageParams) -> ImageParams:
        """``p`` with the fields it leaves to the architecture filled in."""
        if p.guidance is None:
            return msgspec.structs.replace(p, guidance=self.default_guidance)
        return p

    def guided(self, p: ImageParams) -> bool:
        """Classifier-free guidance: conditioning rows are ``[negative, positive]``."""
        raise NotImplementedError

    def cfg_scale(self, p: ImageParams) -> float:
        raise NotImplementedError

    def initial_latents(self, p: ImageParams) -> Any:
        """The seeded noise of one request, ``(1, ...)`` float32, as the pipeline draws it
        with a CPU ``torch.Generator``: drawn on the CPU whatever device samples it (the
        sampler moves it there), so a seed is the same noise on every device."""
        raise NotImplementedError

    def scheduler(self, steps: int, latents: Any) -> Any:
        """A fresh scheduler with its timesteps set for ``latents``, on their device (a
        scheduler keeps a step index, so each batch of alike requests gets its own)."""
        raise NotImplementedError

    def new_scheduler(self) -> Any:
        """The checkpoint's scheduler class (``model_index.json``) from its config."""
        return self.scheduler_class.from_config(self.scheduler_config)

    # -- sample -------------------------------------------------------------------

    def load_transformer(self, dtype: str, variant: str | None, device: str = "cpu") -> Any:
        """The transformer in ``dtype`` on ``device``, in eval mode."""
        import diffusers

        cls = getattr(diffusers, self.transformer_class)
        return models.load_part(cls, self.path, "transformer", dtype, variant, device)

    def predict(
        self, transformer: Any, latents: Any, t: Any, embeds: Any, pooled: Any, p: ImageParams
    ) -> Any:
        """The guided prediction for a batch of alike requests; with guidance the
        conditioning is ``[every negative row, every positive row]``."""
        import torch

        guided = self.guided(p)
        model_input = torch.cat([latents] * 2) if guided else latents
        with torch.inference_mode():
            noise = self.forward(transformer, model_input, t, embeds, pooled, p)
        if guided:
            uncond, text = noise.chunk(2)
            noise = uncond + self.cfg_scale(p) * (text - uncond)
        return noise

    def forward(
        self, transformer: Any, x: Any, t: Any, embeds: Any, pooled: Any, p: ImageParams
    ) -> Any:
        raise NotImplementedError

    def spatial(self, latents: Any, p: ImageParams) -> Any:
        """Latents ``(B, ...)`` as ``(B, C, h, w)`` (for the VAE and previews)."""
        return latents

    # -- vae ----------------------------------------------------------------------

    def load_vae(self, dtype: str, variant: str | None, device: str = "cpu") -> Any:
        return models.load_vae(self.path, dtype, variant, device)

    # -- text ---------------------------------------------------------------------

    def load_text_pipeline(
        self, dtype: str, variant: str | None, o: TextOptions, device: str = "cpu"
    ) -> TextPipeline:
        """The diffusers pipeline with its tokenizers and text encoders loaded in
        ``dtype`` on ``device`` (and no transformer weights, no VAE), for ``o``."""
        raise NotImplementedError

    TEXT_ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2", "text_encoder_3")

    def text_pipeline(
        self,
        cls: Any,
        dtype: str,
        variant: str | None,
        o: TextOptions,
        device: str = "cpu",
        **parts: Any,
    ) -> TextPipeline:
        """``cls.from_pretrained`` of this checkpoint without its VAE (and whatever
        ``parts`` replace), offline: the text encoders and tokenizers it loads, the
        encoders moved to ``device`` (one by one: ``pipe.to`` would move a stand-in
        transformer on the meta device too), for the options ``o``."""
        pipe = cls.from_pretrained(
            self.path,
            vae=None,
            dtype=models.torch_dtype(dtype),
            variant=variant,
            local_files_only=True,
            **parts,
        )
        for name in self.TEXT_ENCODERS:
            encoder = getattr(pipe, name, None)
            if encoder is not None:
                encoder.to(device)
        return TextPipeline(pipe, o, device)

    def require_parts(self, parts: list[str]) -> None:
        """:class:`ModelError` naming the parts ``model_index.json`` does not list."""
        index = self.index
        missing = [p for p in parts if not (isinstance(index.get(p), list) and index[p][0])]
        if missing:
            raise models.ModelError(
                f"model {str(self.path)!r}: no {', '.join(missing)} in the checkpoint "
                "(model_index.json); dit.text_encode needs the checkpoint's text encoders"
            )

    def encode(
        self, pipeline: TextPipeline, prompts: list[str], negatives: list[str] | None
    ) -> tuple[Any, Any, Any, Any]:
        """``(embeds (B, tokens, width), pooled (B, width), negative_embeds,
        negative_pooled)`` by the pipeline's own ``encode_prompt`` on its device (where
        the encoders are; the tensors stay there), the negatives (None without guidance)
        encoded as the pipeline encodes them."""
        raise NotImplementedError
