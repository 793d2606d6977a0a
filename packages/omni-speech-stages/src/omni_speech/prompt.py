"""A speech request, read once where it enters the family (``speech.thinker``).

Its fields are the AR family's (``prompt`` or ``messages``, ``max_tokens``, ``temperature``,
``seed``...) and OpenAI's for audio: ``modalities`` (``["text"]``, ``["text", "audio"]``),
``audio: {voice, format}``, and ``input`` (the text to say as it is: the speech endpoint;
the thinker then reads it instead of writing a reply). A message's content may hold text,
image and audio parts (``input_audio``, ``audio_url``). The prompt is Qwen2.5-Omni's chat
format, each image and audio clip expanded to the placeholders its features fill, by the
rules of the model's own processor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from omni_ar.errors import RequestError
from omni_ar.params import SamplingParams, parse_request

from omni_speech.audio import AudioBudget

# Qwen2.5-Omni speaks only under this system prompt (its model card's words)
QWEN_SYSTEM = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech."
)
SPEECH_FIELDS = ("modalities", "audio", "input", "voice")
MODALITIES = ("text", "audio")
AUDIO_PARTS = ("input_audio", "audio_url")
IMAGE_PARTS = ("image", "image_url")
AUDIO_RATE = 16000  # the audio encoder's input rate (Whisper features)
MAX_INPUT_CHARS = 4096  # the speech endpoint's input (OpenAI's limit)


class SpeechRequest(msgspec.Struct, kw_only=True):
    """A request as the speech stages read it, parsed once at the thinker and carried on
    with its first segment (``payload["speech"]``)."""

    speak: bool  # the talker speaks the reply (modalities include "audio")
    voice: str
    format: str | None = None  # the audio format asked for (checked by speech.audio_encode)
    seed: int | None = None


@dataclass
class ThinkerInput:
    """What the thinker runs on: the prompt's tokens, the features of its media, and the
    text it is to say (``input``), tokenized, if any."""

    ids: list[int]
    params: SamplingParams
    speech: SpeechRequest
    audio_features: list[np.ndarray] = field(default_factory=list)  # (mel, frames) each
    images: list[np.ndarray] = field(default_factory=list)  # (H, W, 3) uint8 each
    forced: list[int] | None = None  # the reply, given (the speech endpoint)


@dataclass(frozen=True)
class PromptLimits:
    max_prompt_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    max_image_pixels: int
    audio: AudioBudget


def parse(
    request: dict[str, Any],
    *,
    voices: list[str],
    default_voice: str,
    limits: PromptLimits,
) -> tuple[list[dict[str, Any]], SamplingParams, SpeechRequest, str | None]:
    """(messages, sampling params, speech settings, text to say) of a request, or a
    RequestError naming the field."""
    rest = {k: v for k, v in request.items() if k not in SPEECH_FIELDS and k != "messages"}
    speak, voice, fmt = speech_settings(request, voices, default_voice)
    said = request.get("input")
    if said is not None:
        if not isinstance(said, str) or not said.strip():
            raise RequestError("field 'input': expected a non-empty string")
        if len(said) > MAX_INPUT_CHARS:
            raise RequestError(
                f"field 'input': {len(said)} characters, over the limit of {MAX_INPUT_CHARS}"
            )
    messages = request.get("messages")
    if messages is None:
        if "prompt" not in rest and said is not None:
            rest["prompt"] = said
        rest.setdefault("max_tokens", limits.default_max_tokens)
        source, params = parse_request(rest, limits.max_tokens_limit)
        messages = [{"role": "user", "content": source}]
    else:
        if "prompt" in rest:
            raise RequestError("field 'prompt': give exactly one of 'prompt' or 'messages'")
        _check_messages(messages)
        rest.setdefault("max_tokens", limits.default_max_tokens)
        _, params = parse_request({"prompt": "-", **rest}, limits.max_tokens_limit)
    _refuse_unsampled(params)
    speech = SpeechRequest(speak=speak, voice=voice, format=fmt, seed=params.seed)
    return messages, params, speech, said


# the AR fields the thinker's sampler does not apply (it samples by temperature, top_p and
# seed, to max_tokens, ignore_eos; the text stage after it applies stop strings): each
# refused when set, never silently dropped
UNSAMPLED = (
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "top_k",
    "min_p",
    "min_tokens",
    "stop_token_ids",
    "bad_words",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "response_format",
    "structured_outputs",
)
_DEFAULTS = SamplingParams()


def _refuse_unsampled(params: SamplingParams) -> None:
    for name in UNSAMPLED:
        value = getattr(params, name)
        if name in ("response_format", "structured_outputs"):
            used = params.structured() is not None  # (type "text": free text, as without)
        elif name == "top_k":
            used = value not in (0, -1)  # (both: every token)
        else:
            used = (
                bool(value) if isinstance(value, list | dict) else value != getattr(_DEFAULTS, name)
            )
        if used:
            raise RequestError(
                f"field {name!r}: not supported by speech.thinker (it samples by "
                "temperature, top_p and seed)"
            )


def speech_settings(
    request: dict[str, Any], voices: Sequence[str], default_voice: str
) -> tuple[bool, str, str | None]:
    """(whether to speak, the voice, the audio format asked for) of a request's
    ``modalities``, ``audio`` and ``voice``, or a RequestError naming the field."""
    modalities = request.get("modalities", list(MODALITIES))
    if (
        not isinstance(modalities, list)
        or not modalities
        or not all(m in MODALITIES for m in modalities)
    ):
        raise RequestError(
            f"field 'modalities': expected a non-empty list of {list(MODALITIES)}, "
            f"got {modalities!r}"
        )
    audio = request.get("audio", {})
    if not isinstance(audio, dict) or set(audio) - {"voice", "format"}:
        raise RequestError('field \'audio\': expected {"voice": str, "format": str}')
    voice = audio.get("voice", request.get("voice", default_voice))
    if voice not in voices:
        where = "audio.voice" if "voice" in audio else "voice"
        raise RequestError(
            f"field {where!r}: voice {voice!r} is not one of this model's voices: "
            f"{', '.join(voices)}"
        )
    fmt = audio.get("format")
    if fmt is not None and not isinstance(fmt, str):
        raise RequestError("field 'audio.format': expected a string")
    return "audio" in modalities, voice, fmt


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("field 'messages': expected a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"field 'messages[{i}].role': expected a string")
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not content:
            raise RequestError(
                f"field 'messages[{i}].content': expected a string or a non-empty list of parts"
            )
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            if kind in AUDIO_PARTS or kind in IMAGE_PARTS:
                continue  # read where decoded, which names the field
            raise RequestError(
                f"field 'messages[{i}].content[{j}]': expected a text, image, image_url, "
                "input_audio or audio_url part"
            )


def render(
    messages: list[dict[str, Any]], tokens: dict[str, str], system: str | None = None
) -> tuple[str, list[tuple[str, Any]]]:
    """Qwen2.5-Omni's chat prompt of the messages (each image and clip as one
    placeholder between its markers, expanded later), after a ``system`` turn when the
    messages have none, and the media parts in order, ``(where, part)``."""
    out: list[str] = []
    if system and not any(m.get("role") == "system" for m in messages):
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    media: list[tuple[str, Any]] = []
    for i, m in enumerate(messages):
        out.append(f"<|im_start|>{m['role']}\n")
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for j, part in enumerate(parts):
            kind = part["type"]
            if kind == "text":
                out.append(part["text"])
            elif kind in AUDIO_PARTS:
                media.append((f"messages[{i}].content[{j}]", part))
                out.append(tokens["audio_bos"] + tokens["audio"] + tokens["audio_eos"])
            else:
                media.append((f"messages[{i}].content[{j}]", part))
                out.append(tokens["vision_bos"] + tokens["image"] + tokens["vision_eos"])
        out.append("<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out), media


def audio_tokens(frames: int) -> int:
    """The placeholders a clip of ``frames`` feature frames fills (the processor's rule:
    the encoder halves them twice)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1
