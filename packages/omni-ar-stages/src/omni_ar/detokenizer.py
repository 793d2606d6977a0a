"""Incremental detokenization, off the decode loop.

Text is produced by decoding a sliding span of token ids and emitting only what became
stable: a multi-byte character split across tokens (or across segments) is held back
until it is complete, and stop strings are found even when they span segments. Stop
matching is linear in the text: each stop string is a Knuth-Morris-Pratt automaton fed
each new character once, whose state (the longest prefix of the stop string that ends the
text) is also how much text must be held back. As in vLLM, a stop string counts only once
more than ``min_tokens`` tokens were generated: one that ends in the text of an earlier
token is passed over (the text is held back all the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPLACEMENT = "\ufffd"


class StopMatcher:
    """One stop string over streamed text (Knuth-Morris-Pratt)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0  # the longest prefix of ``stop`` that ends the text fed so far
        self.fail = [0] * len(stop)  # fail[i]: the longest proper border of stop[: i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, text: str, armed: bool = True) -> int | None:
        """Advance over ``text``; the index just past the first full match in it, if any
        (not ``armed``: matches are passed over, the state goes on past them)."""
        stop, fail, k, n = self.stop, self.fail, self.state, len(self.stop)
        for i, ch in enumerate(text):
            while k and stop[k] != ch:
                k = fail[k - 1]
            if stop[k] == ch:
                k += 1
                if k == n:
                    if armed:
                        self.state = k
                        return i + 1
                    k = fail[k - 1]
        self.state = k
        return None


def detokenizer(tokenizer: Any, params: Any, stop_ids: list[int] | None = None) -> Any:
    """The request's :class:`IncrementalDetokenizer` by its params (``stop``,
    ``skip_special_tokens``, ``include_stop_str_in_output``, ``min_tokens``);
    ``stop_ids``: the tokens that end it (decode's ``stop_ids``), which leave no text
    unless it includes them."""
    include = params.include_stop_str_in_output
    return IncrementalDetokenizer(
        tokenizer,
        stop=params.stop,
        skip_special_tokens=params.skip_special_tokens,
        include_stop=include,
        drop_ids=frozenset(() if include else stop_ids or ()),
        min_tokens=getattr(params, "min_tokens", 0),
    )


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop: bool = False  # a stop string found stays at the end of the text
    # tokens that end the request and leave no text (vLLM's: EOS and stop_token_ids, unless
    # include_stop_str_in_output)
    drop_ids: frozenset[int] = frozenset()
    # a stop string ending in the text of token ``min_tokens`` or earlier is passed over
    # (vLLM: stop strings are checked once more than ``min_tokens`` tokens were generated)
    min_tokens: int = 0
    ids: list[int] = field(default_factory=list)
    generated: int = 0  # tokens taken, dropped ones included (vLLM's output token count)
    prefix_offset: int = 0  # ids before this are settled context
    read_offset: int = 0  # ids before this have been turned into text
    text: str = ""  # stable text so far (cut at a stop string)
    emitted: int = 0  # characters of ``text`` released to the caller
    stopped: str | None = None  # the stop string that ended the text

    def __post_init__(self) -> None:
        self.matchers = [StopMatcher(s) for s in self.stop if s]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Take new token ids; returns the text they complete (may be empty)."""
        if self.matchers and self.generated < self.min_tokens < self.generated + len(new_ids):
            # the ids cross the min_tokens line: the text of each up to it, unarmed
            cut = self.min_tokens - self.generated
            return self.add(new_ids[:cut]) + self.add(new_ids[cut:])
        if self.stopped is not None:
            return ""
        self.generated += len(new_ids)
        self.ids.extend(t for t in new_ids if t not in self.drop_ids)
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
        start = len(self.text)
        self.text += delta
        end = len(self.text)
        if self.matchers:
            # the earliest-starting match; a stop string can only start at or after
            # ``emitted``: the tail that could begin one is always held back
            first: tuple[int, str] | None = None
            armed = self.generated > self.min_tokens
            for m in self.matchers:
                past = m.feed(delta, armed)
                if past is not None:
                    hit = (start + past - len(m.stop), m.stop)
                    first = hit if first is None else min(first, hit)
            if first is not None:
                pos, self.stopped = first
                if self.include_stop:
                    pos += len(self.stopped)
                self.text = self.text[:pos]
                end = pos
            else:
                hold = max(m.state for m in self.matchers)
                end = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
