"""The ``image`` part of a request, parsed once by the plan stage.

A request that makes a picture carries its parameters under ``"image"``, next to the
prompt (so AR stages in the same pipeline read their own fields and leave these alone):
``{"prompt": "a red fox", "image": {"width": 256, "height": 256, "steps": 12}}``.
Every error names the field. Plan, the DiT family's entry, parses them into
:class:`ImageParams` and sends those on (:func:`params_payload`); the stages after it read
them back as they were sent (:func:`forwarded_params`), never parsing the request again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import msgspec
from omni_core.plugin import UserInputError

FORMATS = ("jpeg", "webp", "png")


class ImageRequestError(UserInputError):
    """An ``image`` field is missing, of the wrong type, or out of range: the client's
    fault, its message shown to the client (see ``UserInputError``)."""


class ImageParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A request's ``image`` fields, as :func:`parse_image_request` validates them (a
    field a request leaves out: the plan stage's ``image_defaults``, else the default
    here)."""

    width: int = 256  # pixels, a multiple of the architecture's (Architecture.multiple)
    height: int = 256  # pixels; the same rule as width
    steps: int = 12  # denoising steps
    # SD3: > 1 is classifier-free guidance against the negative prompt; Flux: the
    # embedded guidance. None: the architecture's default (SD3 1.0: none; Flux 3.5, as
    # its pipeline)
    guidance: float | None = None
    # Flux: > 1 with a negative prompt is classifier-free guidance against it
    true_cfg_scale: float = 1.0
    seed: int = 0  # the initial noise's seed: the same seed, the same image
    format: Literal["jpeg", "webp", "png"] = "jpeg"  # the encode stage's output
    quality: int = 90  # JPEG / WEBP quality, 1..100
    preview_every: int = 0  # a preview every k steps; 0: none
    negative_prompt: str = ""  # what guidance steers away from (with guidance on)


def parse_image_request(
    request: dict[str, Any],
    multiple: int,
    max_pixels: int,
    max_steps: int,
    defaults: dict[str, Any] | None = None,
) -> ImageParams:
    """The request's image parameters, or :class:`ImageRequestError` naming the field.

    ``multiple``: width and height must be multiples of it (VAE scale x patch size);
    ``defaults``: values for fields the request leaves out (a deployment's choices).
    """
    raw = request.get("image", {})
    if not isinstance(raw, dict):
        raise ImageRequestError(f"field 'image': expected a mapping, got {type(raw).__name__}")
    raw = {**(defaults or {}), **raw}
    try:
        p = msgspec.convert(raw, ImageParams)
    except msgspec.ValidationError as e:
        text = str(e)
        where = text.split("`$.", 1)[1].rstrip("`") if "`$." in text else "?"
        if "unknown field" in text.lower():
            where = text.split("`", 2)[1] if "`" in text else where
        raise ImageRequestError(f"field 'image.{where}': {text.split(' - at ')[0]}") from None
    for field in ("width", "height"):
        v = getattr(p, field)
        if v <= 0 or v % multiple:
            raise ImageRequestError(
                f"field 'image.{field}': {v} is not a positive multiple of {multiple}"
            )
    if p.width * p.height > max_pixels:
        raise ImageRequestError(
            f"field 'image.width': {p.width}x{p.height} is over the limit of {max_pixels} pixels"
        )
    if not 1 <= p.steps <= max_steps:
        raise ImageRequestError(f"field 'image.steps': expected 1..{max_steps}, got {p.steps}")
    for field in ("guidance", "true_cfg_scale"):
        v = getattr(p, field)
        if v is not None and not 0.0 <= v <= 30.0:
            raise ImageRequestError(f"field 'image.{field}': expected 0..30, got {v}")
    if not 1 <= p.quality <= 100:
        raise ImageRequestError(f"field 'image.quality': expected 1..100, got {p.quality}")
    if p.preview_every < 0:
        raise ImageRequestError(
            f"field 'image.preview_every': expected >= 0, got {p.preview_every}"
        )
    return p


def image_fields(request: dict[str, Any], defaults: dict[str, Any] | None = None) -> ImageParams:
    """The request's image fields over ``defaults`` without the model's checks, for stages
    before plan (a text encoder deciding whether to encode the negative prompt); fields
    that do not parse count as left out: plan reports them."""
    raw = request.get("image", {})
    try:
        return msgspec.convert(
            {**(defaults or {}), **(raw if isinstance(raw, dict) else {})}, ImageParams
        )
    except msgspec.ValidationError:
        return msgspec.convert(defaults or {}, ImageParams)


PARAMS = "image_params"
"""The payload key of a request's :class:`ImageParams` (msgpack), from plan on."""

_params_decoder = msgspec.msgpack.Decoder(ImageParams)


def params_payload(params: ImageParams) -> dict[str, bytes]:
    """The payload that carries a request's parsed ``params`` to the next stage."""
    return {PARAMS: msgspec.msgpack.encode(params)}


def forwarded_params(payloads: Iterable[dict[str, Any]]) -> ImageParams:
    """The params plan parsed, from the upstream window's payloads (decoded as they were
    encoded, not checked again)."""
    for payload in payloads:
        if PARAMS in payload:
            return _params_decoder.decode(payload[PARAMS])
    raise ImageRequestError("no image parameters from upstream (is plan before this stage?)")
