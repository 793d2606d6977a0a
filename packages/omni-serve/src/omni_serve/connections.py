"""What uvicorn does not bound on an HTTP connection: the time a request's headers and
its body may take to arrive, and the size of its headers (counted exactly through
httptools' callbacks; h11, uvicorn's other parser, bounds only a head that arrives in
pieces, so it is not used).

A request's head must arrive within ``header_timeout_s`` of its first byte (or of the
connection's start), its body within ``body_timeout_s`` of the end of its head; a
connection past either deadline is closed (a late head gets a 408 first, a late body's
request ends as a client that went away). A head over ``max_header_bytes`` is a 431. So a
client sending a byte at a time (slow loris) holds a connection no longer than the
deadlines, and an answer being written (a stream) has none; nor does a body the server
itself holds back unread (a client past its fair share, :mod:`omni_serve.fair`), whose
deadline starts again once the server reads it. An idle keep-alive connection is
uvicorn's (``timeout_keep_alive``).

With :class:`omni_serve.shares.Shares`, each connection is counted against its address
until a request on it carries a valid key: one past ``--max-connections-per-address`` is
answered 429 at once and closed; the request's scope carries the connection's share
(``scope["omni.connection"]``) for the key's own count."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from omni_serve.fair import BODY_HELD
from omni_serve.shares import CONNECTION, ConnectionShare, Shares, address_refusal

log = logging.getLogger("omni.serve")

_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-length: 0\r\nconnection: close\r\n\r\n"
)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int


class _HeadTooBig(Exception):
    """Raised in a parser callback: the parser stops (and uvicorn answers 400, which
    :meth:`_Guard.send_400_response` turns into the 431)."""


class _Guard:
    """Mixed into uvicorn's HTTP protocol class (see :func:`protocol_class`)."""

    limits: ClassVar[ConnectionLimits]
    shares: ClassVar[Shares | None] = None
    # these belong to uvicorn's protocol classes
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    client: tuple[str, int] | None
    scope: Any

    # what the connection waits for: "head" (a request's headers; deadline), "body"
    # (its body; deadline), "busy" (the app's answer), "idle" (the next request)
    _phase = "head"
    _timer: asyncio.TimerHandle | None = None
    _head_bytes = 0  # received while the head is incomplete
    _head_parsed = 0  # the head's request line and headers as parsed
    _head_too_big = False
    _share: ConnectionShare | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        if self.shares is not None:
            address = self.client[0] if self.client else ""
            self._share = self.shares.connect(address)
            if self._share is None:
                cap = self.shares.per_address
                assert cap is not None  # connect refuses only under a cap
                log.info(
                    "refused a connection from %s: %d open without a known key "
                    "(--max-connections-per-address)",
                    _who(self.client),
                    cap,
                )
                transport.write(address_refusal(address, cap))
                transport.close()
                return
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._share is not None and self.shares is not None:
            self.shares.disconnect(self._share)
            self._share = None
        super().connection_lost(exc)  # type: ignore[misc]

    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        if self._share is not None:  # for the key's own count (omni_serve.shares)
            self.scope[CONNECTION] = self._share
        self.scope[BODY_HELD] = self._body_held

    def _body_held(self, held: bool) -> None:
        """The server holds the body unread (True: no deadline meanwhile) or reads it
        now (False: the whole body deadline from now)."""
        if self._phase == "body" and not self.transport.is_closing():
            if held:
                self._disarm()
            else:
                self._arm(self.limits.body_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._phase == "idle":  # the next request on a kept-alive connection begins
            self._phase, self._head_bytes, self._head_parsed = "head", 0, 0
            self._arm(self.limits.header_timeout_s)
        if self._phase == "head":
            self._head_bytes += len(data)
        before = self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle is not before:  # a request's head arrived
            self._phase, self._head_bytes, self._head_parsed = "body", 0, 0
            self._arm(self.limits.body_timeout_s)
        if self._phase == "body" and cycle is not None and not cycle.more_body:
            self._phase = "idle" if cycle.response_complete else "busy"
            self._disarm()
        elif self._phase == "head" and self._head_bytes > self.limits.max_header_bytes:
            self._refuse_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self._phase == "busy":
            self._phase = "idle"

    # httptools' callbacks: the head's size, exactly
    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)  # type: ignore[misc]

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)  # type: ignore[misc]

    def _count_head(self, n: int) -> None:
        self._head_parsed += n
        if self._head_parsed > self.limits.max_header_bytes:
            self._head_too_big = True
            raise _HeadTooBig

    def send_400_response(self, msg: str) -> None:
        if self._head_too_big:
            self._refuse_head()
        else:
            super().send_400_response(msg)  # type: ignore[misc]

    def _refuse_head(self) -> None:
        log.info(
            "refused a request from %s: headers over %d bytes (--max-header-bytes)",
            _who(self.client),
            self.limits.max_header_bytes,
        )
        self._disarm()
        self.transport.write(_431)
        self.transport.close()

    def _arm(self, timeout_s: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        head = self._phase == "head"
        flag, limit = (
            ("--header-timeout", self.limits.header_timeout_s)
            if head
            else ("--body-timeout", self.limits.body_timeout_s)
        )
        log.info(
            "closed a connection from %s: a request's %s took over %g s (%s)",
            _who(self.client),
            "headers" if head else "body",
            limit,
            flag,
        )
        if head and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(_408)  # no answer is being written: say why
        self.transport.close()


def _who(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def protocol_class(
    limits: ConnectionLimits, shares: Shares | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's httptools HTTP protocol with ``limits`` and, given ``shares``, each
    connection counted against its address or key (pass it as ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    attrs = {"limits": limits, "shares": shares}
    return type("GuardedHttpProtocol", (_Guard, HttpToolsProtocol), attrs)


FD_RESERVE = 256  # descriptors kept for what is not a connection: the pipeline's sockets,
# segments being mapped, logs, remote image fetches


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (or to the kernel's
    ``nr_open`` where the hard limit is unlimited); the soft limit it has then."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open file limit from %d to %d: %s", soft, target, e)
    return soft


def connection_cap(requested: int | None, default: int, fd_limit: int) -> int:
    """The ``--max-connections`` to run with under an open file limit of ``fd_limit``:
    at most ``fd_limit - FD_RESERVE``, so that the process never runs out of descriptors
    before the cap answers 503. The default (``requested`` None) is lowered to fit (and
    logged); a number asked for that does not fit is a ValueError naming both."""
    room = max(1, fd_limit - FD_RESERVE)
    if requested is None:
        if default > room:
            log.warning(
                "--max-connections lowered from %d to %d: the open file limit is %d "
                "(ulimit -n; %d kept for the pipeline)",
                default,
                room,
                fd_limit,
                FD_RESERVE,
            )
        return min(default, room)
    if requested > room:
        raise ValueError(
            f"--max-connections {requested} does not fit the open file limit of {fd_limit} "
            f"(ulimit -n; {FD_RESERVE} kept for the pipeline): at most {room}; raise the "
            "hard limit or ask for fewer"
        )
    return requested
