"""Audio in and out of speech requests: decoding a client's audio within a budget, and
encoding the audio a pipeline speaks.

**In.** An audio part (OpenAI's ``input_audio``, an ``audio_url`` with a ``data:`` URL, a
Qwen-style ``audio`` part, or raw bytes) gives its bytes through :func:`audio_bytes_of`
(base64 refused by its length before it is decoded; remote URLs are the server's to
fetch, never a stage's). :func:`decode_audio` then checks, in this order, the byte count,
the container (sniffed from the first bytes, one of :data:`INPUT_FORMATS`: ffmpeg never
probes, so no demuxer that opens other files or URLs, such as concat or HLS, is reached),
the codec, the sample rate, the channel count and the duration the header declares, all
before any sample is decoded; while decoding, it stops as soon as the decoded audio is
past the budget (a header can lie). Every error is an :class:`AudioError` (a
:class:`~omni_core.plugin.UserInputError`) naming the request field.

**Out.** :class:`AudioEncoder` encodes one request's stream of float samples, chunk by
chunk, into one of :data:`OUTPUT_FORMATS` (OpenAI's ``response_format`` names); what
``add`` and ``finish`` return, concatenated, is one file. A streamed WAV cannot know its
length when its header goes out, so its RIFF and ``data`` sizes are ``0xFFFFFFFF``, as
streaming servers (and ffmpeg writing to a pipe) do: readers take the data to the end of
the file. :func:`encode_whole` gives an exact file (exact WAV sizes, FLAC's STREAMINFO
sample count and MP3's gapless header) where the samples are all at hand, and
:func:`finalize_wav` fixes the sizes of a streamed WAV once it is complete.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import struct
from collections.abc import Mapping
from fractions import Fraction
from typing import Annotated, Any, NamedTuple

import msgspec
import numpy as np
from omni_core.plugin import UserInputError

__all__ = [
    "INPUT_FORMATS",
    "MIME",
    "OUTPUT_FORMATS",
    "AudioBudget",
    "AudioEncoder",
    "AudioError",
    "AudioSource",
    "audio_bytes_of",
    "decode_audio",
    "encode_whole",
    "finalize_wav",
    "load_audio",
    "sniff",
]

log = logging.getLogger("omni.speech.audio")


class AudioError(UserInputError):
    """Audio a request carries that is refused: over its budget, not decodable, or in
    the wrong place (a remote URL); the message names the field."""


class AudioBudget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The most one audio input may be; each is checked before the samples are decoded."""

    max_bytes: Annotated[int, msgspec.Meta(gt=0)] = 25 << 20
    """Encoded bytes (of base64: the bytes it decodes to)."""
    max_seconds: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    """Duration, from the header and again while decoding."""
    max_sample_rate: Annotated[int, msgspec.Meta(gt=0)] = 192_000
    """Sample rate in Hz, as stored (before resampling)."""
    max_channels: Annotated[int, msgspec.Meta(gt=0)] = 8
    """Channels, as stored (before the mix down to mono)."""


# ---------------------------------------------------------------------------- input

INPUT_FORMATS = ("wav", "flac", "mp3", "ogg", "webm", "m4a", "aac")
"""The containers an input is decoded from (``ogg``: Opus, Vorbis or FLAC inside;
``webm``: any Matroska; ``m4a``: MP4/MOV; ``aac``: ADTS); anything else is refused."""

