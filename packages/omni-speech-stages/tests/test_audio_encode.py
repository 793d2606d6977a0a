"""The speech.audio_encode stage, run inline on hand-made windows of token2wav's segments."""

from __future__ import annotations

import io

import av
import msgspec
import numpy as np
import pytest
import soundfile as sf
from omni_core import StageInput
from omni_core.dataplane.windows import Piece, Window
from omni_core.events import Error, Segment
from omni_core.media import extension, media_type_of
from omni_core.stage import StageContext
from omni_speech.audio import MIME, OUTPUT_FORMATS
from omni_speech.encode import AudioEncode

SR = 24000
EDGE = "token2wav"


def sine(n: int, start: int = 0) -> np.ndarray:
    t = np.arange(start, start + n) / SR
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def make(options: dict | None = None) -> AudioEncode:
    return AudioEncode(StageContext("audio", "speech.audio_encode", options or {}))


def window(index: int, chunks: list[np.ndarray | None], last: bool, rate: int | None = SR):
    """A window of token2wav's segments: each chunk of samples (None: a unit-less end
    marker without arrays), the first one carrying the sample rate."""
    pieces = []
    for k, chunk in enumerate(chunks):
        payload = {"sample_rate": rate} if rate is not None and k == 0 else {}
        if chunk is None:
            pieces.append(Piece(index * 10 + k, [], {}, payload))
        else:
            pieces.append(Piece(index * 10 + k, None, {"audio": chunk}, payload))
    return Window(EDGE, index, 0, 0, pieces, last)


def trigger(rid: str, request: dict, index: int, chunks, last: bool, rate: int | None = SR):
    w = window(index, chunks, last, rate)
    return StageInput(rid, request, {EDGE: w}, first=index == 0, last=last)


def run(stage: AudioEncode, inputs: list[StageInput]) -> list:
    out = []
    for ev in stage.process(inputs):
        out.extend(ev if isinstance(ev, list) else [ev])
    return out


def feed(stage: AudioEncode, rid: str, request: dict, windows: list[list]) -> list:
    """Each window in its own trigger, the last one flagged last; every event."""
    events = []
    for i, chunks in enumerate(windows):
        events += run(stage, [trigger(rid, request, i, chunks, i == len(windows) - 1)])
    return events


def audio_of(events: list) -> bytes:
    return b"".join(ev.arrays["audio"] for ev in events if getattr(ev, "arrays", None))


def decoded(blob: bytes) -> np.ndarray:
    with av.open(io.BytesIO(blob)) as c:
        rs = av.AudioResampler(format="flt", layout="mono", rate=SR)
        frames = [g for f in c.decode(audio=0) for g in rs.resample(f)] + rs.resample(None)
    return np.concatenate([f.to_ndarray()[0] for f in frames])


def int16(x: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(x, -1, 1) * 32767).astype(np.int16)


CHUNKS = [[sine(2400, 0)], [sine(2400, 2400), sine(1200, 4800)], [sine(6000, 6000)]]
SAMPLES = np.concatenate([c for w in CHUNKS for c in w])


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_streamed_segments_concatenate_to_one_file(fmt):
    stage = make()
    events = feed(stage, "r", {"audio": {"voice": "Chelsie", "format": fmt}}, CHUNKS)
    assert all(isinstance(ev, Segment) for ev in events)
    assert events[-1].is_last and not any(ev.is_last for ev in events[:-1])
    for ev in events:
        assert ev.payload == {"media_type": MIME[fmt], "format": fmt, "sample_rate": SR}
        assert isinstance(ev.arrays["audio"], bytes) if hasattr(ev, "arrays") else ev.is_last
    assert media_type_of(events[0].payload) == MIME[fmt]
    assert extension(MIME[fmt]) == {"opus": "ogg"}.get(fmt, fmt)
    blob = audio_of(events)
    if fmt == "pcm":
        np.testing.assert_array_equal(np.frombuffer(blob, "<i2"), int16(SAMPLES))
    elif fmt == "wav":
        y, rate = sf.read(io.BytesIO(blob), dtype="int16")
        assert rate == SR
        np.testing.assert_array_equal(y, int16(SAMPLES))
    elif fmt == "flac":
        with av.open(io.BytesIO(blob)) as c:
            y = np.concatenate([f.to_ndarray().ravel() for f in c.decode(audio=0)])
        np.testing.assert_array_equal(y, int16(SAMPLES))
    else:
        y = decoded(blob)
        assert abs(len(y) - len(SAMPLES)) <= 0.1 * SR
    if fmt in ("wav", "pcm"):  # every window's bytes go out with it
        assert len(events) == len(CHUNKS)
    assert stage.streams  # kept until the runtime ends the request
    stage.end_request("r")
    assert not stage.streams


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus", "aac", "wav"])
def test_an_empty_closing_window_finishes_the_file(fmt):
    stage = make()
    request = {"response_format": fmt}
    events = feed(stage, "r", request, [[sine(2400)], [sine(2400, 2400)], []])
    last = events[-1]
    assert last.is_last and last.payload["format"] == fmt
    if fmt == "wav":  # nothing was held back: the closing segment has no bytes
        assert not hasattr(last, "arrays")
    else:  # the encoder's held-back frames and trailer
        assert last.arrays["audio"]
    y = decoded(audio_of(events))
    assert abs(len(y) - 4800) <= 0.1 * SR
    # an end marker (a unit-less segment) closes the same way
    events = feed(make(), "s", request, [[sine(2400)], [None]])
    assert events[-1].is_last and abs(len(decoded(audio_of(events))) - 2400) <= 0.1 * SR


