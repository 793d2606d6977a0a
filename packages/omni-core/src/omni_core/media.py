"""The core's contract for encoded media in events: the ``media_type`` payload key.

A stage that emits encoded bytes (a JPEG, a WEBP, a PNG, a WAV...) as an event array
sets ``payload["media_type"]`` to their MIME type (``"image/jpeg"``). That is all the
runtime and its clients read to know what the bytes are: ``omni run --out`` names the
file by it (:func:`extension`), and ``omni serve`` answers with its format
(:func:`subtype`). No other payload key of any family is read by the core.
"""

from __future__ import annotations

import mimetypes
from collections.abc import Mapping
from typing import Any

__all__ = ["IMAGE_INPUT_FORMATS", "MEDIA_TYPE", "extension", "media_type_of", "subtype"]

MEDIA_TYPE = "media_type"
"""The payload key: the MIME type of the encoded bytes an event's arrays carry."""

IMAGE_INPUT_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The Pillow formats an image that comes with a request is opened as (``Image.open(...,
formats=IMAGE_INPUT_FORMATS)``), by the server and by every stage: no other of Pillow's
decoders is exposed to a client (EPS would run Ghostscript)."""

# the usual file extension of the types stages emit today; any other registered MIME type
# goes through the standard library's table
_EXTENSIONS = {
    "image/jpeg": "jpg",
    "image/png": "png",
    "image/webp": "webp",
    "image/gif": "gif",
    "audio/wav": "wav",
    "audio/x-wav": "wav",
    "audio/mpeg": "mp3",
    "audio/ogg": "ogg",
    "audio/flac": "flac",
    "audio/aac": "aac",
    "audio/pcm": "pcm",
    "video/mp4": "mp4",
}


def media_type_of(payload: Any) -> str | None:
    """The event payload's ``media_type`` (lower case, parameters dropped), or None when
    the payload sets none."""
    if not isinstance(payload, Mapping):
        return None
    value = payload.get(MEDIA_TYPE)
    if not isinstance(value, str) or "/" not in value:
        return None
    return value.split(";")[0].strip().lower()


def extension(media_type: str) -> str:
    """The file extension (no dot) for a MIME type: ``image/jpeg`` -> ``jpg``; ``bin``
    for a type nothing knows."""
    media_type = media_type.split(";")[0].strip().lower()
    if media_type in _EXTENSIONS:
        return _EXTENSIONS[media_type]
    guessed = mimetypes.guess_extension(media_type, strict=False)
    return guessed.lstrip(".") if guessed else "bin"


def subtype(media_type: str) -> str:
    """The part after the slash: ``image/jpeg`` -> ``jpeg`` (OpenAI's ``output_format``)."""
    return media_type.split(";")[0].strip().lower().partition("/")[2]
