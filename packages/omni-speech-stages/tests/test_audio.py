"""Audio in (sources, budgets, decoding) and out (streamed and whole files) of
omni_speech.audio, checked against independent readers (libsndfile, PyAV's own decode)."""

from __future__ import annotations

import base64
import io
import re
import struct

import av
import numpy as np
import pytest
import soundfile as sf
from omni_core.errors import UserInputError
from omni_speech import audio
from omni_speech.audio import (
    MIME,
    OUTPUT_FORMATS,
    AudioBudget,
    AudioEncoder,
    AudioError,
    audio_bytes_of,
    decode_audio,
    encode_whole,
    finalize_wav,
    load_audio,
)

SR = 24000
FIELD = "messages[0].content[1].input_audio.data"
F = re.escape(FIELD)  # in the regexes below
LOSSY = ("mp3", "opus", "aac")
SLACK = int(0.1 * SR)  # lossy codecs' priming and padding, at most (mp3, aac: ~2 frames)


def sine(seconds: float = 1.0, rate: int = SR, freq: float = 440.0, amp: float = 0.5):
    t = np.arange(int(round(seconds * rate))) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def int16(x: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(x, -1, 1) * 32767).astype(np.int16)


def wav_of(x: np.ndarray, rate: int) -> bytes:
    """A WAV written by libsndfile (not by the code under test)."""
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def flac_of(x: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def av_file(x: np.ndarray, rate: int, muxer: str, codec: str) -> bytes:
    """A file written by PyAV directly (WebM, M4A)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=muxer) as c:
        st = c.add_stream(codec, rate=48000 if codec == "libopus" else rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(int16(x).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = rate
        rs = av.AudioResampler(format="s16", layout="mono", rate=st.codec_context.sample_rate)
        for f in [*rs.resample(frame), *rs.resample(None)]:
            c.mux(st.encode(f))
        c.mux(st.encode(None))
    return buf.getvalue()


def av_decode(blob: bytes, rate: int = SR) -> np.ndarray:
    """Mono float samples at ``rate`` by PyAV's own probing and decoding."""
    with av.open(io.BytesIO(blob)) as c:
        rs = av.AudioResampler(format="flt", layout="mono", rate=rate)
        frames = [g for f in c.decode(audio=0) for g in rs.resample(f)] + rs.resample(None)
    return np.concatenate([f.to_ndarray()[0] for f in frames])


def av_int16(blob: bytes) -> np.ndarray:
    """All of a file's samples as int16, by ffmpeg's decoder (libsndfile cannot read a
    FLAC of unknown length to its end)."""
    with av.open(io.BytesIO(blob)) as c:
        return np.concatenate([f.to_ndarray().ravel() for f in c.decode(audio=0)])


def best_corr(y: np.ndarray, ref: np.ndarray, max_lag: int = SLACK) -> float:
    """The best correlation of ``y`` (maybe delayed by priming) with ``ref``."""
    n = min(len(y) - max_lag, len(ref))
    return max(float(np.corrcoef(y[lag : lag + n], ref[:n])[0, 1]) for lag in range(max_lag))


def stream(fmt: str, x: np.ndarray, sizes=(1000, 2400, 7, 0, 4800)) -> list[bytes]:
    """What an encoder returns for ``x`` fed in uneven chunks, then finished."""
    enc = AudioEncoder(fmt, SR)
    out, i, k = [], 0, 0
    while i < len(x):
        n = sizes[k % len(sizes)]
        out.append(enc.add(x[i : i + n]))
        i, k = i + n, k + 1
    out.append(enc.finish())
    return out


# ---------------------------------------------------------------------------- output


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_streamed_chunks_concatenate_to_a_file_of_the_samples(fmt):
    x = sine(1.0)
    chunks = stream(fmt, x)
    blob = b"".join(chunks)
    assert blob
    if fmt == "pcm":
        np.testing.assert_array_equal(np.frombuffer(blob, "<i2"), int16(x))
    elif fmt == "wav":  # lossless up to int16: read by libsndfile
        np.testing.assert_array_equal(sf.read(io.BytesIO(blob), dtype="int16")[0], int16(x))
    elif fmt == "flac":
        np.testing.assert_array_equal(av_int16(blob), int16(x))
    else:
        y = av_decode(blob)
        assert abs(len(y) - len(x)) <= SLACK, (len(y), len(x))
        assert best_corr(y, x) > 0.9
        assert 0.8 < np.sqrt(np.mean(y**2)) / np.sqrt(np.mean(x**2)) < 1.2
    if fmt in ("wav", "flac", "mp3", "opus"):  # libsndfile reads these too
        with sf.SoundFile(io.BytesIO(blob)) as f:
            assert f.samplerate == SR and f.channels == 1


def test_streamed_wav_header_has_unknown_sizes_and_the_samples_follow_it():
    chunks = stream("wav", sine(0.1))
    head = chunks[0][:44]
    assert head[:4] == b"RIFF" and head[8:16] == b"WAVEfmt " and head[36:40] == b"data"
    assert struct.unpack("<I", head[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", head[40:44])[0] == 0xFFFFFFFF
    assert all(not c.startswith(b"RIFF") for c in chunks[1:])  # one header, in the first chunk
    assert chunks[-1] == b""  # nothing left to finish


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_encode_whole_gives_an_exact_header(fmt):
    x = sine(1.0)
    blob = encode_whole(x, fmt, SR)
    info = sf.info(io.BytesIO(blob))
    assert info.samplerate == SR
    if fmt in ("wav", "flac"):
        assert info.frames == len(x)
        np.testing.assert_array_equal(sf.read(io.BytesIO(blob), dtype="int16")[0], int16(x))
    else:  # the gapless headers trim the codec's padding: exactly the samples
        assert len(av_decode(blob)) == len(x)
    if fmt == "wav":
        assert struct.unpack("<I", blob[4:8])[0] == len(blob) - 8
        assert struct.unpack("<I", blob[40:44])[0] == 2 * len(x)
        assert finalize_wav(b"".join(stream("wav", x))) == blob


def test_samples_are_clipped_and_rounded_to_int16():
    x = np.array([2.0, -3.0, np.nan, 0.5, -1.0, 1.0, np.inf], dtype=np.float32)
    blob = AudioEncoder("pcm", SR).add(x)
    assert np.frombuffer(blob, "<i2").tolist() == [32767, -32767, 0, 16384, -32767, 32767, 32767]


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_a_stream_without_samples_is_still_a_file(fmt):
    blob = AudioEncoder(fmt, SR).finish()
    if fmt == "wav":
        assert len(blob) == 44 and sf.info(io.BytesIO(blob)).samplerate == SR
    elif fmt == "flac":  # STREAMINFO, no frame
        with av.open(io.BytesIO(blob)) as c:
            assert c.streams.audio[0].codec_context.name == fmt
            assert sum(f.samples for f in c.decode(audio=0)) == 0
    elif fmt == "opus":  # the Ogg Opus header pages only (which ffmpeg will not open)
        assert blob.startswith(b"OggS") and b"OpusHead" in blob and b"OpusTags" in blob
    else:  # headerless formats: nothing
        assert blob == b""


def test_stereo_wav_round_trips():
    x = np.stack([sine(0.2), -sine(0.2)], axis=1)
    enc = AudioEncoder("wav", SR, channels=2)
    blob = enc.add(x[:100]) + enc.add(x[100:]) + enc.finish()
    y, rate = sf.read(io.BytesIO(blob), dtype="int16")
    np.testing.assert_array_equal(y, int16(x))
    with pytest.raises(ValueError, match=r"shape \(n, 2\)"):
        AudioEncoder("wav", SR, channels=2).add(sine(0.1))


def test_encoder_misuse_is_refused():
    with pytest.raises(ValueError, match="one of wav, pcm, flac, mp3, opus, aac"):
        AudioEncoder("ogg", SR)
    enc = AudioEncoder("mp3", SR)
    enc.add(sine(0.1))
    enc.finish()
    assert enc.finish() == b""
    with pytest.raises(ValueError, match="after finish"):
        enc.add(sine(0.1))
    assert set(MIME) == set(OUTPUT_FORMATS)


def test_opus_at_a_rate_it_does_not_take_is_resampled():
    x = sine(0.5, rate=22050)
    enc = AudioEncoder("opus", 22050)
    y = av_decode(enc.add(x) + enc.finish(), rate=22050)
    assert abs(len(y) - len(x)) <= 2205 and best_corr(y, x, 2205) > 0.9


# ----------------------------------------------------------------------------- input


def _inputs() -> dict[str, bytes]:
    x = sine(1.0)
    return {
        "wav": wav_of(x, SR),
        "flac": flac_of(x, SR),
        "mp3": encode_whole(x, "mp3", SR),
        "ogg": encode_whole(x, "opus", SR),
        "aac": encode_whole(x, "aac", SR),
        "webm": av_file(x, SR, "webm", "libopus"),
        "m4a": av_file(x, SR, "ipod", "aac"),
    }


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "ogg", "aac", "webm", "m4a"])
def test_decodes_each_input_format_to_mono_at_the_target_rate(fmt):
    blob = _inputs()[fmt]
    assert audio.sniff(blob) == fmt
    y = decode_audio(blob, where=FIELD, budget=AudioBudget(), fmt=fmt, target_rate=16000)
    assert y.dtype == np.float32 and y.ndim == 1
    ref = sine(1.0, rate=16000)
    assert abs(len(y) - 16000) <= 1600, len(y)
    assert best_corr(y, ref, 1600) > 0.9


def test_channels_are_averaged_to_mono():
    x = sine(0.5, rate=16000)
    same = decode_audio(wav_of(np.stack([x, x], 1), 16000), where=FIELD, budget=AudioBudget())
    assert np.max(np.abs(same)) == pytest.approx(0.5, abs=0.01)  # not +3 dB
    opposite = decode_audio(wav_of(np.stack([x, -x], 1), 16000), where=FIELD, budget=AudioBudget())
    assert np.max(np.abs(opposite)) < 1e-3


def test_bytes_budget_at_the_limit_and_one_past():
    blob = wav_of(sine(0.1, rate=8000), 8000)
    ok = AudioBudget(max_bytes=len(blob))
    assert len(decode_audio(blob, where=FIELD, budget=ok, target_rate=8000)) == 800
    with pytest.raises(AudioError, match=rf"field '{F}'.*{len(blob)} bytes.*{len(blob) - 1}"):
        decode_audio(blob, where=FIELD, budget=AudioBudget(max_bytes=len(blob) - 1))


@pytest.fixture
def no_decoding(monkeypatch):
    """Decoding samples fails the test: a refusal must come from the header."""

    def boom(*a, **k):
        raise AssertionError("samples were decoded")

    monkeypatch.setattr(av, "AudioResampler", boom)


def test_seconds_budget_at_the_limit_and_one_sample_past(no_decoding):
    budget = AudioBudget(max_seconds=1.0)
    with pytest.raises(AudioError, match=rf"field '{F}': audio of 1\.0001\d* s is over the 1 s"):
        decode_audio(wav_of(np.zeros(8001, np.float32), 8000), where=FIELD, budget=budget)


def test_seconds_budget_passes_a_file_of_exactly_the_budget():
    budget = AudioBudget(max_seconds=1.0)
    y = decode_audio(wav_of(sine(1.0, 8000), 8000), where=FIELD, budget=budget, target_rate=8000)
    assert len(y) == 8000


def test_sample_rate_budget_at_the_limit():
    blob = wav_of(np.zeros(1600, np.float32), 16000)
    budget = AudioBudget(max_sample_rate=16000)
    assert len(decode_audio(blob, where=FIELD, budget=budget)) == 1600


def test_sample_rate_budget_one_past(no_decoding):
    blob = wav_of(np.zeros(1600, np.float32), 16001)
    budget = AudioBudget(max_sample_rate=16000)
    with pytest.raises(AudioError, match=rf"field '{F}': audio sampled at 16001 Hz .* 16000"):
        decode_audio(blob, where=FIELD, budget=budget)


def test_channels_budget_at_the_limit():
    blob = wav_of(np.zeros((1600, 2), np.float32), 16000)
    assert len(decode_audio(blob, where=FIELD, budget=AudioBudget(max_channels=2))) == 1600


def test_channels_budget_one_past(no_decoding):
    blob = wav_of(np.zeros((1600, 3), np.float32), 16000)
    with pytest.raises(AudioError, match=rf"field '{F}': audio with 3 channels .* of 2"):
        decode_audio(blob, where=FIELD, budget=AudioBudget(max_channels=2))


def _lying_flac(seconds: float, claims: float, rate: int = 8000) -> bytes:
    """A FLAC of ``seconds`` whose STREAMINFO claims ``claims`` seconds."""
    blob = bytearray(flac_of(sine(seconds, rate=rate), rate))
    assert blob[:4] == b"fLaC" and blob[4] & 0x7F == 0  # STREAMINFO first, at byte 8
    total = int(claims * rate)  # 36 bits from the low nibble of STREAMINFO's byte 13
    blob[21] = (blob[21] & 0xF0) | (total >> 32)
    blob[22:26] = struct.pack(">I", total & 0xFFFFFFFF)
    return bytes(blob)


def test_a_header_that_lies_about_the_duration_is_caught_while_decoding():
    blob = _lying_flac(seconds=3.0, claims=1.0)
    with av.open(io.BytesIO(blob), format="flac") as c:  # the lie is what the header says
        assert float(c.streams.audio[0].duration * c.streams.audio[0].time_base) == 1.0
    with pytest.raises(AudioError, match=rf"field '{F}': audio is over the 2 s budget"):
        decode_audio(blob, where=FIELD, budget=AudioBudget(max_seconds=2.0))
    # within the budget the lie costs nothing: every sample is decoded
    y = decode_audio(blob, where=FIELD, budget=AudioBudget(max_seconds=5.0), target_rate=8000)
    assert len(y) == 24000


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"hello, this is not audio",
        bytes(range(256)) * 8,
        b"RIFF\x00\x10\x00\x00WAVE" + np.random.default_rng(0).bytes(4000),
        b"fLaC" + np.random.default_rng(1).bytes(4000),
        b"OggS" + np.random.default_rng(2).bytes(4000),
        b"\x1a\x45\xdf\xa3" + np.random.default_rng(3).bytes(4000),
        b"\x00\x00\x00\x18ftypM4A " + np.random.default_rng(4).bytes(4000),
        b"\xff\xfb" + np.random.default_rng(5).bytes(4000),
        b"\xff\xf1" + np.random.default_rng(6).bytes(4000),
        b"ID3\x04\x00\x00\x00\x00\x00\x00" + np.random.default_rng(7).bytes(4000),
    ],
)
def test_garbage_is_a_user_error_naming_the_field(blob):
    with pytest.raises(AudioError, match=rf"^field '{F}': ") as e:
        decode_audio(blob, where=FIELD, budget=AudioBudget())
    assert isinstance(e.value, UserInputError)


