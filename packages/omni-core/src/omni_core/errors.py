"""The errors a caller of the runtime can get from ``submit`` and ``start``.

Each has a stable ``code`` (the ``code`` of the terminal ``Error`` event a request gets
for the same cause), so a server maps them to statuses without parsing messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_core.health import Failure


class OmniError(RuntimeError):
    """Base of the runtime's own errors."""

    code = "omni_error"


class UserInputError(ValueError):
    """A request's own fault, in words meant for its client (``field 'image.width': 4000
    is over the limit of ...``): a stage raises it (failing the requests of that call, as
    any exception would, but as theirs) or yields ``inp.fail(error)`` with it, and its
    message (prefixed with the stage's name) is what a server may show the client, with
    code ``invalid_request``. Any other failure's text is for the logs only
    (a server shows a generic message and the request id)."""

    code = "invalid_request"


class StageStartError(OmniError):
    """A stage worker did not come up (load failure, crash, or ready timeout)."""

    code = "stage_start_failed"


class StageDeadError(OmniError):
    """A request needs a stage whose worker is dead for good (its restart budget is spent)."""

    code = "stage_dead"


class RuntimeFailedError(OmniError):
    """A part of the runtime itself failed and cannot go on; every request is refused.

    Like vLLM's ``EngineDeadError``: once raised, the pipeline must be closed and started
    again; every request that was open got a terminal error with code ``runtime_failed``.
    """

    code = "runtime_failed"

    @classmethod
    def of(cls, failure: Failure) -> RuntimeFailedError:
        """The error for a runtime whose ``failure`` (``{"part", "error"}``) is set."""
        return cls(f"the runtime failed ({failure['part']}: {failure['error']})")


class OverloadedError(OmniError):
    """Admission refused: ``max_queued_requests`` requests are already open."""

    code = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
