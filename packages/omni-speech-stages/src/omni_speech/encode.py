"""``speech.audio_encode``: the waveform a pipeline speaks -> encoded audio bytes, streamed.

Its upstream (``speech.token2wav``) sends segments with ``arrays={"audio": float32 (n,)}``
and ``payload={"sample_rate": int}`` (at least the first one), several per request. Each
window's samples go through the request's :class:`~omni_speech.audio.AudioEncoder` and
the bytes it has ready go out at once as a segment with ``arrays={"audio": bytes}`` and
``payload={"media_type": ..., "format": ..., "sample_rate": ...}`` (a window that makes
no bytes yet, as an MP3 frame fills, emits nothing); the last window (maybe empty)
finishes the file, in a segment with ``is_last=True``. All of a request's ``audio`` bytes
concatenated are one file (a WAV's sizes are ``0xFFFFFFFF``: see :mod:`omni_speech.audio`).
A request whose upstream spoke no sample ends with a segment without arrays.

The format is the request's ``audio.format`` (chat completions' ``audio: {voice,
format}``), else its ``response_format`` when that is a string (``/v1/audio/speech``),
else the ``format`` option; one of :data:`~omni_speech.audio.OUTPUT_FORMATS`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgspec
import numpy as np
from omni_core.plugin import (
    MEDIA_TYPE,
    Stage,
    StageContext,
    StageEvent,
    StageInput,
    UserInputError,
    Window,
)

from omni_speech.audio import MIME, OUTPUT_FORMATS, AudioEncoder

__all__ = ["AudioEncode", "AudioEncodeOptions", "request_format"]


class AudioEncodeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options:`` of ``speech.audio_encode``."""

    format: str = "wav"
    """The format of a request that names none."""

    def __post_init__(self) -> None:
        if self.format not in OUTPUT_FORMATS:
            raise ValueError(f"format {self.format!r}: one of {', '.join(OUTPUT_FORMATS)}")


def request_format(request: Mapping[str, Any], default: str) -> str:
    """The audio format a request asks for (``audio.format``, else a string
    ``response_format``, else ``default``); :class:`UserInputError` naming the field
    for one not in :data:`~omni_speech.audio.OUTPUT_FORMATS`."""
    audio = request.get("audio")
    if audio is not None and not isinstance(audio, Mapping):
        raise UserInputError("field 'audio': expected an object ({voice, format})")
    if audio is not None and audio.get("format") is not None:
        value, where = audio["format"], "audio.format"
    elif isinstance(request.get("response_format"), str):  # chat's is an object: not ours
        value, where = request["response_format"], "response_format"
    else:
        return default
    if value not in OUTPUT_FORMATS:
        raise UserInputError(
            f"field {where!r}: audio format {value!r} is not supported; one of "
            + ", ".join(OUTPUT_FORMATS)
        )
    return value


class _Stream:
    """One request's output: its format, and its encoder once the sample rate is known."""

    def __init__(self, fmt: str) -> None:
        self.format = fmt
        self.encoder: AudioEncoder | None = None


class AudioEncode(Stage):
    """Float samples -> WAV / PCM / FLAC / MP3 / Opus / AAC bytes, per request, streamed."""

    Options = AudioEncodeOptions

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self.streams: dict[str, _Stream] = {}

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            rid = inp.request_id
            s = self.streams.get(rid)
            if s is None:
                try:
                    fmt = request_format(inp.request, self.options.format)
                except UserInputError as e:
                    yield inp.fail(e)
                    continue
                s = self.streams[rid] = _Stream(fmt)
            try:
                data = self._encode(s, inp.window)
                if inp.last and s.encoder is not None:
                    data += s.encoder.finish()
            except Exception as e:  # upstream's fault or the codec's: the stage's failure
                self.end_request(rid)
                yield inp.fail(f"cannot encode {s.format} audio: {e}")
                continue
            if s.encoder is None:  # no sample yet
                if inp.last:
                    yield inp.segment(is_last=True)
                continue
            if data or inp.last:
                payload = {
                    MEDIA_TYPE: MIME[s.format],  # the core's contract: what the bytes are
                    "format": s.format,
                    "sample_rate": s.encoder.sample_rate,
                }
                arrays = {"audio": data} if data else None
                yield inp.segment(payload=payload, arrays=arrays, is_last=inp.last)

    def _encode(self, s: _Stream, window: Window) -> bytes:
        """The bytes of a window's samples, piece by piece (each may set the rate)."""
        out = []
        for piece in window.pieces:
            rate = piece.payload.get("sample_rate")
            if rate is not None and s.encoder is not None and rate != s.encoder.sample_rate:
                raise ValueError(f"sample_rate changed from {s.encoder.sample_rate} to {rate}")
            samples = piece.arrays.get("audio")
            if s.encoder is None and rate is not None:
                if not isinstance(rate, int) or rate <= 0:
                    raise ValueError(f"upstream sample_rate {rate!r} is not a positive int")
                s.encoder = AudioEncoder(s.format, rate)
            if samples is None:
                continue
            if s.encoder is None:
                raise ValueError("upstream sent audio before any sample_rate")
            out.append(s.encoder.add(np.asarray(samples, dtype=np.float32)))
        return b"".join(out)

    def end_request(self, request_id: str) -> None:
        s = self.streams.pop(request_id, None)
        if s is not None and s.encoder is not None:
            s.encoder.close()

    def close(self) -> None:
        for rid in list(self.streams):
            self.end_request(rid)
