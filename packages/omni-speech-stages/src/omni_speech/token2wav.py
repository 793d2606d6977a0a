"""``speech.token2wav``: codec tokens -> mel spectrogram (a DiT sampled by flow matching)
-> waveform (BigVGAN), on Qwen2.5-Omni's own modules, exact or streamed in windows.

Exact (``chunk_codes: 0``): one window of every code once the talker ends: the same
noise, solver and steps as the model's own ``generate``, so the same waveform.
Streamed: the first window of ``chunk_codes`` new codes, each next one twice the last's
up to ``max_chunk_codes`` (fewer windows, so fewer codes sampled twice as context, once
the first audio is out), is sampled with ``context_codes`` before it and
``lookahead_codes`` after it (so a window waits for that many more codes), and only its
own frames are kept; a round of windows takes the requests' first windows before any
later one (time to first audio); the vocoder then runs over the kept frames
with ``vocoder_frames`` of mel on each side, and the samples of the frames whose right
side has not come yet wait for the next window. The noise of each mel frame is the same
as the exact mode's (drawn in frame order from the request's seed), so the streams
differ only where a window's attention and the solver's steps would have seen beyond
its context (docs/speech.md gives the measured difference).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from omni_core.plugin import Stage, StageEvent, StageInput

from omni_speech.checkpoint import Voice, load_part, load_voices, resolve
from omni_speech.dit import WindowVelocity
from omni_speech.thinker import TORCH_PRELOAD

SAMPLE_RATE = 24000  # Qwen2.5-Omni's BigVGAN


class Token2WavOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options:`` of ``speech.token2wav``."""

    model: str
    threads: int | None = None
    num_steps: int = 10  # the ODE's time points (generate's default)
    guidance_scale: float = 0.5
    sway_coefficient: float = -1.0
    sample_rate: int = SAMPLE_RATE
    chunk_codes: int = 0  # 0: exact, one window at the end; else the first window's codes
    max_chunk_codes: int = 0  # later windows' codes at most (each 2x the last's); 0: chunk_codes
    context_codes: int = 24  # codes of left context per window (whole DiT blocks)
    lookahead_codes: int = 12  # codes of right context a window waits for
    vocoder_frames: int = 16  # mel frames on each side of a vocoded window

    def __post_init__(self) -> None:
        if min(self.chunk_codes, self.context_codes, self.lookahead_codes) < 0:
            raise ValueError("chunk_codes, context_codes and lookahead_codes must be >= 0")
        if self.max_chunk_codes and self.max_chunk_codes < self.chunk_codes:
            raise ValueError("max_chunk_codes: at least chunk_codes (or 0: windows of chunk_codes)")
        if self.num_steps < 2:
            raise ValueError("num_steps: at least 2 time points")


@dataclass
class _Wave:
    """One request's stream."""

    voice: Voice
    generator: Any
    codes: list[int] = field(default_factory=list)
    noise: Any = None  # (1, frames, mel) drawn so far, in frame order
    kept: int = 0  # codes whose mel is final
    windows: int = 0  # windows sampled
    mel: list[Any] = field(default_factory=list)  # final mel, (1, mel, frames) pieces
    frames: int = 0  # final mel frames
    vocoded: int = 0  # frames whose samples went out
    samples: int = 0  # samples sent


