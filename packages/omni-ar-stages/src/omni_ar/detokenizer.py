"""Incremental detokenization, off the decode loop.

Text is produced by decoding a sliding span of token ids and emitting only what became
stable: a multi-byte character split across tokens (or across segments) is held back
until it is complete, and stop strings are found even when they span segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPLACEMENT = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # ids before this are settled context
    read_offset: int = 0  # ids before this have been turned into text
    text: str = ""  # stable text so far (cut at a stop string)
    emitted: int = 0  # characters of ``text`` released to the caller
    stopped: str | None = None  # the stop string that ended the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Take new token ids; returns the text they complete (may be empty)."""
        if self.stopped is not None:
            return ""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith(REPLACEMENT) or len(full) <= len(prefix):
            return self._release("")  # an incomplete character: wait for more ids
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return self._release(full[len(prefix) :])

    def flush(self) -> str:
        """The end of the stream: everything pending, a held-back tail included."""
        if self.stopped is not None:
            return ""
        out = ""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            self.read_offset = len(self.ids)
            out = self._release(full[len(prefix) :])
        if self.stopped is None:
            out += self.text[self.emitted :]
            self.emitted = len(self.text)
        return out

    def _release(self, delta: str) -> str:
        """Add stable text; release what cannot be the start of a stop string."""
        self.text += delta
        end = len(self.text)
        if self.stop:
            # a stop string can only start at or after ``emitted``: the tail that could
            # begin one is always held back
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, self.emitted)) >= 0]
            if hits:
                pos, self.stopped = min(hits)
                self.text = self.text[:pos]
                end = pos
            else:
                hold = max(
                    (k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])),
                    default=0,
                )
                end = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
