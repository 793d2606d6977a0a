"""``surface.tally``: a stage on the public plug-in API alone (``omni_core.plugin``).

It counts what reaches it on each inbound edge and ends each request with one segment,
``payload["tally"]``: per edge, the ``text`` of its segments, their ``tokens``, and of
the arrays named in its ``arrays`` option the ``elements`` and their ``mean`` (as torch
tensors on the device and in the dtype :meth:`StageContext.place` gives it, summed in
float64). A
request whose text passes ``max_text_chars`` fails alone, with a :class:`UserInputError`
naming the option. It uses what a third-party stage would: ``Options``, ``preload``,
``load`` and ``close``, ``StageInput.windows``, ``segment``, ``fail`` and ``end_request``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
from omni_core.plugin import (
    Placement,
    Stage,
    StageEvent,
    StageInput,
    UserInputError,
    Window,
    apply_thread_env,
)


class TallyOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options:`` of ``surface.tally``."""

    arrays: list[str] = msgspec.field(default_factory=lambda: ["image"])
    """The array names whose elements it sums (others are ignored)."""
    dtype: str = "auto"
    """The dtype it sums in (``auto``: float32 on a CPU)."""
    max_text_chars: int = 100_000
    """A request whose text on an edge grows past this fails, naming the option."""


class Edge(msgspec.Struct):
    """What one inbound edge brought one request so far."""

    text: str = ""
    tokens: int = 0
    elements: int = 0
    total: float = 0.0
    last: int = -1  # the sequence of the last event whose text was counted


class Tally(Stage):
    """Counts text, tokens and array elements per edge; one summary at each request's end."""

    Options = TallyOptions
    preload = ("torch",)

    def load(self) -> None:
        """Place the sums (imports torch), with the worker's thread count applied."""
        import torch

        apply_thread_env()
        self.torch = torch
        self.placement: Placement = self.ctx.place(self.options.dtype)
        self.dtype = getattr(torch, self.placement.dtype)
        self.seen: dict[str, dict[str, Edge]] = {}
        self.ctx.logger.info("tally on %s in %s", self.placement.device, self.placement.dtype)

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        """Add each trigger's windows to its request's tally; the last one emits it."""
        for inp in batch:
            edges = self.seen.setdefault(inp.request_id, {})
            try:
                for name, window in inp.windows.items():
                    self._add(edges.setdefault(name, Edge()), window)
            except UserInputError as e:
                yield inp.fail(e)
                continue
            if inp.last:
                tally = {name: msgspec.to_builtins(e) for name, e in edges.items()}
                for e in tally.values():
                    del e["last"]
                    total = e.pop("total")
                    e["mean"] = total / e["elements"] if e["elements"] else None
                yield inp.segment(payload={"tally": tally}, is_last=True)

    def _add(self, edge: Edge, window: Window) -> None:
        for piece in window.pieces:  # an event cut across windows: its payload in each
            if piece.sequence > edge.last:
                edge.text += str(piece.payload.get("text", ""))
                edge.last = piece.sequence
        edge.tokens += len(window.new_tokens)
        if len(edge.text) > self.options.max_text_chars:
            raise UserInputError(
                f"options.max_text_chars: the text passed {self.options.max_text_chars} "
                f"characters on edge {window.edge!r}"
            )
        arrays = window.arrays
        for name in self.options.arrays:
            if name in arrays:
                t = self._tensor(arrays[name])
                edge.elements += t.numel()
                edge.total += float(t.sum(dtype=self.torch.float64))

    def _tensor(self, array: Any) -> Any:
        # received arrays are read-only views of shared memory: torch takes a copy
        t = self.torch.as_tensor(np.array(array))
        return t.to(device=self.placement.device, dtype=self.dtype)

    def end_request(self, request_id: str) -> None:
        """Forget a request that ended here or was cancelled."""
        self.seen.pop(request_id, None)

    def close(self) -> None:
        """Nothing held beyond the tallies."""
        self.seen.clear()
