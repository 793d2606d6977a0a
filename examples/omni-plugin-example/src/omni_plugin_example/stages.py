"""The ``example.redact`` stage: masks listed words in the text streaming through it.

It sits after a stage that streams text segments (``{"text": delta}``, such as the AR
family's ``ar.postprocess``) and streams the redacted text on, passing the AR stages'
``finish_reason`` and ``prompt_tokens`` along, so it can end any text pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from omni_core.plugin import Stage, StageEvent, StageInput

from omni_plugin_example.redactor import StreamRedactor, word_pattern

# what the AR stages put in a text segment's payload besides the text, passed on
PASSED_ON = ("finish_reason", "prompt_tokens")

Word = Annotated[str, msgspec.Meta(pattern=r"^\w+$")]


class RedactOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The stage's ``options:``, checked when the pipeline config is loaded: an unknown
    key, a wrong type or a ``words`` entry that is not one word fails the config, naming
    ``stages[i].options...``."""

    words: list[Word] = []  # matched whole and case-insensitively
    replacement: str = "***"


@dataclass
class _Request:
    """What the stage keeps for one request between its windows."""

    redactor: StreamRedactor
    last_sequence: int = -1  # the last upstream event taken
    passed_on: dict[str, Any] = field(default_factory=dict)


class Redact(Stage):
    """Masks the words of ``options.words`` in the upstream's text, as it streams."""

    Options = RedactOptions

    def load(self) -> None:
        # once, in the worker process: where a model stage would load its weights
        self.pattern = word_pattern(self.options.words)
        self.requests: dict[str, _Request] = {}

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            req = self.requests.get(inp.request_id)
            if req is None:  # the request's first window here
                redactor = StreamRedactor(self.pattern, self.options.replacement)
                req = self.requests[inp.request_id] = _Request(redactor)
            text = self._new_text(req, inp)
            if text is None:
                yield inp.fail("expected text segments from upstream (a payload with 'text')")
                continue
            out = req.redactor.feed(text)
            if inp.last:  # no more windows for this request: flush, and end its stream
                payload = {"text": out + req.redactor.finish(), "redacted": req.redactor.count}
                yield inp.segment(payload={**payload, **req.passed_on}, is_last=True)
            elif out:
                yield inp.segment(payload={"text": out})

    def _new_text(self, req: _Request, inp: StageInput) -> str | None:
        """The text of the upstream events this window brings for the first time.

        A window counts units, and the upstream's segments carry tokens, so a window of N
        tokens may cut a segment in two: its payload then comes with each window it
        spans. Each upstream event is taken once, by its sequence number.
        """
        parts = []
        for piece in inp.window.pieces:
            if piece.sequence <= req.last_sequence:
                continue
            req.last_sequence = piece.sequence
            text = piece.payload.get("text")
            if not isinstance(text, str):
                return None
            parts.append(text)
            req.passed_on.update({k: piece.payload[k] for k in PASSED_ON if k in piece.payload})
        return "".join(parts)

    def end_request(self, request_id: str) -> None:
        # the request ended here, or was cancelled or failed elsewhere: forget it
        self.requests.pop(request_id, None)
