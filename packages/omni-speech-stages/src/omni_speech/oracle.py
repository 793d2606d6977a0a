"""The oracle of the embedded voice (:mod:`omni_speech.voice`): it listens to audio and
writes down the text it hears, so a program can tell a right voice from a wrong one.

:func:`listen` finds the characters as the stretches of sound between silences, and
reads each one's two tones from its spectrum (the strongest peak in the low band and in
the high band, each within a third of a step of a tone of the code); a stretch that is
not a clean pair (its two peaks hold under :data:`PURITY` of its energy: noise, a chord
of two characters run together, a shifted pitch) is heard as ``"\\ufffd"``. The oracle
knows the code, not the talker: it reads any audio, from any model.

:func:`quality_rate` runs held-out text (:data:`HELD_OUT`, never in the talker's
training) through the shipped pipeline (``configs/speech_voice.yaml``) as a user runs
it and gives the share the oracle reads back exactly::

    hatch run python -m omni_speech.oracle --json
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omni_speech.voice import HIGH_HZ, LOW_HZ, SYMBOLS, sayable

UNHEARD = "\ufffd"  # a stretch of sound that is no character of the code
PURITY = 0.6  # the share of a character's energy its two tones must hold
HOP_S = 0.0025  # the loudness envelope's step
MIN_SOUND_S = 0.01  # shorter sounds are clicks, not characters
CONFIG = "configs/speech_voice.yaml"

# Held-out text: sentences the talker never saw (its training text is random letters,
# digits and signs: tools/train-voice/train.py checks that none of these occurs in it).
HELD_OUT: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
    "Please call me back at 555-0199 before 10:30.",
    "It costs $42.50 (tax included).",
    "Is 3 + 4 = 7? Yes, it is.",
    "Meet me at the station on Friday; bring an umbrella.",
    "She sells sea shells by the sea shore.",
    "Email: hello@example.com",
    "The password is Tr0ub4dor&3, do not tell anyone.",
    "50% of 80 is 40.",
    "Over 1,000,000 people came to see it.",
    "Wait... what did you say?",
    "\"Quotes\" and 'apostrophes' are fine, aren't they?",
    "A long time ago, in a galaxy far, far away.",
    "Turn left at the second light, then go straight for 2 km.",
    "The meeting starts at 9 a.m. sharp.",
    "Use C:\\Users\\omni\\voice.wav as the path.",
    "x^2 + y^2 = z^2 holds for (3, 4, 5).",
    "Ring #7 and ask for Ms. O'Neil.",
    "My list: eggs, milk, bread, and tea.",
    "Keep calm and carry on!",
    "The answer is 42, as everyone knows.",
    "Add {key: value} pairs to the [list] <here>.",
    "Zebras and yaks graze quietly in the vast grassland.",
    "Jack quickly vexed the wizard with a jumbo box of pizza.",
    "Run `pip install omni` and wait ~5 minutes.",
    "Rain is expected tomorrow | cloudy on Sunday.",
    "Her flight, AB1234, lands at gate 17.",
    "Good morning! How are you today?",
    "Seven swans swim slowly south.",
    "Thank you for calling; your number is 88.",
    "I think, therefore I am.",
    "Add 2 cups of flour and 1/2 cup of sugar.",
    "The temperature dropped to -5 degrees overnight.",
    "Copy that, over and out.",
    "Version 3.11.4 fixed the bug_report_7 issue.",
    "What a wonderful day for a walk in the park!",
    "Numbers like 0, 6 and 9 are easy to mix up.",
    "The cat sat on the mat * twice *.",
    "Speak slowly and clearly, please.",
)

# Held-out prompts: SmolLM2 answers them and the voice says the answer.
PROMPTS: tuple[str, ...] = (
    "Say hello to a new friend.",
    "What colour is the sky on a clear day?",
    "Name three fruits.",
    "How many days are in a week?",
    "Give me a short tip for sleeping well.",
    "What is the capital of France?",
    "Describe a cat in one sentence.",
    "What do bees make?",
)


def listen(samples: np.ndarray, rate: int) -> str:
    """The text the oracle hears in mono ``samples`` at ``rate`` Hz (any loudness)."""
    x = np.asarray(samples, dtype=np.float64).reshape(-1)
    hop = max(1, round(HOP_S * rate))
    n = len(x) // hop
    if n == 0:
        return ""
    loud = np.sqrt(np.mean(x[: n * hop].reshape(n, hop) ** 2, axis=1))
    top = float(np.percentile(loud, 95))
    if top < 1e-4:
        return ""
    sound = np.concatenate([[False], loud > 0.2 * top, [False]])
    edges = np.flatnonzero(np.diff(sound.astype(np.int8)))
    heard = []
    for a, b in zip(edges[::2], edges[1::2], strict=True):
        if (b - a) * hop < MIN_SOUND_S * rate:
            continue
        heard.append(_character(x[(a + 1) * hop : (b - 1) * hop], rate))
    return "".join(heard)


def _character(x: np.ndarray, rate: int) -> str:
    """The character of one stretch of sound, or :data:`UNHEARD`."""
    if len(x) < 16:
        return UNHEARD
    size = 1 << max(13, int(np.ceil(np.log2(4 * len(x)))))
    power = np.abs(np.fft.rfft(x * np.hanning(len(x)), size)) ** 2
    hz = np.fft.rfftfreq(size, 1 / rate)
    lobe = 2.5 * rate / len(x)  # the Hann window's main lobe, and some
    picked, energy = [], 0.0
    for grid in (LOW_HZ, HIGH_HZ):
        step = grid[1] - grid[0]
        band = (hz > grid[0] - step / 2) & (hz < grid[-1] + step / 2)
        peak = float(hz[band][np.argmax(power[band])])
        k = int(np.argmin([abs(peak - f) for f in grid]))
        if abs(peak - grid[k]) > step / 3:
            return UNHEARD
        picked.append(k)
        energy += float(power[np.abs(hz - peak) <= lobe].sum())
    symbol = 10 * picked[0] + picked[1]
    if symbol >= SYMBOLS or energy < PURITY * float(power.sum()):
        return UNHEARD
    return chr(32 + symbol)


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    """(float32 mono samples, rate) of a WAV file, as ``speech.audio_encode`` streams it
    (sizes unknown) or whole."""
    import soundfile as sf

    from omni_speech.audio import finalize_wav

    if data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff":
        data = finalize_wav(data)
    x, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return x.mean(axis=1), int(rate)


def audio_bytes(out: Any) -> bytes:
    """The audio a request's events streamed (``arrays["audio"]`` bytes, joined)."""
    return b"".join(
        a
        for e in out.events
        for a in (getattr(e, "arrays", None) or {}).values()
        if isinstance(a, bytes)
    )


