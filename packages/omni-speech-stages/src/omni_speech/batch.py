"""Requests stepped together: one forward a step for every member, as the AR family's
batched decode does it, for the speech models' own inputs (M-RoPE positions, the
talker's reply rows).

The cache holds one row per member, left-padded to the longest; a mask marks each row's
real positions and each step's position ids are the row's own (its length plus its
M-RoPE delta), so a row computes what it would alone. A member joining or leaving marks
the batch dirty, and the next step rebuilds the cache from each member's own KV.

Each member is read through :meth:`StepBatch.next`: a member whose queue is empty steps
the whole batch, which fills every member's queue. A stage running several requests at
once (``max_inflight``) thus steps them together whatever order the runtime advances
them in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Forward = Callable[[list[Any], Any, Any, Any], Any]
"""``forward(members' step inputs, position_ids (3, B, 1), attention_mask, cache)`` -> the
model's output (``logits``, ``past_key_values``, ...)."""
Pick = Callable[[Any, int, Any], tuple[Any, Any, bool]]
"""``pick(output, row, member state)`` -> (what the member's queue gets, its next step
input, whether it is done)."""


@dataclass
class Member:
    """One request in a batch."""

    state: Any  # the stage's own per-request state (sampler, counters)
    step_input: Any  # what its next forward reads (a token, a token and a reply row)
    delta: int = 0  # M-RoPE: position = length + delta
    queue: deque[Any] = field(default_factory=deque)
    done: bool = False


class StepBatch:
    """The members a stage steps together (see the module docstring)."""

    def __init__(self, forward: Forward, pick: Pick, device: str = "cpu") -> None:
        self.forward, self.pick, self.device = forward, pick, device
        self.members: dict[Any, Member] = {}
        self.pending: dict[Any, list[tuple[Any, Any]]] = {}  # KV of members not in yet
        self.rows: list[Any] = []  # the cache's rows (member keys)
        self.lengths: list[int] = []
        self.cache: Any = None
        self.mask: Any = None
        self.dirty = False
        self.forwards = 0  # batched forwards run (tests, stats)

    def add(self, key: Any, cache: Any, member: Member) -> None:
        """Admit a request with its prefill's cache (one row)."""
        self.members[key] = member
        self.pending[key] = [(ly.keys[0], ly.values[0]) for ly in cache.layers]
        self.dirty = True

    def remove(self, key: Any) -> None:
        """Drop a member (finished, cancelled); its KV goes with the next rebuild."""
        if self.members.pop(key, None) is not None:
            self.pending.pop(key, None)
            self.dirty = True

    def next(self, key: Any) -> Any:
        """The member's next output, stepping the batch when it has none queued; None
        once it is done and its queue is empty (it is then out of the batch)."""
        m = self.members.get(key)
        if m is None:
            return None
        while not m.queue:
            if m.done:
                self.remove(key)
                return None
            self.step()
        return m.queue.popleft()

    def _own_kv(self, key: Any) -> list[tuple[Any, Any]]:
        if key in self.pending:
            return self.pending.pop(key)
        row = self.rows.index(key)
        pad = self.mask.shape[1] - self.lengths[row]
        return [(ly.keys[row, :, pad:], ly.values[row, :, pad:]) for ly in self.cache.layers]

    def _rebuild(self) -> None:
        from omni_ar.engines.transformers_kv import left_padded

        rows = [k for k, m in self.members.items() if not m.done]
        kv = [self._own_kv(k) for k in rows]
        self.cache, self.mask, self.lengths = left_padded(kv, self.device)
        self.rows = rows
        self.dirty = False

    def step(self) -> None:
        """One forward of every member not done: each gets one output queued."""
        import torch

        if self.dirty:
            self._rebuild()
        if not self.rows:
            raise RuntimeError("a step was asked of an empty batch")
        members = [self.members[k] for k in self.rows]
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(members), 1))], dim=1)
        positions = torch.tensor(
            [[n + m.delta] for n, m in zip(self.lengths, members, strict=True)],
            device=self.device,
        )
        with torch.inference_mode():
            out = self.forward(
                [m.step_input for m in members],
                positions.unsqueeze(0).expand(3, -1, -1),
                self.mask,
                self.cache,
            )
        self.forwards += 1
        self.cache = out.past_key_values
        self.lengths = [n + 1 for n in self.lengths]
        for row, m in enumerate(members):
            result, m.step_input, m.done = self.pick(out, row, m.state)
            m.queue.append(result)
            if m.done:
                self.dirty = True
