import struct
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from omni_core.client.image_files import append_media_segment, png_bytes, save_image_event
from omni_core.media import MEDIA_TYPE, extension, media_type_of, subtype


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
        stage="encode",
        step=9,
        payload={MEDIA_TYPE: "image/jpeg"},
        arrays={"image": b"\xff\xd8jpeg"},
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


def test_encoded_bytes_are_named_by_media_type_only(tmp_path):
    """The core reads the ``media_type`` contract, never a family's own keys."""
    webp = SimpleNamespace(
        stage="enc", step=1, payload={"media_type": "image/WEBP"}, arrays={"image": b"RIFF"}
    )
    wav = SimpleNamespace(
        stage="enc", step=1, payload={"media_type": "audio/wav"}, arrays={"audio": b"RIFF"}
    )
    family_key = SimpleNamespace(
        stage="enc", step=1, payload={"format": "jpeg"}, arrays={"image": b"\xff\xd8"}
    )
    assert [p.name for p in save_image_event(webp, tmp_path, "a")] == ["a.webp"]
    assert [p.name for p in save_image_event(wav, tmp_path, "b")] == ["b.wav"]
    assert save_image_event(family_key, tmp_path, "c") == []


@pytest.mark.parametrize(
    ("media_type", "ext", "sub"),
    [
        ("image/jpeg", "jpg", "jpeg"),
        ("image/png", "png", "png"),
        ("image/webp", "webp", "webp"),
        ("Image/JPEG; q=1", "jpg", "jpeg"),
        ("application/x-omni-unknown", "bin", "x-omni-unknown"),
    ],
)
def test_media_type_maps_to_extension_and_format(media_type, ext, sub):
    assert extension(media_type) == ext
    assert subtype(media_type) == sub


def test_media_type_of_payloads():
    assert media_type_of({"media_type": "image/PNG"}) == "image/png"
    assert media_type_of({"media_type": "png"}) is None  # not a MIME type
    assert media_type_of({"format": "png"}) is None
    assert media_type_of(None) is None and media_type_of("text") is None


def test_streamed_media_segments_append_in_order(tmp_path):
    """omni run --out: audio chunks of one request and stage go to one file, in order; a
    new run truncates it; a segment with no media type or no bytes writes nothing."""

    def seg(stage, chunk, media="audio/wav"):
        payload = {MEDIA_TYPE: media} if media else {}
        return SimpleNamespace(stage=stage, payload=payload, arrays={"audio": chunk})

    (tmp_path / "req-audio.wav").write_bytes(b"stale")
    started: set = set()
    for chunk in (b"RIFF", b"-a", b"-b"):
        path = append_media_segment(seg("audio", chunk), tmp_path, "req", started)
    assert path == tmp_path / "req-audio.wav"
    assert path.read_bytes() == b"RIFF-a-b"
    assert append_media_segment(seg("audio", b"x", media=None), tmp_path, "req", started) is None
    none = SimpleNamespace(stage="audio", payload={MEDIA_TYPE: "audio/wav"}, arrays={})
    assert append_media_segment(none, tmp_path, "req", started) is None
    other = append_media_segment(seg("enc", b"ID3", "audio/mpeg"), tmp_path, "req", started)
    assert other.name == "req-enc.mp3" and other.read_bytes() == b"ID3"
    assert path.read_bytes() == b"RIFF-a-b"
