"""Images in chat requests: where they are, how they load, and their content hashes.

An image part is ``{"type": "image", "image": path | bytes | data URL}`` or
``{"type": "image_url", "image_url": {"url": path | data URL}}``. Nothing is fetched
over the network. Every error names the part (``messages[0].content[1]``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from omni_ar.params import RequestError


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


def source_bytes(part: dict[str, Any], where: str) -> bytes:
    """The encoded image of a part, from bytes, a base64 data URL or a local file."""
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
            f"field {where!r}: remote URLs are not fetched; pass a local path, bytes or a "
            "base64 data URL"
        )
    path = Path(src.removeprefix("file://"))
    try:
        return path.read_bytes()
    except OSError as e:
        raise MediaError(f"field {where!r}: cannot read image file {str(path)!r}: {e}") from None


def decode_image(data: bytes, where: str, max_pixels: int) -> np.ndarray:
    """RGB pixels ``(H, W, 3)`` uint8 of an encoded image."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > max_pixels:
                raise MediaError(
                    f"field {where!r}: image of {w}x{h} pixels, over max_image_pixels={max_pixels}"
                )
            return np.asarray(img.convert("RGB"))
    except MediaError:
        raise
    except Exception as e:  # PIL raises many kinds for bad data
        raise MediaError(f"field {where!r}: cannot decode image: {e}") from None


def load_images(messages: list[dict[str, Any]], max_pixels: int) -> list[np.ndarray]:
    """Every image part of the messages, decoded, in prompt order."""
    return [
        decode_image(source_bytes(part, where), where, max_pixels)
        for where, part in image_parts(messages)
    ]


def image_hash(pixels: np.ndarray) -> str:
    """Content hash of decoded pixels: equal for the same image in any container."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"rgb:{pixels.shape[0]}x{pixels.shape[1]}:".encode())
    h.update(np.ascontiguousarray(pixels).data)
    return h.hexdigest()
