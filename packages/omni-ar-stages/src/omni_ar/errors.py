"""The AR family's error for a request the client got wrong."""

from __future__ import annotations

from omni_core.errors import UserInputError


class RequestError(UserInputError):
    """A request field is missing, of the wrong type, or out of range: the client's
    fault, its message shown to the client (see ``UserInputError``)."""
