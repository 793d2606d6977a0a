"""Fair shares per client: what one API key (or, before a key is known, one address) may
hold of the server, so that no client can starve the others.

- Connections: until a request on it carries a valid key, a connection counts against
  its address (``--max-connections-per-address``); one over is answered 429 at once and
  closed (so idle and half-sent connections from one address cannot fill
  ``--max-connections``). From its first request with a key it counts against that key's
  ``max_connections`` instead; a request over it is a 429 and the connection is closed.
- Requests in flight: a key's HTTP requests being answered (streams until their end),
  ``/health`` aside, at most its ``max_inflight``.
- Queued requests: a key's pipeline requests open at once (``n`` images: ``n``), at most
  its ``max_queued`` (a share of ``--max-queued-requests``).
- Running requests: with ``--max-running-requests N``, at most N pipeline requests run at
  once, shared between the active keys (running, waiting, or between two requests: see
  :data:`ANTICIPATE_S`): a key alone may run N, with others its fair share (N times its
  ``weight`` over the active keys' weights, rounded up: N over the active keys where
  all weigh the same). Past it a request waits (counted in its key's ``max_queued``);
  each time one ends, the oldest waiting request of the key running fewest for its
  weight that may run goes next. A key that floods cannot take the places of
  another that asks, even while that one's client is between two requests.
- Priority: a request asking a ``priority`` better (lower) than its key's
  ``best_priority`` is a 400 naming ``priority`` (:meth:`omni_serve.server.Server.check_priority`).

Each refusal is a 429 with ``Retry-After`` and an OpenAI-shaped body naming the limit,
counted in ``omni_http_refusals_total{key, reason}``; other clients are untouched. A
key's refusals are held for its ``refusal_delay_s`` before they are sent (a tarpit): a
client flooding past its share gets its answers at the pace its ``Retry-After`` asks for,
instead of costing the server's event loop an answer each time it asks again at once.
What that holds is bounded by the caps above: each held refusal is on a connection its
key (over ``max_inflight`` or ``max_queued``) or its address (over ``max_connections``:
the connection was never counted against the key) already counts. The per-address
refusal at connect is never held (that connection is counted nowhere)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from omni_serve.errors import RETRY_AFTER_S, APIError
from omni_serve.keys import ApiKey, identify
from omni_serve.metrics import ServerMetrics

log = logging.getLogger("omni.serve")

CONNECTION = "omni.connection"  # the scope key of a request's ConnectionShare
# the key of the request being answered (read where no Request is at hand: the priority
# check, which may run in a worker thread, and the pipeline's submit)
CLIENT: contextvars.ContextVar[ApiKey | None] = contextvars.ContextVar(
    "omni_serve_client", default=None
)
# how long a key that ended its last running request still counts as active at the fair
# gate: a client that sends its next request on the answer to the last is between two
# requests for a few milliseconds, and another key's flood must not take its share then
# (deceptive idleness, which Linux's anticipatory I/O scheduler waited out the same way)
ANTICIPATE_S = 0.1
HEALTH = "/health"  # never counted against a key: a monitor must see an overloaded key


def over_share(message: str, key: str, reason: str, metrics: ServerMetrics) -> APIError:
    """The 429 of a client over its share (counted as ``reason`` of ``key``)."""
    metrics.refusals.labels(key, reason).inc()
    return APIError(
        429,
        f"{message}; retry in {RETRY_AFTER_S} s",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


@dataclass(eq=False)
class ConnectionShare:
    """One connection: its address, and the key it counts against (None: its address)."""

    address: str
    key: ApiKey | None = None


@dataclass
class KeyUse:
    """What one key holds now."""

    connections: int = 0
    inflight: int = 0
    queued: int = 0
    held: int = 0  # refusals being held (Shares.hold_refusal)
    weight: int = 1  # its key's weight at the fair gate
    running: int = 0  # pipeline requests past the fair gate (Shares.running)
    ended_at: float = float("-inf")  # when its last running request ended (monotonic)
    # its requests waiting at the gate, oldest first: (arrival number, the turn's future)
    waiting: deque[tuple[int, asyncio.Future[None]]] = field(default_factory=deque)


@dataclass
class Shares:
    """The server's clients and what each holds (all on the event loop)."""

    keys: Sequence[ApiKey]
    per_address: int | None
    metrics: ServerMetrics
    max_running: int | None = None  # --max-running-requests (None: no gate)
    unkeyed: Tally[str] = field(default_factory=Tally)  # connections by address
    use: dict[str, KeyUse] = field(init=False)
    running_total: int = 0
    arrivals: int = 0  # requests that waited at the gate (their order)

    def __post_init__(self) -> None:
        self.use = {k.name: KeyUse(weight=k.weight) for k in self.keys}
        for k in self.keys:
            self.metrics.key_requests.labels(k.name)

    def connect(self, address: str) -> ConnectionShare | None:
        """A new connection from ``address``; None: over the address's cap (counted)."""
        if self.per_address is not None and self.unkeyed[address] >= self.per_address:
            self.metrics.refusals.labels("", "address_connections").inc()
            return None
        self.unkeyed[address] += 1
        return ConnectionShare(address)

    def claim(self, conn: ConnectionShare, key: ApiKey) -> bool:
        """Count ``conn`` against ``key`` from now on; False: the key holds its
        ``max_connections`` already."""
        if conn.key is key:
            return True
        use = self.use[key.name]
        if key.max_connections is not None and use.connections >= key.max_connections:
            return False
        self.disconnect(conn)
        conn.key = key
        use.connections += 1
        return True

    def disconnect(self, conn: ConnectionShare) -> None:
        """``conn`` counts against nothing any more."""
        if conn.key is not None:
            self.use[conn.key.name].connections -= 1
            conn.key = None
        elif conn.address in self.unkeyed:
            self.unkeyed[conn.address] -= 1
            if self.unkeyed[conn.address] <= 0:
                del self.unkeyed[conn.address]

    def admit(self, key: ApiKey) -> APIError | None:
        """One more HTTP request of ``key`` being answered (:meth:`leave` when it ends);
        the 429 instead where it has its ``max_inflight`` already."""
        use = self.use[key.name]
        if key.max_inflight is not None and use.inflight >= key.max_inflight:
            return over_share(
                f"key {key.name!r} has {use.inflight} requests in flight, its max_inflight",
                key.name,
                "inflight",
                self.metrics,
            )
        use.inflight += 1
        return None

    def leave(self, key: ApiKey) -> None:
        """A request :meth:`admit` let in has ended."""
        self.use[key.name].inflight -= 1

    async def hold_refusal(self, key: ApiKey) -> None:
        """Wait ``key``'s ``refusal_delay_s`` before one of its 429s is sent (counted in
        ``held`` while it waits)."""
        if key.refusal_delay_s <= 0:
            return
        use = self.use[key.name]
        use.held += 1
        try:
            await asyncio.sleep(key.refusal_delay_s)
        finally:
            use.held -= 1

    def queue_refusal(self, key: ApiKey) -> APIError | None:
        """The 429 of one more pipeline request of ``key`` over its ``max_queued``."""
        use = self.use[key.name]
        if key.max_queued is not None and use.queued >= key.max_queued:
            return over_share(
                f"key {key.name!r} has {use.queued} pipeline requests open, its max_queued",
                key.name,
                "queued",
                self.metrics,
            )
        return None

    @contextlib.contextmanager
    def queued(self, key: ApiKey | None) -> Iterator[None]:
        """One pipeline request of ``key`` open; a 429 over its ``max_queued`` (at once:
        :class:`SharedPipeline` holds it first)."""
        if key is None:
            yield
            return
        err = self.queue_refusal(key)
        if err is not None:
            raise err
        use = self.use[key.name]
        use.queued += 1
        try:
            yield
        finally:
            use.queued -= 1

    @contextlib.asynccontextmanager
    async def running(
        self, key: ApiKey | None, timeout_s: float | None = None
    ) -> AsyncIterator[None]:
        """One pipeline request of ``key`` running, past the fair gate (see the module):
        at once where :meth:`_may_run`, else once it is its turn; a 504 when its turn has
        not come within ``timeout_s`` (the request's own timeout)."""
        if key is None or self.max_running is None:
            yield
            return
        use = self.use[key.name]
        if self._may_run(use):
            use.running += 1
            self.running_total += 1
        else:
            loop = asyncio.get_running_loop()
            turn: asyncio.Future[None] = loop.create_future()
            self.arrivals += 1
            use.waiting.append((self.arrivals, turn))
            # what holds it back may be another key's anticipated share: look again once
            # that has lapsed, whatever else happens meanwhile
            loop.call_later(ANTICIPATE_S, self._dispatch)
            try:
                # (its slot is counted for it when its turn comes)
                await asyncio.wait_for(turn, timeout_s)
            except BaseException as e:
                if turn.done() and not turn.cancelled():  # its turn came as it ended
                    self._end(use)
                else:
                    use.waiting = deque(w for w in use.waiting if w[1] is not turn)
                    self._dispatch()  # (a key less active: another's share grows)
                if isinstance(e, TimeoutError):
                    raise APIError(
                        504,
                        f"the request timed out after {timeout_s} s waiting for its turn "
                        f"among the server's --max-running-requests {self.max_running}",
                        type="timeout",
                        code="timeout",
                    ) from None
                raise
        try:
            yield
        finally:
            self._end(use)

    def _may_run(self, use: KeyUse) -> bool:
        """A request of ``use``'s key may run now: a place is free, and its key runs fewer
        than its fair share (``max_running`` times its weight over the weights of the keys
        that are active, itself included, rounded up) or no other key is active."""
        assert self.max_running is not None
        if self.running_total >= self.max_running:
            return False
        active = [u for u in self.use.values() if u is use or self._active(u)]
        if len(active) == 1:
            return True
        weights = sum(u.weight for u in active)
        return use.running < -(-self.max_running * use.weight // weights)

    def _active(self, use: KeyUse) -> bool:
        """``use``'s key runs or waits, or ended a request within :data:`ANTICIPATE_S`
        (its client is likely about to send the next)."""
        if use.running or use.waiting:
            return True
        return time.monotonic() - use.ended_at < ANTICIPATE_S

    def _end(self, use: KeyUse) -> None:
        """A running request of ``use``'s key ended: the next waiting one gets its turn."""
        use.running -= 1
        self.running_total -= 1
        if not use.running:
            use.ended_at = time.monotonic()
            if any(u.waiting for u in self.use.values()):  # its share held a moment: then
                asyncio.get_running_loop().call_later(ANTICIPATE_S, self._dispatch)
        self._dispatch()

    def _dispatch(self) -> None:
        """Turns to waiting requests while one may run: of the keys that may, the one
        running fewest for its weight first, then the oldest request."""
        while True:
            ready = [u for u in self.use.values() if u.waiting and self._may_run(u)]
            if not ready:
                return
            nxt = min(ready, key=lambda u: (u.running / u.weight, u.waiting[0][0]))
            _, turn = nxt.waiting.popleft()
            if turn.done():  # cancelled while it waited
                continue
            nxt.running += 1
            self.running_total += 1
            turn.set_result(None)

    def usage(self) -> dict[str, tuple[int, int, int, int, int, int]]:
        """Per key name: (connections, requests in flight, pipeline requests open, refusals
        held, pipeline requests running, pipeline requests waiting their turn)."""
        return {
            n: (u.connections, u.inflight, u.queued, u.held, u.running, len(u.waiting))
            for n, u in self.use.items()
        }


class SharedPipeline:
    """The pipeline as the routes see it on a server with keys: each ``astream`` (one
    pipeline request) is counted against the key of the request being answered, and
    refused (a 429) over its ``max_queued``; everything else is the pipeline's."""

    def __init__(self, pipe: Any, shares: Shares) -> None:
        self._pipe = pipe
        self._shares = shares

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    async def astream(
        self, request: dict[str, Any], request_id: str | None = None, timeout_s: float | None = None
    ) -> AsyncIterator[Any]:
        key = CLIENT.get()
        if key is not None:
            err = self._shares.queue_refusal(key)
            if err is not None:
                await self._shares.hold_refusal(key)
                raise err
        with self._shares.queued(key):
            t0 = time.monotonic()
            async with self._shares.running(key, timeout_s):
                if timeout_s is not None:  # the wait for a turn counts against it
                    timeout_s = max(0.001, timeout_s - (time.monotonic() - t0))
                async for ev in self._pipe.astream(request, request_id, timeout_s):
                    yield ev


class ClientShares:
    """Pure ASGI middleware, inside the request id's: identifies a request's key (kept in
    the scope's ``state["api_key"]`` for :mod:`omni_serve.auth` and in :data:`CLIENT`),
    counts its connection and the request against the key's share and answers 429 over
    it. A request without a valid key passes on (the routes answer it 401)."""

    def __init__(self, app: ASGIApp, shares: Shares) -> None:
        self.app = app
        self.shares = shares

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.shares.keys:
            await self.app(scope, receive, send)
            return
        authorization = Headers(scope=scope).get("authorization", "")
        key = identify(self.shares.keys, authorization)
        state = scope.setdefault("state", {})
        state["api_key"] = key
        if key is None:
            await self.app(scope, receive, send)
            return
        self.shares.metrics.key_requests.labels(key.name).inc()
        conn = scope.get(CONNECTION)
        if conn is not None and not self.shares.claim(conn, key):
            err = over_share(
                f"key {key.name!r} has {key.max_connections} connections open, its max_connections",
                key.name,
                "connections",
                self.shares.metrics,
            )
            await self.refuse(err, scope, receive, send, key, close=True)
            return
        if scope.get("path") != HEALTH:
            err = self.shares.admit(key)
            if err is not None:
                await self.refuse(err, scope, receive, send, key)
                return
        token = CLIENT.set(key)
        try:
            await self.app(scope, receive, send)
        finally:
            CLIENT.reset(token)
            if scope.get("path") != HEALTH:
                self.shares.leave(key)

    async def refuse(
        self,
        err: APIError,
        scope: Scope,
        receive: Receive,
        send: Send,
        key: ApiKey,
        close: bool = False,
    ) -> None:
        await self.shares.hold_refusal(key)
        rid = str(scope.get("state", {}).get("request_id", ""))
        log.info(
            "refused a request of key %r: %s", key.name, err.message, extra={"request_id": rid}
        )
        headers = {**err.headers, **({"Connection": "close"} if close else {})}
        response = JSONResponse(err.body(rid), status_code=err.status, headers=headers)
        await response(scope, receive, send)


def address_refusal(address: str, cap: int) -> bytes:
    """The raw answer to a connection over ``--max-connections-per-address`` (sent before
    any request arrives, then the connection is closed)."""
    body = json.dumps(
        {
            "error": {
                "message": f"{cap} connections from {address} are open without a known key, "
                f"the server's --max-connections-per-address; retry in {RETRY_AFTER_S} s",
                "type": "rate_limit_error",
                "param": None,
                "code": "rate_limit_exceeded",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        f"retry-after: {RETRY_AFTER_S}\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body