def test_a_video_only_or_non_audio_container_is_refused():
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as c:
        st = c.add_stream("ffv1", rate=1)
        st.width = st.height = 16
        frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
        c.mux(st.encode(frame.reformat(format=st.pix_fmt)))
        c.mux(st.encode(None))
    with pytest.raises(AudioError, match="holds no audio stream"):
        decode_audio(buf.getvalue(), where=FIELD, budget=AudioBudget())


def test_truncated_files():
    wav = wav_of(sine(1.0, rate=8000), 8000)
    with pytest.raises(AudioError, match=rf"field '{F}': cannot decode .* wav"):
        decode_audio(wav[:30], where=FIELD, budget=AudioBudget())  # inside the header
    flac = flac_of(sine(3.0, rate=8000), 8000)
    with pytest.raises(AudioError, match=rf"field '{F}': cannot decode .* flac"):
        decode_audio(flac[: len(flac) // 2], where=FIELD, budget=AudioBudget())
    # PCM has no frames to tell a cut by: the samples that are there are the audio
    y = decode_audio(wav[: 44 + 8000], where=FIELD, budget=AudioBudget(), target_rate=8000)
    assert len(y) == 4000


def test_a_format_name_we_do_not_read_is_refused():
    with pytest.raises(AudioError, match=rf"field '{F}': audio format 'exe' is not supported"):
        decode_audio(wav_of(sine(0.1), SR), where=FIELD, budget=AudioBudget(), fmt="exe")


# --------------------------------------------------------------------------- sources

WHERE = "messages[0].content[1]"
W = re.escape(WHERE)


def test_input_audio_part_gives_its_bytes_format_and_field():
    blob = wav_of(sine(0.1), SR)
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(blob).decode(), "format": "wav"},
    }
    src = audio_bytes_of(part, WHERE, max_bytes=len(blob))
    assert src == (blob, "wav", f"{WHERE}.input_audio.data")
    y = load_audio(part, WHERE, budget=AudioBudget(), target_rate=SR)
    assert len(y) == len(sine(0.1))
    with pytest.raises(AudioError, match=rf"field '{W}\.input_audio\.data': audio of 0\.1 s"):
        load_audio(part, WHERE, budget=AudioBudget(max_seconds=0.05))