class Token2Wav(Stage):
    """Codec tokens -> waveform."""

    Options = Token2WavOptions
    preload = TORCH_PRELOAD

    def load(self) -> None:
        import torch

        o: Token2WavOptions = self.options
        if o.threads:
            torch.set_num_threads(o.threads)
        path = resolve(o.model)
        self.model = load_part(path, "token2wav")  # float32, as generate runs it
        self.dit = self.model.code2wav_dit_model
        self.vocoder = self.model.code2wav_bigvgan_model
        self.voices = load_voices(path)
        self.hop = math.prod(self.vocoder.config.upsample_rates)
        block = self.dit.config.block_size // self.dit.repeats
        for name in ("chunk_codes", "max_chunk_codes", "context_codes", "lookahead_codes"):
            if getattr(o, name) % block:
                raise ValueError(f"{name} {getattr(o, name)}: a multiple of {block} (a DiT block)")
        self.waves: dict[str, _Wave] = {}

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        ready: dict[str, tuple[StageInput, _Wave]] = {}
        for inp in batch:
            w = self.waves.get(inp.request_id)
            for p in inp.window.payloads:
                if w is None and "speech" in p:
                    speech = p["speech"]
                    voice = self.voices.get(speech.get("voice"))
                    if voice is None:
                        yield inp.fail(f"voice {speech.get('voice')!r} is not this model's")
                        break
                    w = self.waves[inp.request_id] = _Wave(voice, _generator(speech.get("seed")))
            else:
                if w is None:
                    yield inp.segment([], is_last=inp.last)
                    continue
                w.codes += inp.window.new_tokens
                ready[inp.request_id] = (inp, w)
        yield from self._advance(list(ready.values()))

    def _window(self, inp: StageInput, w: _Wave) -> tuple[int, int, int] | None:
        """The request's next window to sample, ``(lo, end, hi)``: the mel of codes
        [lo, hi) sampled, that of [w.kept, end) kept; None while it waits for codes."""
        o: Token2WavOptions = self.options
        n = len(w.codes)
        if inp.cancelled or w.kept >= n:
            return None
        if o.chunk_codes == 0:
            return (0, n, n) if inp.last else None
        end = w.kept + min(o.chunk_codes << w.windows, o.max_chunk_codes or o.chunk_codes)
        lo = max(0, w.kept - o.context_codes)
        if end + o.lookahead_codes <= n:
            return lo, end, end + o.lookahead_codes
        if inp.last:
            end = min(end, n)
            return lo, end, min(n, end + o.lookahead_codes)
        return None

    def _advance(self, ready: list[tuple[StageInput, _Wave]]) -> Iterator[StageEvent | None]:
        """Every window the requests have, round by round: one window of each request a
        round, those of a length sampled together (one forward a solver step for all); a
        round of first windows, while any request has one, before the others'."""
        streamed = self.options.chunk_codes > 0
        sent: set[str] = set()
        while plans := [(i, w, s) for i, w in ready if (s := self._window(i, w)) is not None]:
            plans = [p for p in plans if p[1].kept == 0] or plans
            self._keep([(w, s) for _, w, s in plans])
            if not streamed:
                break
            for inp, w, _ in plans:
                wave = self._vocode(w, final=inp.last and w.kept == len(w.codes))
                if wave.size:
                    yield self._out(inp, w, wave, False)
                    sent.add(inp.request_id)
        for inp, w in ready:
            if not streamed and w.frames:
                yield self._out(inp, w, self._vocode(w, final=True), inp.last)
            elif inp.last:
                yield self._out(inp, w, np.zeros(0, np.float32), True)
            elif inp.request_id not in sent:
                yield None

    def _keep(self, windows: list[tuple[_Wave, tuple[int, int, int]]]) -> None:
        """Sample the mel of each window's codes [lo, hi) and keep that of [kept, end);
        windows of one length and voice reference in one batch."""
        import torch

        r = self.dit.repeats
        groups: dict[tuple[int, int], list[tuple[_Wave, tuple[int, int, int]]]] = {}
        for w, (lo, end, hi) in windows:
            frames_hi = hi * r
            have = 0 if w.noise is None else w.noise.shape[1]
            if frames_hi > have:  # each frame's noise drawn once, in frame order
                more = torch.randn(
                    (1, frames_hi - have, self.dit.mel_dim),
                    generator=w.generator,
                    dtype=torch.float32,
                )
                w.noise = more if w.noise is None else torch.cat([w.noise, more], 1)
            key = (hi - lo, w.voice.ref_mel.shape[1])
            groups.setdefault(key, []).append((w, (lo, end, hi)))
        for group in groups.values():
            mel = self.sample(
                torch.cat([w.voice.cond for w, _ in group]),
                torch.cat([w.voice.ref_mel for w, _ in group]),
                torch.tensor([w.codes[lo:hi] for w, (lo, _, hi) in group]),
                torch.cat([w.noise[:, lo * r : hi * r] for w, (lo, _, hi) in group]),
            )
            for row, (w, (lo, end, _)) in enumerate(group):
                w.mel.append(mel[row : row + 1, :, (w.kept - lo) * r : (end - lo) * r])
                w.frames += (end - w.kept) * r
                w.kept = end
                w.windows += 1

    def sample(self, cond: Any, ref_mel: Any, codes: Any, noise: Any) -> Any:
        """The mel (B, mel, frames) of ``codes`` (B, n) from ``noise`` (B, frames, mel),
        each row with its voice's ``cond`` (B, dim) and reference mel: the flow-matching
        ODE of the model's own ``sample``, solved by its own RK4 solver (the DiT's
        velocity by :class:`~omni_speech.dit.WindowVelocity`)."""
        import torch
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        o: Token2WavOptions = self.options
        t = torch.linspace(0, 1, o.num_steps, dtype=cond.dtype)
        if o.sway_coefficient is not None:
            t += o.sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
        with torch.inference_mode():
            velocity = WindowVelocity(self.dit, cond, ref_mel, codes, o.guidance_scale)
            path = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(t)
        return path[-1].permute(0, 2, 1)

    def _vocode(self, w: _Wave, final: bool) -> np.ndarray:
        """The samples of the final mel frames not sent yet whose right side is known."""
        import torch

        mel = torch.cat(w.mel, dim=2) if len(w.mel) > 1 else w.mel[0]
        w.mel = [mel]
        ctx = self.options.vocoder_frames if self.options.chunk_codes else 0
        stop = w.frames if final else max(w.vocoded, w.frames - ctx)
        if stop <= w.vocoded:
            return np.zeros(0, np.float32)
        lo, hi = max(0, w.vocoded - ctx), w.frames if final else min(w.frames, stop + ctx)
        with torch.inference_mode():
            wave = self.vocoder(mel[:, :, lo:hi]).reshape(-1).float().numpy()
        out = wave[(w.vocoded - lo) * self.hop : (stop - lo) * self.hop]
        w.vocoded = stop
        return out

    def _out(self, inp: StageInput, w: _Wave, wave: np.ndarray, last: bool) -> StageEvent:
        payload = {"sample_rate": self.options.sample_rate, "offset": w.samples}
        w.samples += wave.size
        return inp.segment(payload=payload, arrays={"audio": wave}, is_last=last)

    def end_request(self, request_id: str) -> None:
        self.waves.pop(request_id, None)


def _generator(seed: int | None) -> Any:
    import torch

    return torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
