"""Fair shares of the server's heavy body work: parsing and checking big bodies, reading
chat images' headers. That work holds the GIL (every other request's threads wait for it),
so each client (its API key's name, else its address) may spend at most :data:`SHARE` of
the server's time in it, both slots together, paced (:class:`WorkShares`, a token bucket
per client): work of ``s`` seconds is paid off in ``s / SHARE`` seconds, and a client may
owe at most :data:`BURST_S` seconds of it before its next piece waits; it waits just long
enough to be back under that, before it queues for a slot and, earlier, before its next
big body is read at all (:func:`body_turn`): its bytes wait in the kernel, TCP holds its
sender back, and the connection's body deadline waits too (:mod:`omni_serve.connections`).
A big body's parse is counted to its client ahead, from the time it passes the gate
until it is read (an estimate by its size; its parse's real time is counted once known),
so a client that sends many at once cannot have them all pass before any is counted.

One client's big bodies then take at most that share of the server however fast it sends
them, spread out (a piece every ``s / SHARE`` seconds) rather than in bursts that stall
every request under way at once; a client that sends a few big bodies never waits for its
own past; small bodies (parsed on the event loop) are never counted nor held."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request

from omni_serve.shares import CLIENT

SHARE = 0.05  # of the server's time, one client's heavy body work may take
BURST_S = 0.03  # seconds of that work a client may owe at once (2-4 parses of 8 MB here)
# a big body's parse, as counted to its client ahead of it (a nominal 0.5 GB/s: msgspec
# parses about twice as fast here on an idle core, half as fast beside the stages' work);
# the time its parse took is counted instead once it is known
PARSE_S_PER_BYTE = 2e-9
WAIT_TOLERANCE_S = 1e-6  # a shorter wait is none
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
    """Each client's heavy work, held to ``share`` of the server's time: the time when
    its work so far is paid off (``s`` seconds of work take ``s / share`` to pay); a
    client owing more than ``burst_s`` seconds of work waits its :meth:`turn`. Used on
    the event loop only (``clock`` and ``sleep``: the time it reads and waits by)."""

    def __init__(
        self,
        share: float = SHARE,
        burst_s: float = BURST_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.share = share
        self.burst_s = burst_s
        self.clock = clock
        self.sleep = sleep
        self.paid_at: dict[str, float] = {}  # client -> when its work so far is paid off
        self.sweep_at = 64  # clients held: past it, those who owe nothing go
        # client -> set (and dropped) when an estimate of its is given back: its requests
        # waiting their turn look again at once; with how many wait on it
        self.gave_back: dict[str, tuple[asyncio.Event, int]] = {}

    def owed_s(self, client: str, now: float) -> float:
        """The seconds of ``client``'s work not yet paid off at ``now``."""
        return max(0.0, self.paid_at.get(client, now) - now) * self.share

    def wait_s(self, client: str) -> float:
        """How long until ``client`` owes no more than ``burst_s`` (0: it does now)."""
        now = self.clock()
        wait = self.paid_at.get(client, now) - now - self.burst_s / self.share
        return wait if wait > WAIT_TOLERANCE_S else 0.0  # (not a float's rounding)

    async def turn(self, client: str) -> None:
        """Return once ``client`` is within its share (at once when it is): it waits out
        what it owes past ``burst_s``, or until an estimate of its is given back
        (:meth:`refund`), then looks again. No polling: a flood of waiting requests costs
        a wake-up each when it may go on, not one every few milliseconds."""
        while (wait := self.wait_s(client)) > 0:
            event, waiters = self.gave_back.get(client, (asyncio.Event(), 0))
            self.gave_back[client] = (event, waiters + 1)
            timer = asyncio.ensure_future(self.sleep(wait))
            woken = asyncio.ensure_future(event.wait())
            try:
                await asyncio.wait((timer, woken), return_when=asyncio.FIRST_COMPLETED)
            finally:
                timer.cancel()
                woken.cancel()
                held = self.gave_back.get(client)
                if held is not None and held[0] is event:
                    if held[1] > 1:
                        self.gave_back[client] = (event, held[1] - 1)
                    else:
                        del self.gave_back[client]

    def add(self, client: str, seconds: float) -> None:
        """Count ``seconds`` of ``client``'s work, ending now."""
        now = self.clock()
        self.paid_at[client] = max(self.paid_at.get(client, now), now) + seconds / self.share
        if len(self.paid_at) > self.sweep_at:  # many clients came and went
            for name, at in list(self.paid_at.items()):
                if at <= now:
                    del self.paid_at[name]
            self.sweep_at = max(64, 2 * len(self.paid_at))

    def refund(self, client: str, seconds: float) -> None:
        """Take back ``seconds`` counted to ``client`` ahead of its work (a reservation),
        down to owing nothing: what it did not use is never credit."""
        at = self.paid_at.get(client)
        if at is not None:
            self.paid_at[client] = max(self.clock(), at - seconds / self.share)
        held = self.gave_back.pop(client, None)
        if held is not None:
            held[0].set()


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


@contextlib.asynccontextmanager
async def body_turn(request: Request, shares: WorkShares, size: int) -> AsyncIterator[None]:
    """Read the request's big body (of ``size`` bytes at most) in the block, once its
    client is within its share: its body unread meanwhile (the connection's body deadline
    held; at once when it is within). The body's parse (:data:`PARSE_S_PER_BYTE`) is
    counted to the client ahead, while the block reads it (its parse's time in the slot
    is counted once known): so the client's other big bodies sent at once pass the gate
    one at a time, each once the share has room for it."""
    client = client_name(request)
    if shares.wait_s(client) > 0:
        held = request.scope.get(BODY_HELD)
        if held is not None:
            held(True)
        try:
            await shares.turn(client)
        finally:
            if held is not None:
                held(False)
    ahead = size * PARSE_S_PER_BYTE
    shares.add(client, ahead)
    try:
        yield
    finally:
        shares.refund(client, ahead)
