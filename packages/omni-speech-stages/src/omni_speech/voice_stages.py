"""The embedded voice's stages (``configs/speech_voice.yaml``): an AR model's reply, said
by ``tiny-dial-voice`` (:mod:`omni_speech.voice`) as tones an oracle reads back.

* ``speech.voice_intake``: ``ar.intake`` that also takes the speech fields (``input``,
  ``voice``, ``audio: {voice, format}``, ``modalities``, a string ``response_format``),
  which the AR stages after it do not know. With ``input`` (the text to say as it is,
  as ``/v1/audio/speech`` sends it) the prompt becomes ``say_prompt`` and the reply is
  held to exactly ``input`` by a structured-output choice: the model's reply is still
  the one text that is streamed and said, and it is the input.
* ``speech.voice_talker``: the reply's text (``ar.postprocess``'s ``payload["text"]``),
  as it streams, -> frame codes (segment tokens, one per 10 ms), by the trained talker,
  :attr:`~omni_speech.voice_net.TalkerNet.reach` characters behind the text.
* ``speech.voice_vocoder``: frame codes -> float32 samples (``arrays["audio"]``,
  ``payload["sample_rate"]``), by :func:`omni_speech.voice.render`, for
  ``speech.audio_encode``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from omni_ar.errors import RequestError
from omni_ar.stages.base import ModelOptions
from omni_ar.stages.intake import Intake
from omni_core.plugin import Stage, StageContext, StageEvent, StageInput, UserInputError

from omni_speech.encode import request_format
from omni_speech.prompt import MAX_INPUT_CHARS, MODALITIES, SPEECH_FIELDS, speech_settings
from omni_speech.voice import (
    FRAMES_PER_S,
    GAP,
    SAMPLE_RATE,
    VOICE_MODEL,
    VOICES,
    SayableStream,
    frames_of,
    render,
    sayable,
)

__all__ = ["VoiceIntake", "VoiceTalker", "VoiceVocoder", "speech_fields"]


class VoiceIntakeOptions(ModelOptions, kw_only=True):
    """``speech.voice_intake``'s options: ``ar.intake``'s and the prompt of ``input``."""

    # the prompt of a request that gives ``input``; {input} is replaced by it
    say_prompt: str = "Repeat exactly: {input}"

    def __post_init__(self) -> None:
        super().__post_init__()
        if "{input}" not in self.say_prompt:
            raise ValueError("say_prompt: must hold {input}")


def speech_fields(
    request: dict[str, Any], say_prompt: str, max_tokens_limit: int
) -> dict[str, Any]:
    """``request`` as the AR stages take it: the speech fields checked and taken out,
    and a request with ``input`` made the prompt ``say_prompt`` whose reply is held to
    exactly ``input``. A RequestError names a bad field."""
    rest = {k: v for k, v in request.items() if k not in SPEECH_FIELDS}
    speech_settings(request, VOICES, VOICES[0])
    try:
        request_format(request, "wav")  # speech.audio_encode reads it
    except UserInputError as e:
        raise RequestError(str(e)) from None
    if isinstance(rest.get("response_format"), str):  # the speech endpoint's audio format
        del rest["response_format"]
    said = request.get("input")
    if said is None:
        return rest
    if not isinstance(said, str) or not sayable(said):
        raise RequestError(
            "field 'input': expected a string with something this voice says (printable ASCII)"
        )
    if len(said) > MAX_INPUT_CHARS:
        raise RequestError(
            f"field 'input': {len(said)} characters, over the limit of {MAX_INPUT_CHARS}"
        )
    for other in ("prompt", "messages", "structured_outputs", "response_format"):
        if other in rest:
            raise RequestError(f"field {other!r}: not with 'input' (the reply is the input)")
    tokens = len(said.encode()) + 1  # at most a token per byte, then the end
    if tokens > max_tokens_limit:
        raise RequestError(f"field 'input': too long for max_tokens_limit={max_tokens_limit}")
    return {
        **rest,
        "prompt": say_prompt.replace("{input}", said),
        "structured_outputs": {"choice": [said]},
        "max_tokens": tokens,
    }


class VoiceIntake(Intake):
    """``ar.intake`` for a pipeline that speaks: each request as :func:`speech_fields`
    makes it, then ``ar.intake``'s own work."""

    Options = VoiceIntakeOptions
    token_prompts = False  # its prompts are text to say

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        o: VoiceIntakeOptions = self.options
        for inp in batch:
            try:
                request = speech_fields(inp.request, o.say_prompt, o.max_tokens_limit)
            except RequestError as e:
                yield inp.fail(e)
                continue
            yield from super().process([dataclasses.replace(inp, request=request)])


class VoiceTalkerOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``speech.voice_talker``'s options."""

    model: str = VOICE_MODEL  # the voice: its name, or a directory train.py wrote
    threads: int | None = 1  # torch threads in this worker (a small net: one is fastest)


@dataclass
class _Talk:
    """One request's speech so far."""

    speak: bool  # the request asked for audio
    stream: SayableStream = field(default_factory=SayableStream)
    chars: str = ""  # said of the text so far
    done: int = 0  # characters whose frames went out
    seen: int = -1  # the last upstream event read (a cut one repeats its payload)


class VoiceTalker(Stage):
    """Text, as it streams -> frame codes of the voice (segment tokens)."""

    Options = VoiceTalkerOptions
    preload = ("torch",)

    def load(self) -> None:
        import torch

        from omni_speech.voice_net import load_talker

        if self.options.threads:
            torch.set_num_threads(self.options.threads)
        self.net, _ = load_talker(self.options.model)
        self.talks: dict[str, _Talk] = {}

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            t = self.talks.get(inp.request_id)
            if t is None:
                modalities = inp.request.get("modalities", list(MODALITIES))
                t = self.talks[inp.request_id] = _Talk(speak="audio" in modalities)
            for piece in inp.window.pieces:
                text = piece.payload.get("text")
                if piece.sequence > t.seen and isinstance(text, str) and t.speak:
                    t.chars += t.stream.add(text)
                t.seen = max(t.seen, piece.sequence)
            ready = len(t.chars) if inp.last else len(t.chars) - self.net.reach
            if ready > t.done or inp.last:
                said = t.chars[t.done : max(ready, t.done)]
                yield inp.segment(self._say(t, ready), payload={"said": said}, is_last=inp.last)

    def _say(self, t: _Talk, ready: int) -> list[int]:
        """The frame codes of characters [done, ready), each read with the characters
        around it that its outputs depend on (so the same as reading the whole text)."""
        if ready <= t.done:
            return []
        reach = self.net.reach
        lo, hi = max(0, t.done - reach), min(len(t.chars), ready + reach)
        sym, tone, gap = self.net.say(t.chars[lo:hi])
        a, b = t.done - lo, ready - lo
        t.done = ready
        return frames_of(sym[a:b], tone[a:b], gap[a:b])

    def end_request(self, request_id: str) -> None:
        self.talks.pop(request_id, None)


class VoiceVocoderOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``speech.voice_vocoder``'s options."""

    sample_rate: int = SAMPLE_RATE  # 8 kHz and up (the highest tone is 3.53 kHz), 100 Hz steps

    def __post_init__(self) -> None:
        if self.sample_rate < 8000 or self.sample_rate % FRAMES_PER_S:
            raise ValueError("sample_rate: at least 8000 Hz, a multiple of 100 (10 ms frames)")


@dataclass
class _Wave:
    start: int = 0  # the utterance's frames rendered
    before: int = GAP  # the last frame rendered
    pending: list[int] = field(default_factory=list)  # frames not yet rendered


class VoiceVocoder(Stage):
    """Frame codes -> samples; a frame waits for the next one (its fade depends on it)."""

    Options = VoiceVocoderOptions

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self.waves: dict[str, _Wave] = {}

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        rate = self.options.sample_rate
        for inp in batch:
            w = self.waves.setdefault(inp.request_id, _Wave())
            w.pending += inp.window.new_tokens
            n = len(w.pending) if inp.last else len(w.pending) - 1
            if n <= 0:
                if inp.last:  # without a rate where nothing was said: no audio at all
                    payload = {"sample_rate": rate} if w.start else {}
                    yield inp.segment(payload=payload, is_last=True)
                continue
            after = w.pending[n] if n < len(w.pending) else GAP
            samples = render(w.pending[:n], w.start, w.before, after, rate)
            payload = {"sample_rate": rate, "offset": w.start * (rate // FRAMES_PER_S)}
            w.start, w.before, w.pending = w.start + n, w.pending[n - 1], w.pending[n:]
            yield inp.segment(payload=payload, arrays={"audio": samples}, is_last=inp.last)

    def end_request(self, request_id: str) -> None:
        self.waves.pop(request_id, None)
