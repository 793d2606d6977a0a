"""Fair shares of the server's heavy body work: parsing and checking big bodies, reading
chat images' headers. That work holds the GIL (every other request's threads wait for it),
so each client (its API key's name, else its address) may spend at most :data:`SHARE` of
the last :data:`WINDOW_S` in it, both slots together (:class:`WorkShares`). A client past
its share waits, just long enough to be back under it, before it queues for a slot and,
earlier, before its next big body is read at all (:func:`body_turn`): its bytes wait in
the kernel, TCP holds its sender back, and the connection's body deadline waits too
(:mod:`omni_serve.connections`). One client's big bodies then
take at most that share of the server however fast it sends them; a client that sends a
few big bodies never waits for its own past; small bodies (parsed on the event loop) are
never counted nor held."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request

from omni_serve.shares import CLIENT

SHARE = 0.05  # of the window's time, one client's heavy body work may take
WINDOW_S = 2.0  # over this last stretch
# how long a thread holding the GIL runs on while another waits for it (``omni serve``
# sets it; Python's default is 5 ms): each time the event loop wakes while a body is
# parsed or a header read in a worker thread it waits that long, several times a request
GIL_SWITCH_S = 0.0005
# a request scope's callable (omni_serve.connections): told True while the server holds
# its body unread, False when it reads it
BODY_HELD = "omni.body_held"


def client_name(request: Request) -> str:
    """Who a request is, for fair shares: its API key's name, else its address."""
    key = CLIENT.get()
    if key is not None:
        return f"key:{key.name}"
    return f"address:{request.client.host if request.client else '?'}"


class WorkShares:
    """The seconds of heavy work each client had in the last ``window_s``; one past
    ``share`` of it waits its :meth:`turn`. Used on the event loop only (``clock`` and
    ``sleep``: the time it reads and waits by)."""

    def __init__(
        self,
        share: float = SHARE,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.share = share
        self.window_s = window_s
        self.clock = clock
        self.sleep = sleep
        self.held: dict[str, deque[tuple[float, float]]] = {}  # client -> (end, seconds)
        self.sweep_at = 64  # clients held: past it, those with nothing in the window go

    def used(self, client: str, now: float) -> float:
        """The seconds of ``client``'s work that ended in the window before ``now``."""
        spans = self.held.get(client)
        if not spans:
            return 0.0
        while spans and spans[0][0] <= now - self.window_s:
            spans.popleft()
        if not spans:
            del self.held[client]
            return 0.0
        return sum(s for _, s in spans)

    def wait_s(self, client: str) -> float:
        """How long until the window has forgotten enough of ``client``'s work for it to
        be within its share (0: it is now)."""
        now = self.clock()
        over = self.used(client, now) - self.share * self.window_s
        wait = 0.0
        for end, seconds in self.held.get(client, ()):  # the oldest first
            if over <= 0:
                break
            over -= seconds
            wait = end + self.window_s - now  # when this span leaves the window
        return wait

    async def turn(self, client: str) -> None:
        """Return once ``client`` is within its share (at once when it is)."""
        while (wait := self.wait_s(client)) > 0:
            await self.sleep(wait)

    def add(self, client: str, seconds: float) -> None:
        """Count ``seconds`` of ``client``'s work, ending now."""
        now = self.clock()
        self.held.setdefault(client, deque()).append((now, seconds))
        if len(self.held) > self.sweep_at:  # many clients came and went
            for name in list(self.held):
                self.used(name, now)
            self.sweep_at = max(64, 2 * len(self.held))


class FairSlot:
    """A slot run one at a time (a body's parse, an image header's read) whose holders'
    time is counted to their client in ``shares``: a client past its share waits its
    turn before it queues."""

    def __init__(self, shares: WorkShares) -> None:
        self.shares = shares
        self.lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def hold(self, client: str) -> AsyncIterator[None]:
        await self.shares.turn(client)
        async with self.lock:
            start = self.shares.clock()
            try:
                yield
            finally:
                self.shares.add(client, self.shares.clock() - start)


async def body_turn(request: Request, shares: WorkShares) -> None:
    """Return once the request's client is within its share, its body unread meanwhile
    (the connection's body deadline held; at once when it is within)."""
    client = client_name(request)
    if shares.wait_s(client) <= 0:
        return
    held = request.scope.get(BODY_HELD)
    if held is not None:
        held(True)
    try:
        await shares.turn(client)
    finally:
        if held is not None:
            held(False)
