"""The DiT stages: plan -> sample -> vae -> encode, each in its own worker.

* plan: validates the request's ``image`` fields against the model, takes the
  conditioning (``prompt_embeds``, ``pooled``) from its text-encoder upstream, sets up the
  schedule and draws the seeded initial latents.
* sample: the denoising loop (transformer + scheduler), batching alike requests into one
  forward pass per step; a preview every ``image.preview_every`` steps (droppable); a
  cancelled request leaves the batch at the next step.
* vae: decodes the final latents to an RGB image (floats in [0, 1]).
* encode: JPEG, WEBP or PNG bytes in the final image event.

Devices: text_encode, sample and vae (the stages with models) place them with
``omni_core.plugin.StageContext.place`` at load: on the GPU their worker sees (its ``devices``;
none given: the first GPU torch sees, else the CPU), in the ``dtype`` option (``auto``:
float32 on a CPU, bfloat16 or float16 on a GPU). Arrays received go to that device;
arrays yielded are moved to the CPU first. Plan draws the seeded noise on the CPU (a CPU
``torch.Generator``, as diffusers advises for reproducibility), so a seed is the same
noise on every device; sample moves it to its own.

The loop is the one of diffusers' pipeline for the checkpoint's architecture
(``omni_dit.architectures``: Stable Diffusion 3, Flux.1), split across processes, so the
same parts, conditioning and seed give the same image.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from omni_core.plugin import MEDIA_TYPE, Placement, Stage, StageEvent, StageInput

from omni_dit import models
from omni_dit.architectures import Architecture, architecture
from omni_dit.params import (
    ImageParams,
    ImageRequestError,
    forwarded_params,
    params_payload,
    parse_image_request,
)
from omni_dit.preview import cached_projection, project


class ModelOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The options of ``dit.sample`` and ``dit.vae`` (a stage's ``options:`` in YAML),
    and the base of ``dit.plan``'s."""

    model: str  # a diffusers pipeline directory, a Hugging Face id, or an embedded model
    variant: str | None = None  # weights variant, as diffusers takes it ("fp16")
    # the models' dtype: auto (float32 on a CPU, bfloat16 or float16 on a GPU), float32,
    # bfloat16 or float16; plan has no model and draws float32 noise whatever it says
    dtype: str = "auto"
    conditioning_width: int = 576  # of the embedded tiny-sd3 (the encoder's hidden size)
    threads: int | None = None  # torch threads in this worker


class PlanOptions(ModelOptions, kw_only=True):
    """The options of ``dit.plan``: the model's, and the limits and defaults of a
    request's ``image`` fields."""

    max_pixels: int = 1024 * 1024  # width x height limit of a request
    max_steps: int = 100  # the most steps a request may ask for
    image_defaults: dict[str, Any] = {}  # image fields for requests that leave them out


def load_architecture(o: ModelOptions) -> Architecture:
    """The architecture of the checkpoint ``o.model`` names (resolved, configs read)."""
    return architecture(models.resolve_model(o.model, o.conditioning_width, o.variant))


def check_image_defaults(defaults: dict[str, Any]) -> None:
    """A stage's ``image_defaults`` option must parse as image fields (checked at load,
    not on every request)."""
    try:
        msgspec.convert(defaults, ImageParams)
    except msgspec.ValidationError as e:
        raise ValueError(f"option 'image_defaults': {e}") from None


def _arrays(inp: StageInput) -> dict[str, Any]:
    """Every array of the upstream window, by name (the last piece's wins)."""
    out: dict[str, Any] = {}
    for p in inp.window.pieces:
        out.update(p.arrays)
    return out


def _negatives_flag(inp: StageInput) -> bool | None:
    """Whether the upstream encoder encoded negative prompts, where it says (dit.text_encode
    does); None: it does not say, and zeros stand for a missing negative prompt."""
    for p in inp.window.pieces:
        if "negatives" in p.payload:
            return bool(p.payload["negatives"])
    return None


