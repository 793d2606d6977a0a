"""Audio in answers: the encoded bytes an audio stage streams to the caller (segments
whose payload's ``media_type`` is ``audio/*``, the core's contract for encoded media,
the bytes in their arrays), gathered into OpenAI's ``message.audio`` or passed on as they
come. No family is imported here at module level: the server knows audio by its media
type alone."""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from omni_core.media import media_type_of

WAV_TYPES = ("audio/wav", "audio/x-wav")


def audio_bytes(ev: Any) -> tuple[bytes, str] | None:
    """(the encoded audio bytes an event carries, maybe none yet; their media type), or
    None for an event that is not audio."""
    media_type = media_type_of(getattr(ev, "payload", None))
    if media_type is None or not media_type.startswith("audio/"):
        return None
    chunks = [v for v in getattr(ev, "arrays", {}).values() if isinstance(v, bytes)]
    return b"".join(chunks), media_type


def whole_file(data: bytes, media_type: str | None) -> bytes:
    """A streamed file answered whole: a WAV's sizes (``0xFFFFFFFF`` in a streamed
    header) made exact by the speech family's ``finalize_wav`` where it is installed;
    anything else as it is."""
    if media_type not in WAV_TYPES:
        return data
    try:
        from omni_speech.audio import finalize_wav
    except ImportError:  # whoever encoded it: readers take a WAV's data to its end
        return data
    try:
        return finalize_wav(data)  # type: ignore[no-any-return]
    except ValueError:  # not a streamed WAV of the speech family's encoder
        return data


@dataclass
class AudioAnswer:
    """One answer's audio, as OpenAI's chat completions carry it: its ``id``, its bytes
    (one file in the asked format), its media type. Nothing is kept after the answer, so
    ``expires_at`` is the time it was made: no later turn can refer to it by id."""

    id: str = field(default_factory=lambda: f"audio_{uuid.uuid4().hex}")
    parts: list[bytes] = field(default_factory=list)
    media_type: str | None = None
    expires_at: int = field(default_factory=lambda: int(time.time()))
    announced: bool = False  # a delta has carried the id

    def add(self, ev: Any) -> bytes:
        """The audio bytes ``ev`` brings (``b""``: none), kept for :meth:`message`."""
        found = audio_bytes(ev)
        if found is None or not found[0]:
            return b""
        data, self.media_type = found
        self.parts.append(data)
        return data

    def message(self, transcript: str) -> dict[str, Any]:
        """``message.audio``: the whole file in base64 and its transcript."""
        data = whole_file(b"".join(self.parts), self.media_type)
        return {
            "id": self.id,
            "data": base64.b64encode(data).decode(),
            "expires_at": self.expires_at,
            "transcript": transcript,
        }

    def delta(self, **fields: Any) -> dict[str, Any]:
        """A chunk's ``delta.audio``: ``fields`` (``data``: base64 bytes, ``transcript``:
        text, ``expires_at``: the last), the first one with the id, as OpenAI streams it."""
        if self.announced:
            return fields
        self.announced = True
        return {"id": self.id, **fields}
