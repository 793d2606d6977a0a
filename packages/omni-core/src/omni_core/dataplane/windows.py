"""Per-edge windows, applied on the consuming side; one :class:`WindowState` per (edge, request).

A *unit* is a token when a piece carries tokens, an image event is one unit, else a row
(axis 0) of a segment's 2-D-or-more arrays when they agree on it (hidden states: one row
per token), else the whole piece. ``size=-1`` emits one window with every unit once
the upstream stream ends; ``size=N`` emits every N new units and the remainder at the end;
``overlap=K`` prefixes each window with the previous K units as left context.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Any, ClassVar

import msgspec
import numpy as np

from omni_core.events import ShmHandle


class Piece(msgspec.Struct, gc=False):
    """One received data event, decoded: what a window is stitched from.

    Not tracked by the cycle collector (``gc=False``): a piece holds decoded data only, so
    it is in no reference cycle, and a fast stream of pieces does not trigger collections.
    """

    sequence: int
    """The upstream event's sequence number (the same in every window that cuts it)."""
    tokens: list[int] | None
    """Its token ids (of a cut event: those in this window)."""
    arrays: dict[str, Any]
    """Its arrays: numpy arrays, torch tensors or bytes."""
    payload: dict[str, Any]
    """Its payload (of a cut event: the whole payload, in each window)."""
    handles: list[ShmHandle] = []  # to release once dropped
    """The shared-memory slots to release once the piece is dropped (the runtime's)."""
    step: int | None = None
    """An image event's step (``None`` for a segment)."""
    logprobs: list[float] | None = None
    """Its tokens' logprobs, when the producer sent them."""
    units: int = -1  # counted once, at construction (-1: count them)
    """How many units it holds (counted once, at construction; -1: count them)."""

    def __post_init__(self) -> None:
        if self.units < 0:
            self.units = self._count_units()

    def _count_units(self) -> int:
        tokens = self.tokens
        if tokens is not None:
            return len(tokens)
        if self.step is not None:  # an image event is one unit, whatever its arrays
            return 1
        rows = self._rows()
        return 1 if rows is None else rows

    def _rows(self) -> int | None:
        lengths = {a.shape[0] for a in self.arrays.values() if getattr(a, "ndim", 1) >= 2}
        if len(lengths) == 1:
            return int(lengths.pop())
        return None

    def slice(self, lo: int, hi: int) -> Piece:
        """The units [lo, hi) of this piece (a view, no copy)."""
        if lo == 0 and hi == self.units:
            return self
        tokens = self.tokens[lo:hi] if self.tokens is not None else None
        arrays = self.arrays
        rows = self._rows() if self.step is None else None
        if rows is not None and (self.tokens is None or rows == len(self.tokens)):
            arrays = {k: a[lo:hi] for k, a in self.arrays.items()}
        lp = self.logprobs[lo:hi] if self.logprobs is not None else None
        return Piece(self.sequence, tokens, arrays, self.payload, [], self.step, lp, hi - lo)


class RunPiece(msgspec.Struct, gc=False):
    """Consecutive array-free segments of one request, kept in columns (a received
    :class:`~omni_core.events.SegmentRun`): a window takes them as one part, and
    :attr:`Window.pieces` expands them into :class:`Piece` s only when asked. Every segment
    holds at least one unit (a run with a unit-less segment is taken as pieces)."""

    sequence: int  # of the first segment
    tokens: list[list[int] | None]
    payloads: list[dict[str, Any]]
    logprobs: list[list[float] | None] | None
    counts: list[int]  # units per segment
    units: int
    handles: ClassVar[list[ShmHandle]] = []  # array-free: nothing to release

    def pieces(self) -> list[Piece]:
        seq, tokens, payloads, counts = self.sequence, self.tokens, self.payloads, self.counts
        lps = self.logprobs or [None] * len(counts)
        return [
            Piece(seq + k, tokens[k], {}, payloads[k], [], None, lps[k], counts[k])
            for k in range(len(counts))
        ]

    def slice(self, lo: int, hi: int) -> RunPiece:
        """The units [lo, hi): the segments they fall in, the outer two cut to them."""
        if lo == 0 and hi == self.units:
            return self
        starts = list(accumulate(self.counts, initial=0))
        a = bisect_right(starts, lo) - 1  # the segment of unit lo
        b = bisect_left(starts, hi)  # one past the segment of unit hi - 1
        cut_lo, cut_hi = lo - starts[a], hi - starts[b - 1]  # within segments a and b - 1

        def cut(column: list[Any]) -> list[Any]:
            part = column[a:b]
            if part[-1] is not None:
                part[-1] = part[-1][:cut_hi]
            if part[0] is not None:
                part[0] = part[0][cut_lo:]
            return part

        tokens = cut(self.tokens)
        counts = [1 if t is None else len(t) for t in tokens]
        lps = cut(self.logprobs) if self.logprobs is not None else None
        return RunPiece(self.sequence + a, tokens, self.payloads[a:b], lps, counts, hi - lo)