def streamed_text(out: Any) -> str:
    """The text a request's events streamed (``payload["text"]`` pieces, joined)."""
    return "".join(
        t
        for e in out.events
        if isinstance(e.payload, dict)
        for t in [e.payload.get("text")]
        if isinstance(t, str)
    )


def check(out: Any, expected: str | None = None) -> dict[str, Any]:
    """What the oracle hears in one request's audio against what it was to say:
    ``expected`` (sayable), else the text the request streamed (the thinker's reply)."""
    said = sayable(streamed_text(out) if expected is None else expected)
    entry: dict[str, Any] = {"said": said}
    if not out.ok:
        return {**entry, "heard": "", "right": False, "error": out.error}
    data = audio_bytes(out)
    heard = listen(*wav_samples(data)) if data else ""
    return {**entry, "heard": heard, "right": heard == said, "errors": edits(said, heard)}


def edits(a: str, b: str) -> int:
    """The Levenshtein distance between two texts (characters)."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def quality_rate(
    texts: Sequence[str] = HELD_OUT,
    prompts: Sequence[str] = PROMPTS,
    config: str | Path = CONFIG,
    pipe: Any = None,
) -> dict[str, Any]:
    """The oracle's rate on held-out text through the voice's pipeline, as a user runs
    it: each of ``texts`` as ``{"input": text}`` (say it as it is), and each of
    ``prompts`` as a prompt (the voice says SmolLM2's streamed reply), all at once.
    ``quality_rate``: the share of ``texts`` heard back exactly (sayable); with
    ``quality_char_error_rate`` (edits per character said), ``quality_reply_rate`` the
    same for the replies, and up to five misses as ``quality_wrong``. ``pipe``: a
    started ``omni_core.Pipeline`` (else one of ``config``, started and closed here)."""
    from omni_core import Pipeline

    t0 = time.monotonic()
    requests = [{"input": t} for t in texts] + [{"prompt": p} for p in prompts]
    if pipe is None:
        with Pipeline(config) as own:
            outs = own.generate(requests)
    else:
        outs = pipe.generate(requests)
    said = [check(o, t) for o, t in zip(outs, texts, strict=False)]
    replies = [check(o) for o in outs[len(texts) :]]
    res: dict[str, Any] = {}
    for key, seen in (("quality", said), ("quality_reply", replies)):
        if not seen:
            continue
        chars = sum(len(s["said"]) for s in seen)
        res[f"{key}_rate"] = round(sum(s["right"] for s in seen) / len(seen), 3)
        res[f"{key}_right"] = sum(s["right"] for s in seen)
        res[f"{key}_asked"] = len(seen)
        res[f"{key}_char_error_rate"] = round(
            sum(s.get("errors", len(s["said"])) for s in seen) / max(chars, 1), 4
        )
    res["quality_wrong"] = [s for s in said + replies if not s["right"]][:5]
    res["quality_wall_s"] = round(time.monotonic() - t0, 2)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m omni_speech.oracle``: :func:`quality_rate` of the shipped config."""
    ap = argparse.ArgumentParser(prog="python -m omni_speech.oracle", description=__doc__)
    ap.add_argument("--config", default=CONFIG, help="the voice's pipeline config")
    ap.add_argument("--texts", type=int, default=len(HELD_OUT), help="held-out texts said")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="held-out prompts")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args(argv)
    res = quality_rate(HELD_OUT[: args.texts], PROMPTS[: args.prompts], args.config)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0 if res.get("quality_rate", 0.0) >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
