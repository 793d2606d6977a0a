"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the status
that fits; what the pipeline reports is mapped here, and nothing else ever leaks."""

from __future__ import annotations

import re
from typing import Any

from omni_core.events import Cancelled, Error

# pipeline stages name a bad field as "field 'image.width': ..." (omni_ar / omni_dit params)
_FIELD = re.compile(r"field '([^']+)'")


class APIError(Exception):
    """An answer other than success, as the OpenAI API shapes it."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",  # noqa: A002 (the OpenAI field's name)
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_field(param: str, message: str) -> APIError:
    """A 400 naming the request field."""
    return APIError(400, f"field '{param}': {message}", param=param)


def from_terminal(ev: Error | Cancelled, params: dict[str, str] | None = None) -> APIError:
    """The API error for a request the pipeline ended without completing it.

    A stage's validation error names a field: that is the client's fault (400). A timeout
    is 504; a dead worker or any other stage failure is the server's (500, the stage's own
    one-line message: stages never put tracebacks into events). ``params`` renames the
    pipeline's field names to the request's (``image.width`` -> ``size``)."""
    if isinstance(ev, Cancelled):
        if ev.reason == "timeout":
            return APIError(504, "the request timed out", type="timeout", code="timeout")
        return APIError(499, "the request was cancelled", type="cancelled", code="cancelled")
    m = _FIELD.search(ev.message)
    if m and ev.code == "stage_error":
        param = (params or {}).get(m.group(1), m.group(1))
        return APIError(400, ev.message, param=param, code="invalid_value")
    return APIError(500, ev.message, type="server_error", code=ev.code)
