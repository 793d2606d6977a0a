"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code", "request_id"}}``
with the status that fits; what the pipeline reports is mapped here, and nothing else ever
leaks: a 5xx names the stage and the request id, never a stage's or the runtime's own
message (that goes to the server's log, with the request id)."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from omni_core.errors import OverloadedError, RuntimeFailedError, StageDeadError, UserInputError
from omni_core.events import Cancelled, Error

log = logging.getLogger("omni.serve")

# a user-facing error names a bad field as "field 'image.width': ..." (omni_ar / omni_dit)
_FIELD = re.compile(r"field '([^']+)'")
_STAGE = re.compile(r"stage '([^']+)'")  # how StageDeadError names the stage


def printable(text: str) -> str:
    """``text`` safe to put in a JSON answer: a lone surrogate becomes ``\\ud800``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An answer other than success, as the OpenAI API shapes it."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",  # noqa: A002 (the OpenAI field's name)
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self, request_id: str | None = None) -> dict[str, Any]:
        err: dict[str, Any] = {
            "message": printable(self.message),
            "type": self.type,
            "param": None if self.param is None else printable(self.param),
            "code": self.code,
        }
        if request_id is not None:
            err["request_id"] = request_id
        return {"error": err}


RETRY_AFTER_S = 1  # what a client told to come back is told to wait


def server_busy(message: str) -> APIError:
    """A 503 with ``Retry-After``: a shared budget of the server has no room now."""
    return APIError(
        503,
        f"{message}; retry in {RETRY_AFTER_S} s",
        type="server_error",
        code="server_busy",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def bad_field(param: str, message: str) -> APIError:
    """A 400 naming the request field."""
    return APIError(400, f"field '{param}': {message}", param=param)


def user_input(message: str, params: dict[str, str] | None = None) -> APIError:
    """The 400 of a :class:`UserInputError` (the client's fault): its message, and as
    ``param`` the field it names (renamed by ``params``, as :func:`from_terminal`'s)."""
    m = _FIELD.search(message)
    param = (params or {}).get(m.group(1), m.group(1)) if m else None
    return APIError(400, message, param=param, code="invalid_value")


def from_terminal(
    ev: Error | Cancelled, params: dict[str, str] | None = None, request_id: str = ""
) -> APIError:
    """The API error for a request the pipeline ended without completing it.

    A stage's :class:`UserInputError` (code ``invalid_request``) is the client's fault: a
    400 with the stage's message (``param``: the field it names); no other error's text
    ever reaches the client. A timeout is 504; a failed runtime or a dead stage 503; any other stage
    failure 500, naming the stage and the request id only (the stage's message is logged
    here). ``params`` renames the pipeline's field names to the request's
    (``image.width`` -> ``size``)."""
    if isinstance(ev, Cancelled):
        if ev.reason == "timeout":
            return APIError(504, "the request timed out", type="timeout", code="timeout")
        return APIError(499, "the request was cancelled", type="cancelled", code="cancelled")
    if ev.code == UserInputError.code:
        return user_input(ev.message, params)
    log.error(
        "request failed: %s (%s)",
        ev.message,
        ev.code,
        extra={"request_id": request_id, "stage": ev.stage, "sequence": ev.sequence},
    )
    rid = f"request id {request_id}"
    if ev.code == RuntimeFailedError.code:
        return APIError(503, f"the runtime failed; {rid}", type="server_error", code=ev.code)
    if ev.code == StageDeadError.code:
        return APIError(
            503, f"stage {ev.stage!r} is dead; {rid}", type="server_error", code=ev.code
        )
    if ev.code == "pipeline_closed":
        return APIError(503, f"the server is shutting down; {rid}", type="server_error")
    where = f"stage {ev.stage!r}" if ev.stage else "the pipeline"
    return APIError(500, f"{where} failed; {rid}", type="server_error", code=ev.code)


def submit_error(e: BaseException, request_id: str = "") -> APIError:
    """The API error for a request the pipeline refused (``submit`` raised ``e``)."""
    if isinstance(e, APIError):  # the server's own refusal (a key's max_queued)
        return e
    rid = f"request id {request_id}"
    extra = {"request_id": request_id}
    if isinstance(e, OverloadedError):
        retry = max(1, math.ceil(e.retry_after_s)) if math.isfinite(e.retry_after_s) else 1
        # counted in the metrics; a flood of requests must not flood the log too
        log.info("request refused: %s", e, extra=extra)
        return APIError(
            429,
            f"the server is overloaded; retry in {retry} s",
            type="rate_limit_error",
            code=OverloadedError.code,
            headers={"Retry-After": str(retry)},
        )
    if isinstance(e, UserInputError):  # the pipeline's own checks (a request's priority)
        log.info("request refused: %s", e, extra=extra)
        return user_input(str(e))
    if isinstance(e, TypeError) and "cannot be serialized" in str(e):
        # the server's checks should have caught it; still the request's fault
        log.warning("request refused: %s", e, extra=extra)
        return APIError(400, "the request holds a value the pipeline cannot carry")
    log.error("request refused: %s: %s", type(e).__name__, e, extra=extra)
    if isinstance(e, RuntimeFailedError):
        msg = f"the runtime failed and cannot serve requests; {rid}"
        return APIError(503, msg, type="server_error", code=RuntimeFailedError.code)
    if isinstance(e, StageDeadError):
        m = _STAGE.match(str(e))
        who = f"stage {m.group(1)!r}" if m else "a stage of the pipeline"
        msg = f"{who} is dead; the pipeline cannot serve requests; {rid}"
        return APIError(503, msg, type="server_error", code=StageDeadError.code)
    msg = f"the pipeline is not accepting requests; {rid}"
    return APIError(503, msg, type="server_error")
