"""The talker of ``tiny-dial-voice`` (:mod:`omni_speech.voice`): a small network that
reads characters and says, for each, its symbol, how many frames it sounds and how many
frames of silence follow. Imports torch: only workers and the training script load it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omni_speech.voice import (
    GAP,
    GAP_CLASSES,
    MIN_GAP,
    MIN_TONE,
    SYMBOLS,
    TONE_CLASSES,
    VOICE_MODEL,
    VOICES,
    resolve_voice,
    symbols_of,
)


class TalkerNet(nn.Module):
    """Characters -> the logits of each one's symbol, tone frames and gap frames, from
    :attr:`reach` characters on either side (residual 1-D convolutions): it can speak a
    text as it arrives, that many characters behind."""

    def __init__(self, width: int = 64, layers: int = 3, kernel: int = 5) -> None:
        super().__init__()
        self.config = {"width": width, "layers": layers, "kernel": kernel}
        self.embed = nn.Embedding(SYMBOLS + 1, width, padding_idx=GAP)
        self.convs = nn.ModuleList(
            nn.Conv1d(width, width, kernel, padding=kernel // 2) for _ in range(layers)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.symbol = nn.Linear(width, SYMBOLS)
        self.tone = nn.Linear(width, TONE_CLASSES)
        self.gap = nn.Linear(width, GAP_CLASSES)

    @property
    def reach(self) -> int:
        """The characters on either side that a character's outputs depend on."""
        return self.config["layers"] * (self.config["kernel"] // 2)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``ids`` (batch, chars) of symbols, :data:`~omni_speech.voice.GAP` past a
        text's end -> logits (batch, chars, classes) of symbol, tone and gap. Past the
        end activations are held at zero, as the convolutions' own padding is, so a
        padded text reads as the same text alone."""
        keep = (ids != GAP).unsqueeze(-1).float()
        h = self.embed(ids) * keep
        for conv, norm in zip(self.convs, self.norms, strict=True):
            h = norm(h + F.gelu(conv(h.transpose(1, 2)).transpose(1, 2))) * keep
        return self.symbol(h), self.tone(h), self.gap(h)

    def say(self, text: str) -> tuple[list[int], list[int], list[int]]:
        """(symbols, tone frames, gap frames) of each character of a sayable text
        (:func:`~omni_speech.voice.sayable`), greedily."""
        if not text:
            return [], [], []
        with torch.inference_mode():
            sym, tone, gap = (
                x[0].argmax(-1).tolist() for x in self(torch.tensor([symbols_of(text)]))
            )
        return sym, [MIN_TONE + t for t in tone], [MIN_GAP + g for g in gap]


def load_talker(model: str = VOICE_MODEL) -> tuple[TalkerNet, dict[str, Any]]:
    """The talker of a voice model (in eval mode) and its ``config.json``."""
    from safetensors.torch import load_file

    path = resolve_voice(model)
    config = json.loads((path / "config.json").read_text())
    net = TalkerNet(**config["talker"])
    net.load_state_dict(load_file(path / "talker.safetensors"))
    return net.eval(), config


def save_talker(net: TalkerNet, path: Path, record: dict[str, Any]) -> None:
    """Write a voice model directory: ``talker.safetensors`` (float32) and
    ``config.json`` (the net's shape, its voices, and ``record``: how it was trained)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    save_file(state, path / "talker.safetensors")
    config = {"talker": net.config, "voices": list(VOICES), "_omni_training": record}
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
