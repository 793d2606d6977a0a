"""The embedded voice, ``tiny-dial-voice``: a small talker trained here and the tone
code it speaks, which a program (:mod:`omni_speech.oracle`) reads back to text.

The code: every printable ASCII character (``" "`` to ``"~"``, 95 of them) is one
symbol, ``ord(c) - 32``, said as a pair of sine tones, as a telephone's DTMF keys are:
a low tone for its row (``symbol // 10``, :data:`LOW_HZ`) and a high one for its column
(``symbol % 10``, :data:`HIGH_HZ`). Speech comes in frames of 10 ms; a frame code is a
symbol (its tone pair sounds) or :data:`GAP` (silence). The talker
(:class:`omni_speech.voice_net.TalkerNet`, weights in ``weights/tiny-dial-voice``, trained by
``tools/train-voice/train.py``) reads the characters and says, for each, which symbol,
for how many frames (3 to 8) and how many frames of silence follow it (1 to 8): the
rhythm of the reference speaker it learned from (longer vowels, a lengthened word end,
pauses after punctuation). :func:`render` (the vocoder, deterministic) turns frame codes
into samples.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

VOICE_MODEL = "tiny-dial-voice"
VOICE_DIR = Path(__file__).parent / "weights" / VOICE_MODEL
VOICES = ("dial",)  # the voices it has (one)
FIRST, SYMBOLS = 32, 95  # printable ASCII: " " (32) .. "~" (126)
GAP = SYMBOLS  # the frame code of silence (also the talker's padding id)
FRAMES_PER_S = 100  # one frame code: 10 ms
SAMPLE_RATE = 16000
LOW_HZ = tuple(500.0 + 130.0 * k for k in range(10))  # a symbol's row: 500 .. 1670 Hz
HIGH_HZ = tuple(2000.0 + 170.0 * k for k in range(10))  # its column: 2000 .. 3530 Hz
AMPLITUDE = 0.35  # of each tone (a pair peaks at 0.7)
FADE_S = 0.0025  # raised-cosine fade in and out of each character (no clicks)
MIN_TONE, TONE_CLASSES = 3, 6  # frames a character sounds: 3 .. 8
MIN_GAP, GAP_CLASSES = 1, 8  # frames of silence after it: 1 .. 8


def sayable(text: str) -> str:
    """What the voice says of ``text``: its characters decomposed (NFKD: "é" -> "e"),
    whitespace as one space, characters outside printable ASCII dropped, no space at
    either end. The oracle reads a right voice's audio back to exactly this."""
    return SayableStream().add(text)


class SayableStream:
    """:func:`sayable` of a text that arrives in pieces: :meth:`add` returns the new
    characters (a space waits until a character follows it); their concatenation is
    :func:`sayable` of the whole."""

    def __init__(self) -> None:
        self.started = False  # a character was said
        self.space = False  # a space waits for the next character

    def add(self, piece: str) -> str:
        """The characters ``piece`` adds to what is said."""
        out: list[str] = []
        for ch in piece:
            for c in unicodedata.normalize("NFKD", ch):
                if c.isspace():
                    self.space = self.started
                elif FIRST <= ord(c) < FIRST + SYMBOLS:
                    if self.space:
                        out.append(" ")
                        self.space = False
                    out.append(c)
                    self.started = True
        return "".join(out)


def symbols_of(text: str) -> list[int]:
    """The symbols of a :func:`sayable` text; ValueError for another character."""
    out = []
    for c in text:
        s = ord(c) - FIRST
        if not 0 <= s < SYMBOLS:
            raise ValueError(f"{c!r} is not a character the voice says (printable ASCII)")
        out.append(s)
    return out