@dataclass
class Window:
    """What a downstream stage sees of one upstream edge for one trigger."""

    edge: str
    """The upstream stage's name."""
    index: int
    """0, 1, ... per (edge, request)."""
    start: int
    """The unit index (in the edge's stream) of the window's first new unit."""
    overlap: int
    """Context units repeated from the previous window, before ``start``."""
    parts: list[Piece | RunPiece]
    """The pieces as stitched; read :attr:`pieces` or the accessors below."""
    is_last: bool
    """The edge's stream ended with this window."""
    release: list[ShmHandle] = field(default_factory=list)
    """Shared-memory slots no later window needs (the runtime's)."""

    @cached_property
    def pieces(self) -> list[Piece]:
        """One :class:`Piece` per received event (of a cut one, the units in the window)."""
        out: list[Piece] = []
        for p in self.parts:
            if isinstance(p, RunPiece):
                out.extend(p.pieces())
            else:
                out.append(p)
        return out

    def _per_event(self, run_column: str, piece_field: str) -> list[Any]:
        """Each event's value of a field, in order: a run's column, a piece's field."""
        out: list[Any] = []
        for p in self.parts:
            if type(p) is RunPiece:
                column = getattr(p, run_column)
                if column is not None:
                    out.extend(column)
            else:
                out.append(getattr(p, piece_field))
        return out

    @property
    def tokens(self) -> list[int]:
        """Every token of the window, the overlap's context first."""
        return [t for ts in self._per_event("tokens", "tokens") if ts is not None for t in ts]

    @property
    def new_tokens(self) -> list[int]:
        """The window's tokens without the overlap's context."""
        return self.tokens[self.overlap :]

    @property
    def logprobs(self) -> list[float]:
        """The logprobs of the window's tokens, where the producer sent them."""
        lps = self._per_event("logprobs", "logprobs")
        return [x for xs in lps if xs is not None for x in xs]

    @property
    def payloads(self) -> list[dict[str, Any]]:
        """Each event's payload, in order (an event cut across windows: in each)."""
        return self._per_event("payloads", "payload")

    @property
    def units(self) -> int:
        """How many units the window holds, the overlap's included."""
        return sum(p.units for p in self.parts)

    @property
    def piece_arrays(self) -> list[dict[str, Any]]:
        """The arrays of each event that has any, as they came (no concatenation)."""
        return [p.arrays for p in self.parts if type(p) is Piece and p.arrays]

    @cached_property
    def arrays(self) -> dict[str, Any]:
        """Each array name concatenated along axis 0 across pieces (a view if one piece)."""
        names: dict[str, list[Any]] = {}
        for arrays in self.piece_arrays:
            for k, a in arrays.items():
                names.setdefault(k, []).append(a)
        out: dict[str, Any] = {}
        for k, parts in names.items():
            if len(parts) == 1:
                out[k] = parts[0]
                continue
            first = parts[0]
            if type(first).__module__.startswith("torch"):
                import torch

                out[k] = torch.cat(parts, dim=0)
            elif isinstance(first, np.ndarray):
                try:
                    out[k] = np.concatenate(parts, axis=0)
                except ValueError as e:
                    raise ValueError(
                        f"window on edge {self.edge!r}: array {k!r} has pieces of shapes "
                        f"{[p.shape for p in parts]} that do not stack along axis 0; "
                        "read window.pieces instead"
                    ) from e
            else:
                out[k] = b"".join(bytes(p) for p in parts)
        return out


