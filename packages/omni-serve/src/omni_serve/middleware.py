"""What every HTTP request goes through first: its request id (the client's
``X-Request-Id`` when sane, else a new one; returned as ``X-Request-Id`` on every answer
and put in every error body) and the ``Host`` allow-list.

The allow-list is the defence against DNS rebinding: a web page on ``evil.example`` whose
name the attacker re-points at 127.0.0.1 makes the browser send ``Host: evil.example`` to
a server on the loopback interface, and reading the answers is then same-origin for that
page. A server bound to a loopback address therefore answers only ``localhost``,
``127.0.0.1``, ``[::1]`` (and the bound address) at any port, plus the names the operator
allows (``--allowed-host``; ``*`` turns the check off)."""

from __future__ import annotations

import ipaddress
import re
import time
import uuid
from collections.abc import Sequence

from fastapi import Request
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_serve.errors import APIError, printable

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")  # no '~': the runtime's replay suffix


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """A ``Host`` header's name, lower case, without port or trailing dot
    (``[::1]:8000`` -> ``[::1]``)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name = value[: end + 1] if end > 0 else value
    elif value.count(":") == 1:
        name = value.partition(":")[0]
    else:
        name = value
    return name.rstrip(".")


def allowed_hosts(bind_host: str, extra: Sequence[str] = ()) -> tuple[str, ...] | None:
    """The ``Host`` names a server bound to ``bind_host`` answers; None: any.

    Loopback binds get the loopback names (and the bound address) plus ``extra``; other
    binds check only when ``extra`` names hosts. ``*`` in ``extra`` turns the check off."""
    if "*" in extra:
        return None
    if not extra and not is_loopback(bind_host):
        return None
    bound = f"[{bind_host}]" if ":" in bind_host and not bind_host.startswith("[") else bind_host
    names = [*LOOPBACK_NAMES, host_name(bound), *(host_name(h) for h in extra)]
    return tuple(dict.fromkeys(n for n in names if n))


def request_id_of(request: Request) -> str:
    """The request id :class:`RequestContext` gave the request."""
    return str(request.scope.get("state", {}).get("request_id", ""))


def started_at(request: Request) -> float:
    """When the request arrived (``time.monotonic()``)."""
    return float(request.scope.get("state", {}).get("t0", time.monotonic()))


class RequestContext:
    """Pure ASGI middleware: request id, arrival time and the ``Host`` check."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...] | None = None) -> None:
        self.app = app
        self.allowed = None if allowed is None else frozenset(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        sent = headers.get("x-request-id", "")
        client_id = _REQUEST_ID.fullmatch(sent) is not None
        rid = sent if client_id else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state.update(request_id=rid, client_request_id=client_id, t0=time.monotonic())
        raw_id = rid.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                head = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*head, (b"x-request-id", raw_id)]}
            await send(message)

        host = headers.get("host")
        if self.allowed is not None and host is not None and host_name(host) not in self.allowed:
            err = APIError(
                400,
                f"Host {printable(host[:200])!r} is not allowed: this server answers "
                f"{', '.join(sorted(self.allowed))} (any port); allow more names with "
                "--allowed-host (a defence against DNS rebinding)",
                param="Host",
                code="host_not_allowed",
            )
            await JSONResponse(err.body(rid), status_code=err.status)(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)
