"""Images in chat requests: where they are, how they load, and their content hashes.

An image part is ``{"type": "image", "image": path | bytes | data URL}`` or
``{"type": "image_url", "image_url": {"url": path | data URL}}``. Nothing is fetched
over the network, and a path (or ``file://``) is read only where the stage option
``allow_local_images`` allows it. Every error names the part (``messages[0].content[1]``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from omni_core.plugin import IMAGE_INPUT_FORMATS

from omni_ar.params import RequestError

log = logging.getLogger("omni.ar.media")
# a local image file (allow_local_images) is read up to this: 16 MP as raw RGB and then some
MAX_FILE_BYTES = 64 << 20


class MediaError(RequestError):
    """An image that cannot be read or decoded."""


def image_parts(messages: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(``messages[i].content[j]``, part) for each image part, in prompt order."""
    for i, m in enumerate(messages):
        content = m["content"]
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part["type"] in ("image", "image_url"):
                    yield f"messages[{i}].content[{j}]", part


def flatten(messages: list[dict[str, Any]], marker: str) -> list[dict[str, str]]:
    """The messages with string contents, each image part replaced by ``marker``."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(p["text"] if p["type"] == "text" else marker for p in content)
        out.append({**m, "content": content})
    return out


def strip_media(messages: list[dict[str, Any]], hashes: list[str]) -> None:
    """Replace each image part, in place, by ``{"type": "image", "hash": ...}``."""
    for (_, part), digest in zip(image_parts(messages), hashes, strict=True):
        part.clear()
        part.update(type="image", hash=digest)


def has_media(messages: list[dict[str, Any]]) -> bool:
    return any("hash" not in part for _, part in image_parts(messages))


def source_bytes(part: dict[str, Any], where: str, allow_local: bool = False) -> bytes:
    """The encoded image of a part, from bytes or a base64 data URL; from a local file
    (a path or ``file://``) only with ``allow_local`` (the stage option
    ``allow_local_images``): a request must not make a worker read its files."""
    if "hash" in part:
        raise MediaError(f"field {where!r}: only a content hash, no image to read")
    src = part["image"] if part["type"] == "image" else part["image_url"]["url"]
    if isinstance(src, bytes):
        return src
    if src.startswith("data:"):
        head, sep, data = src.partition(",")
        if not sep or not head.endswith(";base64"):
            raise MediaError(f"field {where!r}: expected a base64 data URL (data:...;base64,...)")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"field {where!r}: invalid base64 in the data URL: {e}") from None
    if src.startswith(("http://", "https://")):
        raise MediaError(
            f"field {where!r}: remote URLs are not fetched; pass bytes or a base64 data URL"
        )
    if not allow_local:
        raise MediaError(
            f"field {where!r}: local image files are not read (the stage option "
            "allow_local_images is off); pass bytes or a base64 data URL"
        )
    return _read_file(Path(src.removeprefix("file://")), where)


def _read_file(path: Path, where: str) -> bytes:
    """A regular file's bytes (a FIFO or a device would hang or never end), at most
    :data:`MAX_FILE_BYTES`."""
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NONBLOCK)) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise MediaError(f"field {where!r}: {str(path)!r} is not a regular file")
            data = f.read(MAX_FILE_BYTES + 1)
            if len(data) > MAX_FILE_BYTES:
                raise MediaError(
                    f"field {where!r}: {str(path)!r} is over {MAX_FILE_BYTES} bytes, "
                    "too big for an image"
                )
            return data
    except OSError as e:
        raise MediaError(f"field {where!r}: cannot read image file {str(path)!r}: {e}") from None


def decode_image(
    data: bytes, where: str, max_pixels: int, max_total_pixels: int | None = None, used: int = 0
) -> np.ndarray:
    """RGB pixels ``(H, W, 3)`` uint8 of an encoded image. Its size is read from the
    header and checked before any pixel is decoded: at most ``max_pixels``, and at most
    ``max_total_pixels`` with the ``used`` pixels of the request's earlier images."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_INPUT_FORMATS) as img:
            w, h = img.size
            if w * h > max_pixels:
                raise MediaError(
                    f"field {where!r}: image of {w}x{h} pixels, over max_image_pixels={max_pixels}"
                )
            if max_total_pixels is not None and used + w * h > max_total_pixels:
                raise MediaError(
                    f"field {where!r}: image of {w}x{h} pixels; with the request's earlier "
                    f"images {used + w * h} pixels, over max_total_pixels={max_total_pixels}"
                )
            if img.mode == "RGB":
                return np.asarray(img)
            with img.convert("RGB") as rgb:  # loads the source once, converts once
                return np.asarray(rgb)
    except MediaError:
        raise
    except Image.DecompressionBombError:  # over PIL's own limit, before our check
        raise MediaError(
            f"field {where!r}: image over max_image_pixels={max_pixels} (from its header)"
        ) from None
    except Exception as e:  # PIL raises many kinds for bad data
        # Pillow's own words stay in the log: what reaches a client is this stage's
        log.info("%s: cannot decode image: %s: %s", where, type(e).__name__, e)
        raise MediaError(
            f"field {where!r}: cannot decode image (not a complete image in a format "
            "Pillow reads: PNG, JPEG, WebP, GIF, BMP...)"
        ) from None


def load_images(
    messages: list[dict[str, Any]],
    max_pixels: int,
    max_total_pixels: int | None = None,
    allow_local: bool = False,
) -> list[np.ndarray]:
    """Every image part of the messages, decoded once each, in prompt order; each is
    checked against the limits from its header before it is decoded."""
    out: list[np.ndarray] = []
    used = 0
    for where, part in image_parts(messages):
        data = source_bytes(part, where, allow_local)
        px = decode_image(data, where, max_pixels, max_total_pixels, used)
        used += px.shape[0] * px.shape[1]
        out.append(px)
    return out


def image_hash(pixels: np.ndarray) -> str:
    """Content hash of decoded pixels: equal for the same image in any container."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"rgb:{pixels.shape[0]}x{pixels.shape[1]}:".encode())
    h.update(np.ascontiguousarray(pixels).data)
    return h.hexdigest()
