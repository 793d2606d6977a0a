import struct
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from omni_core.image_files import png_bytes, save_image_event


def _decode_png(data: bytes) -> np.ndarray:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2)
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()  # filter type none on every row
    return raw[:, 1:].reshape(h, w, 3)


def test_png_round_trip():
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    assert np.array_equal(_decode_png(png_bytes(rgb)), rgb)


def test_png_rejects_other_arrays():
    with pytest.raises(ValueError, match="uint8"):
        png_bytes(np.zeros((4, 4), np.float32))


def test_save_image_event_writes_previews_and_encoded_images(tmp_path):
    preview = SimpleNamespace(
        stage="sample", step=3, payload={}, arrays={"preview": np.zeros((2, 3, 3), np.uint8)}
    )
    final = SimpleNamespace(
        stage="encode", step=9, payload={"format": "jpeg"}, arrays={"image": b"\xff\xd8jpeg"}
    )
    other = SimpleNamespace(stage="x", step=1, payload={}, arrays={"h": np.zeros(4)})
    (p,) = save_image_event(preview, tmp_path, "r1")
    (f,) = save_image_event(final, tmp_path, "r1")
    assert save_image_event(other, tmp_path, "r1") == []
    assert p.name == "r1-sample-preview-step003.png" and _decode_png(p.read_bytes()).shape == (
        2,
        3,
        3,
    )
    assert f.name == "r1.jpg" and f.read_bytes() == b"\xff\xd8jpeg"