# ffmpeg's demuxer of each input format; only these are ever opened, by name
_DEMUXERS = {
    "wav": "wav",
    "flac": "flac",
    "mp3": "mp3",
    "ogg": "ogg",
    "webm": "matroska",
    "m4a": "mov",
    "aac": "aac",
}
# demuxer options: an MP4 must not follow its data references to other files (ffmpeg's
# default, kept explicit)
_DEMUXER_OPTIONS = {"mov": {"enable_drefs": "0", "use_absolute_path": "0"}}
# formats whose header gives the duration (not an estimate from the bit rate, which a VBR
# MP3 without a Xing header or an ADTS stream would make, maybe far too long): only
# these are refused from their header; the others by decoding (which stops at the budget)
_HEADER_DURATION = frozenset({"wav", "flac", "ogg", "webm", "m4a"})
# ffmpeg's decoders an input may use, besides every pcm_* one
_DECODERS = frozenset(
    {"flac", "mp3", "mp3float", "opus", "libopus", "vorbis", "aac", "aac_fixed", "alac"}
)
# what decoding may go past the budget by before it stops: MP3 and AAC pad their first
# and last frames (tens of milliseconds), so a file of exactly the budget passes
DECODE_SLACK_S = 0.1
# the format a client may name (``input_audio.format``, a data URL's type) -> ours
_FORMAT_NAMES = {
    "wav": "wav",
    "wave": "wav",
    "flac": "flac",
    "mp3": "mp3",
    "mpeg": "mp3",
    "ogg": "ogg",
    "oga": "ogg",
    "opus": "ogg",
    "webm": "webm",
    "m4a": "m4a",
    "mp4": "m4a",
    "aac": "aac",
}
_MIME_FORMATS = {
    "audio/wav": "wav",
    "audio/wave": "wav",
    "audio/x-wav": "wav",
    "audio/vnd.wave": "wav",
    "audio/flac": "flac",
    "audio/x-flac": "flac",
    "audio/mpeg": "mp3",
    "audio/mp3": "mp3",
    "audio/ogg": "ogg",
    "audio/opus": "ogg",
    "audio/webm": "webm",
    "audio/mp4": "m4a",
    "audio/m4a": "m4a",
    "audio/x-m4a": "m4a",
    "audio/aac": "aac",
}


class AudioSource(NamedTuple):
    """An audio part's bytes, the format it claims (None: it claims none) and the field
    the bytes came from (for :func:`decode_audio`'s ``where``)."""

    data: bytes
    format: str | None
    where: str


def _over_bytes(where: str, n: int, max_bytes: int, about: bool = False) -> AudioError:
    size = f"about {n}" if about else str(n)
    return AudioError(f"field {where!r}: audio of {size} bytes is over the {max_bytes} byte budget")


def _checked_bytes(data: Any, where: str, max_bytes: int) -> bytes:
    data = bytes(data)
    if len(data) > max_bytes:
        raise _over_bytes(where, len(data), max_bytes)
    return data


def _b64(text: str, where: str, max_bytes: int) -> bytes:
    """Base64 text's bytes; refused by its length (the least it decodes to) first."""
    least = len(text) // 4 * 3 - 2
    if least > max_bytes:
        raise _over_bytes(where, least, max_bytes, about=True)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise AudioError(f"field {where!r}: invalid base64") from None
    return _checked_bytes(data, where, max_bytes)


def _data_url(url: str, where: str, max_bytes: int) -> tuple[bytes, str | None]:
    """A ``data:<type>;base64,...`` URL's bytes and the format its type names."""
    head, sep, text = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise AudioError(f"field {where!r}: expected a base64 data URL (data:audio/...;base64,...)")
    mime = head[len("data:") :].split(";")[0].strip().lower()
    return _b64(text, where, max_bytes), _MIME_FORMATS.get(mime)


def _format_name(value: Any, where: str) -> str:
    if isinstance(value, str) and value.lower() in _FORMAT_NAMES:
        return _FORMAT_NAMES[value.lower()]
    raise AudioError(
        f"field {where!r}: audio format {value!r} is not supported; one of "
        + ", ".join(sorted(_FORMAT_NAMES))
    )


def _url_bytes(url: Any, where: str, max_bytes: int) -> tuple[bytes, str | None]:
    """Bytes as they are, or a data URL's; a remote URL is the server's to fetch."""
    if isinstance(url, bytes | bytearray | memoryview):
        return _checked_bytes(url, where, max_bytes), None
    if not isinstance(url, str):
        raise AudioError(f"field {where!r}: expected a data: URL, got {type(url).__name__}")
    if url.startswith("data:"):
        return _data_url(url, where, max_bytes)
    if url.startswith(("http://", "https://")):
        raise AudioError(
            f"field {where!r}: remote audio URLs are not fetched here (the server fetches "
            "them where it allows them); pass the audio inline: input_audio or a data: URL"
        )
    raise AudioError(f"field {where!r}: expected a base64 data URL (data:audio/...;base64,...)")


