"""The AR family's errors: a request the client got wrong, one an engine ended, a
handoff that arrived malformed."""

from __future__ import annotations

from omni_core.plugin import UserInputError


class RequestError(UserInputError):
    """A request field is missing, of the wrong type, or out of range: the client's
    fault, its message shown to the client (see ``UserInputError``)."""


class EngineRequestError(RuntimeError):
    """The engine ended this one request with an error (vLLM's ``finish_reason``
    ``"error"``); the message says why where omni knows (a ``requires_kv`` request whose
    KV does not cover its placeholders), and the engine goes on with the others."""


class HandoffError(Exception):
    """Prefill's handoff arrived malformed: the message names the edge and the field. It
    fails that request alone, as the stage's failure (not the client's)."""
