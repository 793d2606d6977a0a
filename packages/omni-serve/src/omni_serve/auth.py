"""The API key, as a FastAPI dependency: ``Authorization: Bearer KEY`` on every endpoint
that has it (all but ``/health`` and the page) when the server has a key (or several,
``omni_serve.keys``); ``/health`` shows its detail only with one."""

from __future__ import annotations

from fastapi import Request

from omni_serve.errors import APIError
from omni_serve.keys import ApiKey, identify
from omni_serve.server import server_of


def key_of(request: Request) -> ApiKey | None:
    """The server's key the request carries (None: none), as ``omni_serve.shares``'
    middleware found it, else compared here."""
    state = request.scope.get("state", {})
    if "api_key" in state:
        return state["api_key"]  # type: ignore[no-any-return]
    keys = server_of(request).shares.keys
    return identify(keys, request.headers.get("authorization", ""))


def has_api_key(request: Request) -> bool:
    """Whether the request carries one of the server's keys (True for a server without)."""
    return not server_of(request).shares.keys or key_of(request) is not None


def require_api_key(request: Request) -> None:
    """401 unless the request carries the server's key (a no-op without one)."""
    if not has_api_key(request):
        raise APIError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            type="authentication_error",
            code="invalid_api_key",
        )