def _field(part: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in part:
        raise AudioError(f"field {where + '.' + key!r}: missing")
    return part[key]


def audio_bytes_of(part: Any, where: str, *, max_bytes: int) -> AudioSource:
    """The bytes of an audio content part at ``where`` (``messages[0].content[1]``):
    ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}``,
    ``{"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..."}}``,
    ``{"type": "audio", "audio": <bytes or data URL>}``, or bytes. Base64 over
    ``max_bytes`` is refused before it is decoded; a remote URL is refused (the server
    fetches those and passes them on inline)."""
    if isinstance(part, bytes | bytearray | memoryview):
        return AudioSource(_checked_bytes(part, where, max_bytes), None, where)
    if not isinstance(part, Mapping):
        raise AudioError(f"field {where!r}: expected an audio content part")
    kind = part.get("type")
    if kind == "input_audio":
        inner = _field(part, "input_audio", where)
        where = f"{where}.input_audio"
        if not isinstance(inner, Mapping):
            raise AudioError(f"field {where!r}: expected an object with data and format")
        fmt = inner.get("format")
        fmt = None if fmt is None else _format_name(fmt, f"{where}.format")
        data = _field(inner, "data", where)
        where = f"{where}.data"
        if isinstance(data, str) and data.startswith("data:"):  # a data URL where base64 goes
            data, claimed = _data_url(data, where, max_bytes)
            return AudioSource(data, fmt or claimed, where)
        if isinstance(data, str):
            return AudioSource(_b64(data, where, max_bytes), fmt, where)
        data, _ = _url_bytes(data, where, max_bytes)
        return AudioSource(data, fmt, where)
    if kind == "audio_url":
        inner = _field(part, "audio_url", where)
        where = f"{where}.audio_url"
        url = _field(inner, "url", where) if isinstance(inner, Mapping) else inner
        where = f"{where}.url" if isinstance(inner, Mapping) else where
        return AudioSource(*_url_bytes(url, where, max_bytes), where)
    if kind == "audio":
        src = _field(part, "audio", where)
        where = f"{where}.audio"
        return AudioSource(*_url_bytes(src, where, max_bytes), where)
    raise AudioError(f"field {where + '.type'!r}: {kind!r} is not an audio part")


def _syncsafe(b: bytes) -> int:
    return (b[0] & 0x7F) << 21 | (b[1] & 0x7F) << 14 | (b[2] & 0x7F) << 7 | (b[3] & 0x7F)


def sniff(data: bytes) -> str | None:
    """The input format (of :data:`INPUT_FORMATS`) the first bytes show, or None."""
    head = data[:12]
    if head[:4] in (b"RIFF", b"RF64") and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska / WebM
        return "webm"
    if head[4:8] == b"ftyp":
        return "m4a"
    at = 0
    if head[:3] == b"ID3" and len(head) >= 10:  # an ID3v2 tag before MP3 (or FLAC) data
        at = 10 + _syncsafe(head[6:10]) + (10 if head[5] & 0x10 else 0)
        if data[at : at + 4] == b"fLaC":
            return "flac"
    sync = data[at : at + 2]
    if len(sync) == 2 and sync[0] == 0xFF and sync[1] & 0xE0 == 0xE0:
        return "aac" if sync[1] & 0x06 == 0 else "mp3"  # ADTS has layer 0, MPEG audio 1-3
    return None


def _seconds(x: float) -> str:
    return f"{x:.6g}"


def decode_audio(
    data: bytes,
    *,
    where: str,
    budget: AudioBudget,
    fmt: str | None = None,
    target_rate: int = 16000,
) -> np.ndarray:
    """Float32 mono samples at ``target_rate`` of encoded audio (one of
    :data:`INPUT_FORMATS`, told by its bytes; ``fmt``, the format the client named, is
    checked to be one we read). Raises :class:`AudioError` naming ``where``: over the
    budget (bytes, then the header's rate, channels and duration, before decoding; the
    decoded duration while decoding), or not decodable audio."""
    if target_rate <= 0:
        raise ValueError(f"target_rate {target_rate}: must be > 0")
    if len(data) > budget.max_bytes:
        raise _over_bytes(where, len(data), budget.max_bytes)
    if fmt is not None:
        _format_name(fmt, where)
    found = sniff(data)
    if found is None:
        raise AudioError(
            f"field {where!r}: not audio in a supported format (" + ", ".join(INPUT_FORMATS) + ")"
        )
    import av

    try:
        with av.open(
            io.BytesIO(data),
            format=_DEMUXERS[found],
            options=_DEMUXER_OPTIONS.get(_DEMUXERS[found], {}),
            metadata_errors="replace",
        ) as container:
            return _decode(container, found, where, budget, target_rate)
    except AudioError:
        raise
    except Exception as e:  # PyAV raises many kinds for bad data (FFmpegError, EOFError...)
        # ffmpeg's own words stay in the log: what reaches a client is ours
        log.info("%s: cannot decode %s audio: %s: %s", where, found, type(e).__name__, e)
        raise AudioError(
            f"field {where!r}: cannot decode the audio (a corrupt or truncated {found} file)"
        ) from None


def _decode(container: Any, found: str, where: str, budget: AudioBudget, rate: int) -> np.ndarray:
    import av

    if not container.streams.audio:
        raise AudioError(f"field {where!r}: the {found} file holds no audio stream")
    stream = container.streams.audio[0]
    ctx = stream.codec_context
    codec = ctx.codec.name
    if not (codec.startswith("pcm_") or codec in _DECODERS):
        raise AudioError(f"field {where!r}: audio codec {codec!r} is not supported")
    _check_shape(where, budget, ctx.sample_rate, ctx.channels)
    if found in _HEADER_DURATION:
        declared = _declared_seconds(container, stream)
        if declared is not None and declared > budget.max_seconds:
            raise AudioError(
                f"field {where!r}: audio of {_seconds(float(declared))} s is over the "
                f"{budget.max_seconds:g} s budget"
            )
    resampler = av.AudioResampler(format="fltp", rate=rate)  # keeps the channels
    limit = budget.max_seconds + DECODE_SLACK_S
    decoded = 0.0
    out: list[np.ndarray] = []
    for packet in container.demux(stream):
        for frame in packet.decode():
            _check_shape(where, budget, frame.sample_rate, frame.layout.nb_channels)
            decoded += frame.samples / frame.sample_rate
            if decoded > limit:
                raise AudioError(
                    f"field {where!r}: audio is over the {budget.max_seconds:g} s budget "
                    f"(more than {_seconds(decoded)} s decoded)"
                )
            out.extend(_mono(f) for f in resampler.resample(frame))
    out.extend(_mono(f) for f in resampler.resample(None))
    if not out or not sum(len(x) for x in out):
        raise AudioError(f"field {where!r}: the {found} file holds no audio samples")
    return np.ascontiguousarray(np.concatenate(out), dtype=np.float32)


def _check_shape(where: str, budget: AudioBudget, rate: int, channels: int) -> None:
    if rate <= 0 or channels <= 0:
        raise AudioError(f"field {where!r}: the audio declares no sample rate or channels")
    if rate > budget.max_sample_rate:
        raise AudioError(
            f"field {where!r}: audio sampled at {rate} Hz is over the limit of "
            f"{budget.max_sample_rate} Hz"
        )
    if channels > budget.max_channels:
        raise AudioError(
            f"field {where!r}: audio with {channels} channels is over the limit of "
            f"{budget.max_channels}"
        )


def _declared_seconds(container: Any, stream: Any) -> Fraction | None:
    """The duration the header declares (the stream's, else the container's)."""
    if stream.duration is not None and stream.time_base is not None:
        return Fraction(stream.duration) * stream.time_base
    if container.duration is not None:
        return Fraction(container.duration, 1_000_000)  # in AV_TIME_BASE units
    return None


def _mono(frame: Any) -> np.ndarray:
    """A planar float frame's channels averaged (as librosa and torchaudio mix down)."""
    planes = frame.to_ndarray()
    return planes[0] if planes.shape[0] == 1 else planes.mean(axis=0, dtype=np.float32)


def load_audio(
    part: Any, where: str, *, budget: AudioBudget, target_rate: int = 16000
) -> np.ndarray:
    """An audio part's samples: :func:`audio_bytes_of` then :func:`decode_audio`."""
    src = audio_bytes_of(part, where, max_bytes=budget.max_bytes)
    return decode_audio(
        src.data, where=src.where, budget=budget, fmt=src.format, target_rate=target_rate
    )


# --------------------------------------------------------------------------- output

OUTPUT_FORMATS = ("wav", "pcm", "flac", "mp3", "opus", "aac")
"""The formats audio is encoded to, by OpenAI's names (``response_format``)."""

MIME = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",  # raw 16-bit little-endian samples, no header
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",  # Opus in Ogg
    "aac": "audio/aac",  # ADTS
}
"""The MIME type of each output format (a segment's ``media_type``)."""

