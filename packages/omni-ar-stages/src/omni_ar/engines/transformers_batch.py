"""The transformers engine's batched decode: every request in flight in one cache, one
forward per step for all of them (:class:`DecodeBatch`), and each request's tokens as an
iterator that can leave the batch and come back (:class:`BatchSteps`)."""

from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni_ar.engines.transformers_kv import cache_of, left_padded
from omni_ar.engines.transformers_sampling import pick
from omni_ar.logits import Logits, ends
from omni_ar.params import Sampled, SamplingParams
from omni_ar.structured import Matcher


class BatchEngine(Protocol):
    """What the batch reads of its engine
    (:class:`~omni_ar.engines.transformers_engine.TransformersEngine`); a protocol, so that
    this module, which the engine imports, does not import it."""

    device: str
    """``"cpu"`` or ``"cuda:0"``."""
    turn: AbstractContextManager[Any]
    """Held around each forward (:mod:`omni_ar.engines.cpu_turns`)."""
    model: Any
    """The transformers model."""
    cache_kw: str
    """The keyword its forward takes the KV cache under."""
    eos_ids: set[int]
    """The model's end-of-sequence ids."""

    def tensor(self, ids: list[int] | list[list[int]]) -> Any:
        """Token ids as a tensor on the engine's device."""
        ...


@dataclass
class BatchRequest:
    """A request in the decode batch: ``tok`` is the input of its next step."""

    params: SamplingParams
    gen: Any  # its seeded torch.Generator (None: greedy)
    tok: int
    left: int  # tokens it may still produce
    queue: deque[Sampled] = field(default_factory=deque)
    done: bool = False
    matcher: Matcher | None = None  # its grammar's state, for structured output
    logits: Logits | None = None  # its penalties, biases, bad words... (omni_ar.logits)
    position_offset: int = 0  # its positions: its cache's length plus this (M-RoPE's delta)
    gen_after: Any = None  # the generator from its second pick on (None: ``gen`` throughout)


class DecodeBatch:
    """The requests an engine decodes together, one forward per step for all of them.

    The cache holds one row per member, left-padded to the longest: row ``i`` has
    ``lengths[i]`` real positions at its right end, which ``mask`` marks; each step's
    position ids are the rows' own lengths, so a row computes what it would alone. A
    request joining or leaving marks the batch ``dirty``, and the next step rebuilds the
    cache from each member's own KV (cut out of the old cache, or handed in on join)."""

    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine
        self.requests: dict[int, BatchRequest] = {}
        self.pending: dict[int, list[tuple[Any, Any]]] = {}  # KV of requests not yet in
        # requests paused for better ones (preempted): out of the steps, their KV kept
        self.parked: dict[int, tuple[BatchRequest, list[tuple[Any, Any]] | None]] = {}
        self.members: list[int] = []  # the cache's rows
        self.lengths: list[int] = []
        self.cache: Any = None
        self.mask: Any = None
        self.dirty = False
        self.next_id = 0
        self.forwards = 0  # batched forwards run (for tests and stats)

    def add(self, req: BatchRequest, layers: list[tuple[Any, Any]]) -> int:
        """Admit a request with its KV, per layer ``(kv_heads, tokens, head_dim)``."""
        rid, self.next_id = self.next_id, self.next_id + 1
        self.requests[rid] = req
        self.pending[rid] = layers
        self.dirty = True
        return rid

    def remove(self, rid: int) -> None:
        """Drop a request (finished or closed); its KV goes with the next rebuild."""
        self.parked.pop(rid, None)
        if self.requests.pop(rid, None) is not None:
            self.pending.pop(rid, None)
            self.dirty = True

    def park(self, rid: int) -> None:
        """Take a request out of the steps (preempted), keeping a copy of its KV and
        the tokens it already has; :meth:`unpark` puts it back where it stopped."""
        req = self.requests.get(rid)
        if req is None:
            return
        layers = None
        if not req.done:  # a finished one has only its queued tokens left to give
            layers = [(k.clone(), v.clone()) for k, v in self._own_kv(rid)]
        del self.requests[rid]
        self.parked[rid] = (req, layers)
        self.dirty = True

    def unpark(self, rid: int) -> None:
        """A parked request joins the steps again with its own KV."""
        parked = self.parked.pop(rid, None)
        if parked is None:
            return
        req, layers = parked
        self.requests[rid] = req
        if layers is not None:
            self.pending[rid] = layers
            self.dirty = True

    def _own_kv(self, rid: int) -> list[tuple[Any, Any]]:
        """A member's KV without padding: a view of its row of the batch cache."""
        if rid in self.pending:
            return self.pending.pop(rid)
        row = self.members.index(rid)
        pad = self.mask.shape[1] - self.lengths[row]
        return [(ly.keys[row, :, pad:], ly.values[row, :, pad:]) for ly in self.cache.layers]

    def _rebuild(self) -> None:
        members = [r for r, q in self.requests.items() if not q.done]
        kv = [self._own_kv(r) for r in members]
        self.cache, self.mask, self.lengths = left_padded(kv, self.engine.device)
        self.members = members
        self.dirty = False

    def step(self) -> None:
        """One forward of every member: a token queued for each; the ones that end
        (EOS, ``max_tokens``) leave the batch."""
        import torch

        e = self.engine
        if self.dirty:
            self._rebuild()
        if not self.members:
            raise RuntimeError("transformers engine: a stream waits but no request is in flight")
        reqs = [self.requests[r] for r in self.members]
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(reqs), 1))], dim=1)
        with e.turn, torch.inference_mode():
            out = e.model(
                e.tensor([[q.tok] for q in reqs]),
                attention_mask=self.mask,
                position_ids=e.tensor(
                    [[n + q.position_offset] for n, q in zip(self.lengths, reqs, strict=True)]
                ),
                use_cache=True,
                **{e.cache_kw: self.cache},
            )
        self.forwards += 1
        self.cache = cache_of(out)
        self.lengths = [n + 1 for n in self.lengths]
        for row, q in enumerate(reqs):
            s = pick(out.logits[row, -1], q.params, q.gen, q.matcher, q.logits)
            if q.gen_after is not None:
                q.gen, q.gen_after = q.gen_after, None
            q.queue.append(s)
            q.tok, q.left = s[0], q.left - 1
            if q.left <= 0 or ends(q.tok, q.params, e.eos_ids):
                q.done = self.dirty = True


class BatchSteps:
    """A request's tokens from the batch; ``close`` takes it out even when it was never
    iterated (a generator's ``finally`` would not run then)."""

    def __init__(self, batch: DecodeBatch, rid: int) -> None:
        self.batch = batch
        self.rid = rid

    def __iter__(self) -> BatchSteps:
        return self

    def __next__(self) -> Sampled:
        req = self.batch.requests.get(self.rid)
        if req is None:
            if self.rid in self.batch.parked:  # a paused request must be resumed first
                raise RuntimeError(f"decode request {self.rid} was advanced while paused")
            raise StopIteration
        while not req.queue:
            if req.done:
                self.close()
                raise StopIteration
            self.batch.step()
        return req.queue.popleft()

    def close(self) -> None:
        self.batch.remove(self.rid)

    def pause(self) -> None:
        """Out of the batch's steps until :meth:`resume` (the request is preempted)."""
        self.batch.park(self.rid)

    def resume(self) -> None:
        self.batch.unpark(self.rid)
