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

``speech.code2mel`` is the same sampling without the vocoder: it sends each window's
final mel (``arrays={"mel": (1, mel bins, frames)}``, ``payload={"offset": frames before
it}``) to a ``speech.mel2wav`` stage, so the two halves run in two processes.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
from omni_core.plugin import Stage, StageEvent, StageInput

from omni_speech.checkpoint import Voice, load_part, load_voices, resolve
from omni_speech.dit import WindowVelocity
from omni_speech.mel2wav import SAMPLE_RATE, MelStream, audio_segment, hop
from omni_speech.thinker import TORCH_PRELOAD


class Code2MelOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options:`` of ``speech.code2mel``."""

    model: str
    threads: int | None = None
    num_steps: int = 10  # the ODE's time points (generate's default)
    guidance_scale: float = 0.5
    sway_coefficient: float = -1.0
    chunk_codes: int = 0  # 0: exact, one window at the end; else the first window's codes
    max_chunk_codes: int = 0  # later windows' codes at most (each 2x the last's); 0: chunk_codes
    context_codes: int = 24  # codes of left context per window (whole DiT blocks)
    lookahead_codes: int = 12  # codes of right context a window waits for

    def __post_init__(self) -> None:
        if min(self.chunk_codes, self.context_codes, self.lookahead_codes) < 0:
            raise ValueError("chunk_codes, context_codes and lookahead_codes must be >= 0")
        if self.max_chunk_codes and self.max_chunk_codes < self.chunk_codes:
            raise ValueError("max_chunk_codes: at least chunk_codes (or 0: windows of chunk_codes)")
        if self.num_steps < 2:
            raise ValueError("num_steps: at least 2 time points")


class Token2WavOptions(Code2MelOptions, kw_only=True):
    """``options:`` of ``speech.token2wav``: ``speech.code2mel``'s and the vocoder's."""

    sample_rate: int = SAMPLE_RATE
    vocoder_frames: int = 16  # mel frames on each side of a vocoded window


@dataclass
class _Wave:
    """One request's stream."""

    voice: Voice
    generator: Any
    codes: list[int] = field(default_factory=list)
    noise: Any = None  # (1, frames, mel) drawn so far, in frame order
    kept: int = 0  # codes whose mel is final
    windows: int = 0  # windows sampled
    mel: MelStream = field(default_factory=MelStream)  # the final mel


class Code2Mel(Stage):
    """Codec tokens -> mel frames (``speech.code2mel``; :class:`Token2Wav` vocodes them
    too)."""

    Options = Code2MelOptions
    preload = TORCH_PRELOAD
    vocodes: ClassVar[bool] = False  # keeps the checkpoint's vocoder (``self.vocoder``)

    def load(self) -> None:
        import torch

        o: Code2MelOptions = self.options
        if o.threads:
            torch.set_num_threads(o.threads)
        path = resolve(o.model)
        model = load_part(path, "token2wav")  # float32, as generate runs it
        self.dit = model.code2wav_dit_model
        self.vocoder = model.code2wav_bigvgan_model if self.vocodes else None
        self.voices = load_voices(path)
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
        o: Code2MelOptions = self.options
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
                ev = self._emit(inp, w, final=inp.last and w.kept == len(w.codes), last=False)
                if ev is not None:
                    yield ev
                    sent.add(inp.request_id)
        for inp, w in ready:
            if inp.last:  # (exact: its one window)
                yield self._emit(inp, w, final=True, last=True)
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
                w.mel.add(mel[row : row + 1, :, (w.kept - lo) * r : (end - lo) * r])
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

    def _emit(self, inp: StageInput, w: _Wave, final: bool, last: bool) -> StageEvent | None:
        """The request's final mel not sent yet (None if none and not ``last``): this
        stage sends every frame it keeps, ``final`` or not."""
        pending = w.mel.pieces
        frames = sum(p.shape[2] for p in pending)
        if not frames and not last:
            return None
        import torch

        w.mel.pieces = []
        arrays = {"mel": torch.cat(pending, dim=2).numpy()} if frames else None
        offset = w.mel.frames - frames
        return inp.segment(payload={"offset": offset}, arrays=arrays, is_last=last)

    def end_request(self, request_id: str) -> None:
        self.waves.pop(request_id, None)


class Token2Wav(Code2Mel):
    """Codec tokens -> waveform: :class:`Code2Mel`'s mel vocoded in the same process."""

    Options = Token2WavOptions
    vocodes = True

    def load(self) -> None:
        super().load()
        self.hop = hop(self.vocoder)

    def _emit(self, inp: StageInput, w: _Wave, final: bool, last: bool) -> StageEvent | None:
        """The samples of the final mel frames not sent yet whose right side is known."""
        o: Token2WavOptions = self.options
        offset = w.mel.samples
        context = o.vocoder_frames if o.chunk_codes else 0
        wave = w.mel.vocode(self.vocoder, self.hop, context, final)
        if not wave.size and not last:
            return None
        return audio_segment(inp, wave, offset, o.sample_rate, last)


def _generator(seed: int | None) -> Any:
    import torch

    return torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