# PyAV's muxer, encoder and muxer options per format; ``flush_packets`` hands each packet
# on as it is muxed (no 32 KiB I/O buffer held back), Ogg pages close every 100 ms
# (ffmpeg's default is a second), MP3 gets no ID3 tag
_AV_FORMATS: dict[str, tuple[str, str, dict[str, str]]] = {
    "flac": ("flac", "flac", {}),
    "mp3": ("mp3", "libmp3lame", {"id3v2_version": "0"}),
    "opus": ("ogg", "libopus", {"page_duration": "100000"}),
    "aac": ("adts", "aac", {}),
}
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_LAYOUTS = {1: "mono", 2: "stereo"}


def _pcm16(samples: np.ndarray, channels: int) -> np.ndarray:
    """Float samples (``(n,)``, or ``(n, channels)``) clipped to [-1, 1] and rounded to
    int16 little-endian, ``(n, channels)``."""
    x = np.asarray(samples, dtype=np.float32)
    if channels == 1:
        x = x.reshape(-1, 1)
    elif x.ndim != 2 or x.shape[1] != channels:
        raise ValueError(f"expected samples of shape (n, {channels}), got {x.shape}")
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.rint(np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2")


def _wav_header(rate: int, channels: int, data_bytes: int | None) -> bytes:
    """A 44-byte PCM WAV header; ``data_bytes=None``: sizes unknown (``0xFFFFFFFF``)."""
    data_size = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff_size = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    block = 2 * channels
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * block, block, 16)
        + b"data"
        + struct.pack("<I", data_size)
    )