class WindowState:
    """Stitches the parts (pieces, runs) of one (edge, request) and cuts windows from them."""

    def __init__(self, edge: str, size: int = -1, overlap: int = 0) -> None:
        if size == 0 or size < -1:
            raise ValueError(f"window size must be -1 or >= 1, got {size}")
        if overlap < 0:
            raise ValueError(f"window overlap must be >= 0, got {overlap}")
        self.edge = edge
        self.size = size
        self.overlap = overlap
        self.parts: list[Piece | RunPiece] = []
        self.base = 0  # unit index of parts[0]
        self.total = 0  # units received
        self.emitted = 0  # units emitted as new
        self.count = 0  # windows emitted
        self.ended = False

    def push(self, piece: Piece, is_last: bool = False) -> list[Window]:
        """Add a piece; returns the windows it completes."""
        return self.push_many([piece], piece.units, is_last)

    def push_many(
        self, parts: list[Piece | RunPiece], units: int, is_last: bool = False
    ) -> list[Window]:
        """Add consecutive parts holding ``units`` units in all; returns the windows they
        complete (the same as pushing their events one by one)."""
        if self.ended:
            raise ValueError(f"edge {self.edge!r}: data after the end of the stream")
        self.parts.extend(parts)
        self.total += units
        size = self.size
        if size > 0 and self.total - self.emitted >= size:
            out = []
            while self.total - self.emitted >= size:
                out.append(self._cut(self.emitted + size, last=False))
            if is_last:
                out.extend(self.end())
            return out
        return self.end() if is_last else []

    def room(self, windows: int) -> int | None:
        """How many more units complete ``windows`` more windows (None: only the end does)."""
        if self.size < 0:
            return None
        return max(1, windows * self.size - (self.total - self.emitted))

    def end(self) -> list[Window]:
        """The upstream stream ended: emit what remains, flagged last (empty if nothing does)."""
        if self.ended:
            return []
        self.ended = True
        return [self._cut(self.total, last=True)]

    def _cut(self, hi: int, last: bool) -> Window:
        lo_new = self.emitted
        ctx = min(self.overlap, lo_new - self.base) if self.size > 0 else 0
        lo = lo_new - ctx
        parts: list[Piece | RunPiece] = []
        pos = self.base
        for p in self.parts:
            n = p.units
            end = pos + n
            if n == 0:  # a unit-less piece (an end marker with a payload) goes with its spot
                if lo_new <= pos and (pos < hi or last):
                    parts.append(p)
            elif lo <= pos and end <= hi:  # whole (the common case)
                parts.append(p)
            elif pos < hi and end > lo:
                parts.append(p.slice(max(lo, pos) - pos, min(hi, end) - pos))
            elif pos >= hi:
                break
            pos = end
        self.emitted = hi
        window = Window(self.edge, self.count, lo_new, ctx, parts, last)
        self.count += 1
        window.release = self._trim(keep_from=hi if last else hi - self.overlap)
        return window

    def _trim(self, keep_from: int) -> list[ShmHandle]:
        """Drop parts no later window reads; their slots may be released."""
        freed: list[ShmHandle] = []
        if self.ended:
            keep_from = self.total + 1
        parts = self.parts
        k, base = 0, self.base
        for p in parts:
            n = p.units
            end = base + n
            if end > keep_from or (n == 0 and end == keep_from):
                break
            if p.handles:
                freed.extend(p.handles)
            base = end
            k += 1
        if k:
            del parts[:k]
            self.base = base
        return freed

    def drop(self) -> list[ShmHandle]:
        """Forget the request (cancel or error); returns slots to release."""
        freed = [h for p in self.parts for h in p.handles]
        self.parts.clear()
        self.ended = True
        return freed