def tones(symbol: int) -> tuple[float, float]:
    """The (low, high) tone pair of a symbol, in Hz."""
    return LOW_HZ[symbol // 10], HIGH_HZ[symbol % 10]


def frames_of(symbols: Sequence[int], tone: Sequence[int], gap: Sequence[int]) -> list[int]:
    """Frame codes: each symbol for its ``tone`` frames, then ``gap`` frames of :data:`GAP`."""
    out: list[int] = []
    for s, t, g in zip(symbols, tone, gap, strict=True):
        out += [s] * t + [GAP] * g
    return out


VOWELS = frozenset("aeiouAEIOU")


def speaker_rhythm(text: str) -> tuple[list[int], list[int]]:
    """The rhythm of the reference speaker the talker learned from (its training
    targets): (tone frames, gap frames) of each character of a sayable text. A character
    sounds 4 frames, a vowel 6, a digit or a sign 5, a space 3; a capital one frame more,
    and so does a letter that ends a word; silence of 1 frame follows it, 3 after ",;:",
    5 after ".!?" that end a sentence (before a space or the end)."""
    tone, gap = [], []
    for i, c in enumerate(text):
        after = text[i + 1 : i + 2]
        t = 6 if c in VOWELS else 3 if c == " " else 4 if c.isalpha() else 5
        t += c.isupper() + (c.isalpha() and not after.isalpha())
        g = 3 if c in ",;:" else 5 if c in ".!?" and after in ("", " ") else 1
        tone.append(min(t, MIN_TONE + TONE_CLASSES - 1))
        gap.append(g)
    return tone, gap


def render(
    frames: Sequence[int],
    start: int = 0,
    before: int = GAP,
    after: int = GAP,
    rate: int = SAMPLE_RATE,
) -> np.ndarray:
    """The samples (float32) of frame codes that begin at frame ``start`` of the
    utterance, the frame before them being ``before`` and the one after them ``after``
    (:data:`GAP` at its ends). Each tone's phase follows the utterance's sample index, so
    a character's frames join without a seam and rendering frames in pieces gives the
    same samples as all at once."""
    n = rate // FRAMES_PER_S
    fade = max(1, round(FADE_S * rate))
    ramp = 0.5 - 0.5 * np.cos(np.pi * (np.arange(fade) + 0.5) / fade)
    out = np.zeros(len(frames) * n, np.float32)
    codes = [before, *frames, after]
    for i, code in enumerate(frames):
        if code == GAP:
            continue
        if not 0 <= code < SYMBOLS:
            raise ValueError(f"frame code {code}: not a symbol (0..{SYMBOLS - 1}) or GAP")
        t = (start + i) * n + np.arange(n, dtype=np.float64)
        lo, hi = tones(code)
        x = AMPLITUDE * (np.sin(2 * np.pi * lo * t / rate) + np.sin(2 * np.pi * hi * t / rate))
        if codes[i] != code:
            x[:fade] *= ramp
        if codes[i + 2] != code:
            x[-fade:] *= ramp[::-1]
        out[i * n : (i + 1) * n] = x
    return out


def resolve_voice(model: str) -> Path:
    """The directory of a voice model: :data:`VOICE_MODEL` (shipped in this package) or
    a directory holding ``config.json`` and ``talker.safetensors``."""
    path = VOICE_DIR if model == VOICE_MODEL else Path(model)
    if not (path / "config.json").is_file() or not (path / "talker.safetensors").is_file():
        raise ValueError(
            f"model {model!r}: not {VOICE_MODEL!r} nor a directory with config.json and "
            "talker.safetensors (tools/train-voice/train.py writes one)"
        )
    return path


def named_models() -> list[Any]:
    """``tiny-dial-voice`` for ``omni models`` (entry point ``omni.models``)."""
    from omni_core.plugin import NamedModel

    def pull(report: Any) -> Path:
        report("shipped in omni-speech-stages (tools/train-voice/train.py)")
        return resolve_voice(VOICE_MODEL)

    def locate() -> Path | None:
        return VOICE_DIR if (VOICE_DIR / "talker.safetensors").is_file() else None

    return [
        NamedModel(
            VOICE_MODEL,
            "omni-speech-stages",
            "a voice trained here: text -> DTMF-like tone pairs that omni_speech.oracle "
            "reads back (configs/speech_voice.yaml)",
            locate,
            pull,
            "shipped",
        )
    ]