def test_an_unknown_format_fails_only_that_request():
    stage = make()
    bad = trigger("bad", {"audio": {"voice": "Ethan", "format": "ogg"}}, 0, [sine(100)], True)
    good = trigger("good", {}, 0, [sine(100)], True)
    events = run(stage, [bad, good])
    assert isinstance(events[0], Error) and events[0].request_id == "bad"
    assert events[0].code == "invalid_request"
    assert "field 'audio.format': audio format 'ogg' is not supported" in events[0].message
    assert "wav, pcm, flac, mp3, opus, aac" in events[0].message
    assert [type(ev) for ev in events[1:]] == [Segment]
    assert events[1].request_id == "good" and events[1].is_last
    assert events[1].payload["format"] == "wav"  # the option's default
    assert "bad" not in stage.streams
    speech = run(stage, [trigger("s", {"response_format": "m4a"}, 0, [sine(10)], True)])
    assert speech[0].code == "invalid_request" and "field 'response_format'" in speech[0].message


def test_format_precedence_and_chat_response_format_is_not_audio():
    stage = make({"format": "flac"})
    both = {"audio": {"format": "mp3"}, "response_format": "opus"}
    chat = {"response_format": {"type": "json_object"}}  # chat's structured output
    for rid, request, fmt in (("a", both, "mp3"), ("b", chat, "flac"), ("c", {}, "flac")):
        events = run(stage, [trigger(rid, request, 0, [sine(2400)], True)])
        assert events[-1].payload["format"] == fmt, rid


def test_options_are_checked():
    with pytest.raises(msgspec.ValidationError):
        make({"fromat": "wav"})
    with pytest.raises(ValueError, match="format 'ogg': one of wav"):
        make({"format": "ogg"})


def test_a_request_that_spoke_nothing_ends_without_audio():
    stage = make()
    events = run(stage, [trigger("r", {}, 0, [None], True, rate=None)])
    assert len(events) == 1 and events[0].is_last and not hasattr(events[0], "arrays")


def test_upstream_faults_are_the_stages_failure_not_the_clients():
    stage = make()
    no_rate = run(stage, [trigger("a", {}, 0, [sine(100)], True, rate=None)])
    assert isinstance(no_rate[0], Error) and no_rate[0].code != "invalid_request"
    assert "before any sample_rate" in no_rate[0].message
    run(stage, [trigger("b", {}, 0, [sine(100)], False)])
    changed = run(stage, [trigger("b", {}, 1, [sine(100)], True, rate=16000)])
    assert isinstance(changed[0], Error) and "changed from 24000 to 16000" in changed[0].message
    assert not stage.streams  # both forgotten


def test_a_cancelled_request_is_forgotten_mid_stream():
    stage = make()
    run(stage, [trigger("r", {"response_format": "mp3"}, 0, [sine(2400)], False)])
    encoder = stage.streams["r"].encoder
    stage.end_request("r")
    assert not stage.streams and encoder.finished
    stage.end_request("r")  # twice: nothing left to do
