"""Redacting whole words in a text that arrives in pieces: plain Python, no omni.

Kept apart from the stage so that it can be tested without a pipeline
(``tests/test_redactor.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_TRAILING_WORD = re.compile(r"\w*\Z")


def word_pattern(words: Iterable[str]) -> re.Pattern[str] | None:
    """A case-insensitive pattern matching any of ``words`` as a whole word (None: no
    words)."""
    alternatives = sorted({w.lower() for w in words}, key=len, reverse=True)
    if not alternatives:
        return None
    return re.compile(r"\b(?:" + "|".join(map(re.escape, alternatives)) + r")\b", re.IGNORECASE)


class StreamRedactor:
    """One text stream: each piece is redacted as soon as its words are known to be whole.

    A word may be split across two pieces ("fo" + "xes"), so the word characters at the
    end of what arrived are held back until the next piece, or the end, shows where the
    word ends; everything before them is redacted and passed on at once.
    """

    def __init__(self, pattern: re.Pattern[str] | None, replacement: str) -> None:
        self.pattern = pattern
        self.replacement = replacement
        self.count = 0  # words redacted so far
        self._held = ""

    def feed(self, text: str) -> str:
        """The redacted text that ``text`` completes (possibly empty)."""
        text = self._held + text
        cut = _TRAILING_WORD.search(text).start()  # type: ignore[union-attr]
        self._held = text[cut:]
        return self._redact(text[:cut])

    def finish(self) -> str:
        """The rest of the stream, redacted."""
        text, self._held = self._held, ""
        return self._redact(text)

    def _redact(self, text: str) -> str:
        if self.pattern is None or not text:
            return text
        out, n = self.pattern.subn(self.replacement, text)
        self.count += n
        return out
