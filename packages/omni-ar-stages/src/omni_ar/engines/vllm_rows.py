"""What omni's logits processors for vLLM share: a state per row of vLLM's persistent
batch, kept across its batch updates (rows added, removed, moved or swapped)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

R = TypeVar("R")


class RowLogitsProcessor(LogitsProcessor, Generic[R]):
    """``rows``: persistent batch index -> the state :meth:`row` made of its request."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, R] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is likeliest

    def row(self, extra_args: dict[str, Any], output: list[int]) -> R | None:
        """The state of a request added with ``extra_args`` (its ``SamplingParams``') and
        ``output`` (vLLM's live list of its output tokens); None: not this processor's."""
        raise NotImplementedError

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index, params, _prompt, output in batch_update.added:
            extra = (params.extra_args or {}) if params is not None else {}
            state = self.row(extra, output)
            if state is not None:
                self.rows[index] = state
            else:
                self.rows.pop(index, None)
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = row_b