def finalize_wav(data: bytes) -> bytes:
    """A complete WAV of :class:`AudioEncoder` (its header's sizes ``0xFFFFFFFF``) with
    exact sizes, for a server that answers it whole."""
    if data[:4] != b"RIFF" or data[36:40] != b"data":
        raise ValueError("not a WAV that AudioEncoder wrote")
    n = len(data) - 44
    return data[:4] + struct.pack("<I", 36 + n) + data[8:40] + struct.pack("<I", n) + data[44:]


class _Chunks:
    """A write-only, unseekable sink for PyAV: what is written until taken."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def write(self, b: bytes) -> int:
        self.buf += b
        return len(b)

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class _AvWriter:
    """One PyAV output container over ``sink`` (seekable: headers fixed up at the end)."""

    def __init__(self, fmt: str, rate: int, channels: int, sink: Any) -> None:
        import av

        if channels not in _LAYOUTS:
            raise ValueError(f"{fmt}: 1 or 2 channels, not {channels}")
        muxer, codec, options = _AV_FORMATS[fmt]
        self.layout = _LAYOUTS[channels]
        self.rate = rate
        options = {**options, "flush_packets": "1"}
        self.container = av.open(sink, mode="w", format=muxer, options=options)
        try:
            enc_rate = rate if fmt != "opus" or rate in _OPUS_RATES else 48000
            self.stream = self.container.add_stream(codec, rate=enc_rate, layout=self.layout)
            # opus takes only some rates: others go through a resampler to 48 kHz
            self.resampler = (
                av.AudioResampler(format="s16", layout=self.layout, rate=enc_rate)
                if enc_rate != rate
                else None
            )
        except BaseException:
            self.container.close()
            raise
        self.pts = 0

    def add(self, pcm: np.ndarray) -> None:
        import av

        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout=self.layout)
        frame.sample_rate = self.rate
        frame.time_base = Fraction(1, self.rate)
        frame.pts = self.pts
        self.pts += pcm.shape[0]
        self._encode(self.resampler.resample(frame) if self.resampler else [frame])

    def _encode(self, frames: list[Any]) -> None:
        for frame in frames:
            self.container.mux(self.stream.encode(frame))

    def finish(self) -> None:
        if self.resampler is not None:
            self._encode(self.resampler.resample(None))
        self.container.mux(self.stream.encode(None))
        self.container.start_encoding()  # the header, where no packet came (no samples)
        self.container.close()

    def close(self) -> None:
        self.container.close()


class AudioEncoder:
    """One request's audio stream, encoded as it comes: ``add`` each chunk of float
    samples (``(n,)`` mono, ``(n, channels)`` otherwise; clipped to [-1, 1]) and get the
    bytes ready so far (maybe ``b""``), then ``finish`` for the rest; all of them
    concatenated are one file of ``fmt`` (of :data:`OUTPUT_FORMATS`). A WAV's header
    (in the first bytes) has the sizes ``0xFFFFFFFF``: the length is not known yet."""

    def __init__(self, fmt: str, sample_rate: int, channels: int = 1) -> None:
        if fmt not in MIME:
            raise ValueError(f"audio format {fmt!r}: one of {', '.join(OUTPUT_FORMATS)}")
        if sample_rate <= 0 or channels <= 0:
            raise ValueError(f"sample_rate {sample_rate}, channels {channels}: must be > 0")
        self.format = fmt
        self.sample_rate = sample_rate
        self.channels = channels
        self.media_type = MIME[fmt]
        self.finished = False
        self._header = fmt == "wav"  # a WAV's header is still to go out
        self._sink: _Chunks | None = None
        self._writer: _AvWriter | None = None
        if fmt in _AV_FORMATS:
            self._sink = _Chunks()
            self._writer = _AvWriter(fmt, sample_rate, channels, self._sink)

    def _head(self) -> bytes:
        if not self._header:
            return b""
        self._header = False
        return _wav_header(self.sample_rate, self.channels, None)

    def add(self, samples: np.ndarray) -> bytes:
        """Encode a chunk; the bytes ready now."""
        if self.finished:
            raise ValueError("add after finish")
        pcm = _pcm16(samples, self.channels)
        if self._writer is None:  # wav, pcm
            return self._head() + pcm.tobytes()
        assert self._sink is not None
        if pcm.shape[0]:
            self._writer.add(pcm)
        return self._sink.take()

    def finish(self) -> bytes:
        """The last bytes (a WAV without any sample: its header); ``b""`` once finished."""
        if self.finished:
            return b""
        self.finished = True
        if self._writer is None:
            return self._head()
        assert self._sink is not None
        self._writer.finish()
        return self._sink.take()

    def close(self) -> None:
        """Release the encoder without finishing (a cancelled request)."""
        if not self.finished and self._writer is not None:
            self.finished = True
            self._writer.close()


def encode_whole(samples: np.ndarray, fmt: str, sample_rate: int, channels: int = 1) -> bytes:
    """A complete file of ``fmt`` from all its samples at once, its header exact (a WAV's
    sizes; FLAC's sample count and checksum; MP3's Xing/LAME frame with the gapless
    trim)."""
    if fmt not in MIME:
        raise ValueError(f"audio format {fmt!r}: one of {', '.join(OUTPUT_FORMATS)}")
    pcm = _pcm16(samples, channels)
    if fmt == "pcm":
        return pcm.tobytes()
    if fmt == "wav":
        return _wav_header(sample_rate, channels, pcm.nbytes) + pcm.tobytes()
    buf = io.BytesIO()
    writer = _AvWriter(fmt, sample_rate, channels, buf)
    try:
        if pcm.shape[0]:
            writer.add(pcm)
        writer.finish()
    except BaseException:
        writer.close()
        raise
    return buf.getvalue()
