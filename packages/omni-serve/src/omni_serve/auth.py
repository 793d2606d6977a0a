"""The API key, as a FastAPI dependency: ``Authorization: Bearer KEY`` on every endpoint
that has it (all but ``/health`` and the page) when the server has a key; ``/health``
shows its detail only with it."""

from __future__ import annotations

import secrets

from fastapi import Request

from omni_serve.errors import APIError
from omni_serve.server import server_of


def has_api_key(request: Request) -> bool:
    """Whether the request carries the server's key (True for a server without one)."""
    key = server_of(request).settings.api_key
    if key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(
        token.strip().encode(), key.encode()
    )


def require_api_key(request: Request) -> None:
    """401 unless the request carries the server's key (a no-op without one)."""
    if not has_api_key(request):
        raise APIError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            type="authentication_error",
            code="invalid_api_key",
        )