def test_base64_over_the_budget_is_refused_before_it_is_decoded(monkeypatch):
    blob = bytes(range(256)) * 4  # 1024 bytes
    text = base64.b64encode(blob).decode()
    part = {"type": "input_audio", "input_audio": {"data": text}}
    assert audio_bytes_of(part, WHERE, max_bytes=1024).data == blob  # at the limit

    def boom(*a, **k):
        raise AssertionError("base64 was decoded")

    monkeypatch.setattr(audio.base64, "b64decode", boom)
    over = rf"field '{W}\.input_audio\.data': audio of about 1\d{{3}} bytes is over the 1023"
    with pytest.raises(AudioError, match=over):
        audio_bytes_of(part, WHERE, max_bytes=1023)
    url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + text}}
    with pytest.raises(AudioError, match=rf"field '{W}\.audio_url\.url': .* over the 1000"):
        audio_bytes_of(url, WHERE, max_bytes=1000)


def test_data_urls_and_raw_bytes():
    blob = flac_of(sine(0.1), SR)
    text = base64.b64encode(blob).decode()
    url = {"type": "audio_url", "audio_url": {"url": "data:audio/x-flac;base64," + text}}
    assert audio_bytes_of(url, WHERE, max_bytes=1 << 20) == (blob, "flac", f"{WHERE}.audio_url.url")
    qwen = {"type": "audio", "audio": "data:audio/flac;base64," + text}
    assert audio_bytes_of(qwen, WHERE, max_bytes=1 << 20) == (blob, "flac", f"{WHERE}.audio")
    assert audio_bytes_of(blob, WHERE, max_bytes=1 << 20) == (blob, None, WHERE)
    inline_url = {"type": "input_audio", "input_audio": {"data": "data:audio/flac;base64," + text}}
    assert audio_bytes_of(inline_url, WHERE, max_bytes=1 << 20).format == "flac"
    with pytest.raises(AudioError, match=rf"field '{W}': audio of {len(blob)} bytes"):
        audio_bytes_of(blob, WHERE, max_bytes=len(blob) - 1)


