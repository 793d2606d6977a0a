"""Image events to files, for ``omni run --out``: encoded bytes as they are, named by the
``media_type`` payload key (:mod:`omni_core.media`, the core's contract), raw RGB previews
as PNG (written here with zlib, so the core needs no imaging library)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from omni_core.media import extension, media_type_of


def png_bytes(rgb: np.ndarray) -> bytes:
    """A PNG file of a ``uint8 (height, width, 3)`` image."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected uint8 (height, width, 3), got {rgb.dtype} {rgb.shape}")
    h, w, _ = rgb.shape
    rows = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
        + chunk(b"IEND", b"")
    )


def save_image_event(ev: Any, out_dir: Path, tag: str) -> list[Path]:
    """Write the images an event carries: ``bytes`` as they are when the payload names
    their ``media_type`` (the extension follows it: ``image/jpeg`` -> ``.jpg``), ``uint8
    (h, w, 3)`` arrays as PNG. Returns the files written."""
    written = []
    media_type = media_type_of(ev.payload)
    step = getattr(ev, "step", None)
    for key, value in getattr(ev, "arrays", {}).items():
        if isinstance(value, bytes) and media_type is not None:
            name, data = f"{tag}.{extension(media_type)}", value
        elif isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 3:
            name, data = f"{tag}-{ev.stage}-{key}-step{step:03d}.png", png_bytes(value)
        else:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / name
        path.write_bytes(data)
        written.append(path)
    return written


def append_media_segment(ev: Any, out_dir: Path, tag: str, started: set[Path]) -> Path | None:
    """A streamed medium (a segment whose payload names its ``media_type`` and whose
    arrays carry bytes: audio chunks) appended to one file per request and stage, in
    arrival order; ``started`` holds the files begun by this run (truncated once).
    Returns the file, or None when the event carries no encoded bytes."""
    media_type = media_type_of(ev.payload)
    chunks = [v for v in getattr(ev, "arrays", {}).values() if isinstance(v, bytes)]
    if media_type is None or not chunks:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{tag}-{ev.stage}.{extension(media_type)}"
    with open(path, "ab" if path in started else "wb") as f:
        for chunk in chunks:
            f.write(chunk)
    started.add(path)
    return path
