"""``speech.mel2wav``: mel spectrogram -> waveform (Qwen2.5-Omni's BigVGAN), streamed.

The vocoder half of token2wav in a process of its own, so that on a machine of few
cores the DiT's sampling (``speech.code2mel``) and the vocoder run side by side, a
request's next window being sampled while its last one is vocoded. Its upstream sends
segments with ``arrays={"mel": float32 (1, mel bins, frames)}`` and ``payload={"offset":
frames before it}``; each goes out as soon as it is vocoded, as ``speech.token2wav``'s
do: ``arrays={"audio": float32 (n,)}``, ``payload={"sample_rate", "offset"}`` (samples
before it). The frames whose right side has not come yet wait for the next window
(:class:`MelStream`), so a waveform cut at other window bounds differs from the whole
one only where the vocoder's receptive field passes ``vocoder_frames``; one window with
every frame (upstream in exact mode) gives the whole one. A request that spoke no mel
(``modalities: ["text"]``) ends with a segment without audio, as token2wav's does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from omni_core.plugin import Stage, StageEvent, StageInput, Window

from omni_speech.checkpoint import load_part, resolve
from omni_speech.thinker import TORCH_PRELOAD

SAMPLE_RATE = 24000  # Qwen2.5-Omni's BigVGAN


@dataclass
class MelStream:
    """One request's final mel as it comes, and what of it was vocoded and sent."""

    pieces: list[Any] = field(default_factory=list)  # (1, mel, frames) torch tensors
    frames: int = 0  # final mel frames
    vocoded: int = 0  # frames whose samples went out
    samples: int = 0  # samples sent

    def add(self, mel: Any) -> None:
        self.pieces.append(mel)
        self.frames += mel.shape[2]

    def vocode(self, vocoder: Any, hop: int, context: int, final: bool) -> np.ndarray:
        """The samples of the frames not sent yet whose right side is known (all of
        them when ``final``), vocoded with ``context`` frames of mel on each side."""
        stop = self.frames if final else max(self.vocoded, self.frames - context)
        if stop <= self.vocoded:
            return np.zeros(0, np.float32)
        import torch

        mel = torch.cat(self.pieces, dim=2) if len(self.pieces) > 1 else self.pieces[0]
        self.pieces = [mel]
        lo = max(0, self.vocoded - context)
        hi = self.frames if final else min(self.frames, stop + context)
        with torch.inference_mode():
            wave = vocoder(mel[:, :, lo:hi]).reshape(-1).float().numpy()
        out = wave[(self.vocoded - lo) * hop : (stop - lo) * hop]
        self.vocoded = stop
        self.samples += out.size
        return out


def hop(vocoder: Any) -> int:
    """The samples BigVGAN makes of one mel frame."""
    return math.prod(vocoder.config.upsample_rates)


def load_vocoder(model: str) -> tuple[Any, int]:
    """(BigVGAN, samples per mel frame) of a Qwen2.5-Omni checkpoint."""
    vocoder = load_part(resolve(model), "token2wav").code2wav_bigvgan_model
    return vocoder, hop(vocoder)


def audio_segment(inp: StageInput, wave: np.ndarray, offset: int, rate: int, last: bool) -> Any:
    """The segment of ``wave``, the request's samples from ``offset`` on."""
    payload = {"sample_rate": rate, "offset": offset}
    return inp.segment(payload=payload, arrays={"audio": wave}, is_last=last)


class Mel2WavOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options:`` of ``speech.mel2wav``."""

    model: str
    threads: int | None = None
    sample_rate: int = SAMPLE_RATE
    vocoder_frames: int = 16  # mel frames on each side of a vocoded window

    def __post_init__(self) -> None:
        if self.vocoder_frames < 0:
            raise ValueError("vocoder_frames must be >= 0")


class Mel2Wav(Stage):
    """Mel frames -> waveform."""

    Options = Mel2WavOptions
    preload = TORCH_PRELOAD

    def load(self) -> None:
        import torch

        o: Mel2WavOptions = self.options
        if o.threads:
            torch.set_num_threads(o.threads)
        self.vocoder, self.hop = load_vocoder(o.model)
        self.mel_bins = self.vocoder.config.mel_dim
        self.streams: dict[str, MelStream] = {}

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        o: Mel2WavOptions = self.options
        for inp in batch:
            s = self.streams.setdefault(inp.request_id, MelStream())
            try:
                self._take(s, inp.window)
            except ValueError as e:  # upstream's fault: this request's alone
                self.end_request(inp.request_id)
                yield inp.fail(f"upstream mel: {e}")
                continue
            if not s.frames:  # nothing spoken (yet): a request without speech passes
                yield inp.segment(is_last=True) if inp.last else None  # as token2wav's
                continue
            offset = s.samples
            wave = s.vocode(self.vocoder, self.hop, o.vocoder_frames, final=inp.last)
            if wave.size or inp.last:
                yield audio_segment(inp, wave, offset, o.sample_rate, inp.last)
            else:
                yield None

    def _take(self, s: MelStream, window: Window) -> None:
        """Add the window's mel to ``s``, checked: its shape, and that it starts where
        the request's last piece ended."""
        import torch

        for piece in window.pieces:
            mel = piece.arrays.get("mel")
            if mel is None:
                continue
            want = (1, self.mel_bins)
            if not isinstance(mel, np.ndarray) or mel.ndim != 3 or mel.shape[:2] != want:
                got = getattr(mel, "shape", type(mel).__name__)
                raise ValueError(f"expected a float array (1, {want[1]}, frames), got {got}")
            offset = piece.payload.get("offset")
            if offset != s.frames:
                raise ValueError(f"a piece at frame {offset!r}, expected {s.frames}: out of order")
            s.add(torch.tensor(mel, dtype=torch.float32))  # a copy: the window's memory goes

    def end_request(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
