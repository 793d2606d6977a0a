"""The API key, as a FastAPI dependency: ``Authorization: Bearer KEY`` on every endpoint
that has it (all but ``/health`` and the page) when the server has a key."""

from __future__ import annotations

import secrets

from fastapi import Request

from omni_serve.errors import APIError
from omni_serve.server import server_of


def require_api_key(request: Request) -> None:
    """401 unless the request carries the server's key (a no-op without one)."""
    key = server_of(request).settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        token.strip().encode(), key.encode()
    ):
        raise APIError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            type="authentication_error",
            code="invalid_api_key",
        )