@pytest.mark.parametrize(
    "part, field, message",
    [
        (
            {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
            "audio_url.url",
            "remote audio URLs are not fetched here",
        ),
        ({"type": "audio", "audio": "http://example.com/a.wav"}, "audio", "remote audio URLs"),
        ({"type": "audio", "audio": "/etc/passwd"}, "audio", "expected a base64 data URL"),
        (
            {"type": "audio_url", "audio_url": {"url": "data:audio/wav,RIFF%00"}},
            "audio_url.url",
            "expected a base64 data URL",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "not base64!"}},
            "input_audio.data",
            "invalid base64",
        ),
        ({"type": "input_audio", "input_audio": {"format": "wav"}}, "input_audio.data", "missing"),
        (
            {"type": "input_audio", "input_audio": {"data": "", "format": "midi"}},
            "input_audio.format",
            "audio format 'midi' is not supported; one of",
        ),
        ({"type": "input_audio", "input_audio": "AAAA"}, "input_audio", "expected an object"),
        ({"type": "image_url"}, "type", "not an audio part"),
    ],
)
def test_bad_sources_are_refused_naming_the_field(part, field, message):
    with pytest.raises(AudioError, match=rf"^field '{W}\.{field}': .*{message}"):
        audio_bytes_of(part, WHERE, max_bytes=1 << 20)