def _threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def placement(stage: Stage) -> Placement:
    """Where a model-bearing stage's models go (``devices`` and its ``dtype`` option);
    :class:`omni_core.plugin.DeviceError` naming the stage when it asks for a GPU this
    worker does not have. Called first in ``load``, before any weights are read."""
    where = stage.ctx.place(stage.options.dtype)
    stage.ctx.logger.info("models on %s in %s", where.device, where.dtype)
    return where


class Plan(Stage):
    """Conditioning + request -> initial latents, conditioning batch and schedule."""

    Options = PlanOptions
    preload = models.PRELOAD

    def load(self) -> None:
        check_image_defaults(self.options.image_defaults)
        _threads(self.options.threads)
        self.arch = load_architecture(self.options)
        p = ImageParams(width=self.arch.multiple, height=self.arch.multiple, steps=1)
        self.arch.scheduler(1, self.arch.initial_latents(p))  # import diffusers now

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        o, arch = self.options, self.arch
        for inp in batch:
            try:
                p = parse_image_request(
                    inp.request, arch.multiple, o.max_pixels, o.max_steps, o.image_defaults
                )
                for field in ("width", "height"):
                    if arch.max_side and getattr(p, field) > arch.max_side:
                        raise ImageRequestError(
                            f"field 'image.{field}': {getattr(p, field)} is over this model's "
                            f"largest side, {arch.max_side}"
                        )
                arch.check(p)
                p = arch.with_defaults(p)
            except ImageRequestError as e:
                yield inp.fail(e)
                continue
            try:
                embeds, pooled = self._conditioning(_arrays(inp), p, _negatives_flag(inp))
            except ValueError as e:
                yield inp.fail(str(e))
                continue
            latents = arch.initial_latents(p)
            schedule = arch.scheduler(p.steps, latents)
            yield inp.segment(
                arrays={
                    "latents": latents.numpy(),
                    "prompt_embeds": embeds,
                    "pooled": pooled,
                    "timesteps": schedule.timesteps.numpy().astype(np.float32),
                },
                payload=params_payload(p),
                is_last=True,
            )

    def _conditioning(
        self, a: dict[str, Any], p: ImageParams, encoded_negatives: bool | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, tokens, width)`` and ``(rows, width)``: one row, or [negative, positive]
        with guidance (zeros stand for the negative prompt when the encoder sent none)."""
        width, pooled_width = self.arch.embeds_width, self.arch.pooled_width
        embeds, pooled = a.get("prompt_embeds"), a.get("pooled")
        if embeds is None or pooled is None:
            raise ValueError(
                f"upstream sent no conditioning (arrays: {sorted(a) or 'none'}; expected "
                "'prompt_embeds' and 'pooled' from a text-encoder stage)"
            )
        embeds, pooled = np.asarray(embeds, np.float32), np.asarray(pooled, np.float32)
        if embeds.ndim != 2 or embeds.shape[1] != width:
            raise ValueError(
                f"conditioning 'prompt_embeds' has shape {embeds.shape}; this model takes "
                f"(tokens, {width}) (its joint_attention_dim)"
            )
        if pooled.shape != (pooled_width,):
            raise ValueError(
                f"conditioning 'pooled' has shape {pooled.shape}; this model takes "
                f"({pooled_width},) (its pooled_projection_dim)"
            )
        if not self.arch.guided(p):
            return embeds[None], pooled[None]
        if "negative_prompt_embeds" not in a and encoded_negatives is False:
            raise ValueError(
                "the request is guided but its text encoder did not encode a negative "
                "prompt: give dit.text_encode the same image_defaults as plan"
            )
        neg = np.asarray(a.get("negative_prompt_embeds", np.zeros_like(embeds)), np.float32)
        neg_pooled = np.asarray(a.get("negative_pooled", np.zeros_like(pooled)), np.float32)
        tokens = max(len(neg), len(embeds))  # pad the shorter with zeros, as SD3 pads
        rows = np.zeros((2, tokens, width), np.float32)
        rows[0, : len(neg)], rows[1, : len(embeds)] = neg, embeds
        return rows, np.stack([neg_pooled, pooled])


@dataclass
class _Job:
    inp: StageInput
    params: ImageParams
    latents: Any  # torch (1, ...)
    embeds: Any  # torch (rows, tokens, width)
    pooled: Any  # torch (rows, width)

    @property
    def key(self) -> tuple[Any, ...]:
        """Requests that can share one forward pass per step."""
        p = self.params
        return (
            p.steps,
            p.guidance,
            p.true_cfg_scale,
            p.width,
            p.height,
            tuple(self.latents.shape),
            tuple(self.embeds.shape),
        )


class _ModelStage(Stage):
    """A stage running the checkpoint's models (dit.sample, dit.vae): its :meth:`load`
    places them and reads the architecture before a subclass loads its weights."""

    Options = ModelOptions
    preload = models.PRELOAD

    def load(self) -> None:
        self.placement = placement(self)
        _threads(self.options.threads)
        self.arch = load_architecture(self.options)


def _preview_due(p: ImageParams, step: int) -> bool:
    """A preview after ``step`` (1-based) of ``p.steps``: every ``preview_every`` steps,
    the last step aside (the final image follows it)."""
    return bool(p.preview_every) and step < p.steps and step % p.preview_every == 0


class Sample(_ModelStage):
    """The denoising loop; previews every ``image.preview_every`` steps."""

    # a batch's state (its latents) lives in its generator, which computes only when
    # advanced: under scheduler_policy: priority a better request may pause it between
    # two steps and it resumes where it stopped
    preemptible = True

    def load(self) -> None:
        super().load()
        o = self.options
        self.transformer = self.arch.load_transformer(
            self.placement.dtype, o.variant, self.placement.device
        )
        # the preview map is fitted once per VAE with the VAE in float32 on the CPU, so
        # it is the same map (and cache entry) whatever device samples
        self.projection = cached_projection(
            self.arch.path, lambda: self.arch.load_vae("float32", o.variant)
        )

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | list[StageEvent]]:
        import torch

        groups: dict[tuple[Any, ...], list[_Job]] = defaultdict(list)
        dtype, device = self.transformer.dtype, self.placement.device
        for inp in batch:
            try:
                params = forwarded_params(inp.window.payloads)
            except ImageRequestError as e:
                yield inp.fail(e)
                continue
            a = _arrays(inp)
            # copies on the model's device: the arrays may be read-only views of shared
            # memory
            job = _Job(
                inp,
                params,
                torch.tensor(a["latents"], dtype=dtype, device=device),
                torch.tensor(a["prompt_embeds"], dtype=dtype, device=device),
                torch.tensor(a["pooled"], dtype=dtype, device=device),
            )
            groups[job.key].append(job)
        # the groups in order of their first request: under scheduler_policy: priority the
        # worker hands the batch best first, so the group of the best request runs first
        for jobs in groups.values():
            yield from self._sample(jobs)

    def _sample(self, jobs: list[_Job]) -> Iterator[StageEvent | list[StageEvent]]:
        import torch

        arch, p = self.arch, jobs[0].params
        latents = torch.cat([j.latents for j in jobs])
        schedule = arch.scheduler(p.steps, latents)
        guided = arch.guided(p)
        embeds, pooled = self._conditioning(jobs, guided)
        sigmas = schedule.sigmas.tolist()  # for previews, read on the host once
        for i, t in enumerate(schedule.timesteps):
            live = [k for k, j in enumerate(jobs) if not j.inp.cancelled]
            if not live:
                return
            if len(live) < len(jobs):  # cancelled requests leave the batch
                jobs, latents = [jobs[k] for k in live], latents[live]
                embeds, pooled = self._conditioning(jobs, guided)
            noise = arch.predict(self.transformer, latents, t, embeds, pooled, p)
            step = i + 1
            due = [k for k, j in enumerate(jobs) if _preview_due(j.params, step)]
            previews = []
            if due:  # the clean estimates of every request due, to the host in one copy
                x0 = latents[due] - sigmas[i] * noise[due]
                x0s = arch.spatial(x0, p).float().cpu().numpy()  # (one size per group)
                for x0, k in zip(x0s, due, strict=True):
                    previews.append(
                        jobs[k].inp.image(
                            step,
                            arrays={"preview": project(x0, self.projection)},
                            payload={"steps": p.steps},
                        )
                    )
            latents = schedule.step(noise, t, latents, return_dict=False)[0]
            yield previews  # also the point where a cancel takes effect
        final = latents.float().cpu().numpy()  # to the host once, for the whole batch
        for k, j in enumerate(jobs):
            yield j.inp.segment(
                arrays={"latents": np.ascontiguousarray(final[k : k + 1])},
                payload=params_payload(j.params),
                is_last=True,
            )

    @staticmethod
    def _conditioning(jobs: list[_Job], guided: bool) -> tuple[Any, Any]:
        """The batch's conditioning: [every negative row, every positive row] with
        guidance, matching ``torch.cat([latents] * 2)``."""
        import torch

        if not guided:
            return torch.cat([j.embeds for j in jobs]), torch.cat([j.pooled for j in jobs])
        embeds = [j.embeds[0:1] for j in jobs] + [j.embeds[1:2] for j in jobs]
        pooled = [j.pooled[0:1] for j in jobs] + [j.pooled[1:2] for j in jobs]
        return torch.cat(embeds), torch.cat(pooled)


class VaeDecode(_ModelStage):
    """Final latents -> an RGB image, float32 ``(height, width, 3)`` in [0, 1]."""

    def load(self) -> None:
        super().load()
        o = self.options
        self.vae = self.arch.load_vae(self.placement.dtype, o.variant, self.placement.device)
        from diffusers.image_processor import VaeImageProcessor

        self.processor = VaeImageProcessor(vae_scale_factor=self.arch.multiple)

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        import torch

        groups: dict[tuple[Any, ...], list[tuple[StageInput, Any, ImageParams]]]
        groups = defaultdict(list)
        for inp in batch:
            a = _arrays(inp)
            if "latents" not in a:
                yield inp.fail(f"upstream sent no 'latents' (arrays: {sorted(a) or 'none'})")
                continue
            try:
                params = forwarded_params(inp.window.payloads)
            except ImageRequestError as e:
                yield inp.fail(e)
                continue
            latents = torch.tensor(a["latents"], device=self.placement.device)
            key = (tuple(latents.shape), params.height, params.width)
            groups[key].append((inp, latents, params))
        cfg = self.vae.config
        for items in groups.values():
            latents = torch.cat([x[1] for x in items])
            latents = self.arch.spatial(latents, items[0][2]).to(self.vae.dtype)
            latents = latents / cfg.scaling_factor + (cfg.shift_factor or 0.0)
            with torch.inference_mode():
                decoded = self.vae.decode(latents, return_dict=False)[0]
            # to the host once; post-processed there
            images = self.processor.postprocess(decoded.float().cpu(), output_type="np")
            for (inp, _, params), image in zip(items, images, strict=True):
                yield inp.segment(
                    arrays={"image": np.ascontiguousarray(image, dtype=np.float32)},
                    payload=params_payload(params),
                    is_last=True,
                )


MIME = {"jpeg": "image/jpeg", "webp": "image/webp", "png": "image/png"}


class Encode(Stage):
    """The decoded image -> JPEG / WEBP / PNG bytes in the final image event."""

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        from PIL import Image

        for inp in batch:
            image = _arrays(inp).get("image")
            try:
                params = forwarded_params(inp.window.payloads)
            except ImageRequestError as e:
                yield inp.fail(e)
                continue
            if image is None or getattr(image, "ndim", 0) != 3:
                yield inp.fail("upstream sent no 'image' array of (height, width, 3)")
                continue
            pixels = (np.asarray(image) * 255).round().astype(np.uint8)  # as diffusers does
            buf = io.BytesIO()
            fmt = params.format
            if fmt == "png":
                Image.fromarray(pixels).save(buf, format="PNG")
            else:
                Image.fromarray(pixels).save(buf, format=fmt.upper(), quality=params.quality)
            yield inp.image(
                params.steps,
                arrays={"image": buf.getvalue()},
                payload={
                    MEDIA_TYPE: MIME[fmt],  # the core's contract: what the bytes are
                    "width": pixels.shape[1],
                    "height": pixels.shape[0],
                },
                is_last=True,
            )
