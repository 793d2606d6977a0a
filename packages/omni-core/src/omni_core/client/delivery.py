"""A request's inbox: the events that reached the caller and wait to be read.

The control loop puts, the caller reads (a thread, or a coroutine on its event loop). A
caller that reads slower than the stages produce must not grow memory with every event:
past ``coalesce_after`` waiting events the inbox merges instead of queueing, as vLLM's
output collector does for a lagging stream:

* a preview replaces the waiting preview of the same stage (newest kept, as between
  stages under backpressure);
* an array-free segment is merged into the waiting segment of the same stage before it:
  tokens and logprobs appended, text payload values concatenated, other payload values
  the newer one's. A slow reader gets fewer, larger deltas; the text is the same.

So what waits is bounded by the request's own output (its ``max_tokens``), not by how
many events carried it, and the caller's sequence numbers stay dense.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

from omni_core.events import ImageProgress, Segment

DONE = object()  # the end of the stream (after the terminal event)
COALESCE_AFTER = 64


def _merge_payload(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    out = dict(old)
    for k, v in new.items():
        prev = out.get(k)
        if (
            isinstance(v, str)
            and isinstance(prev, str)
            or isinstance(v, list)
            and isinstance(prev, list)
        ):
            out[k] = prev + v
        else:
            out[k] = v
    return out


def _mergeable(old: Any, new: Any) -> bool:
    return (
        type(old) is Segment
        and type(new) is Segment
        and old.stage == new.stage
        and not old.is_last
        and not old.__dict__.get("arrays")
        and not new.__dict__.get("arrays")
        and (old.logprobs is None) == (new.logprobs is None)
    )


class Inbox:
    def __init__(
        self, loop: asyncio.AbstractEventLoop | None, coalesce_after: int = COALESCE_AFTER
    ) -> None:
        self.loop = loop
        self.coalesce_after = coalesce_after
        self.items: deque[Any] = deque()
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.event = asyncio.Event() if loop is not None else None
        self.waiting = False  # an async reader awaits ``event``
        self.sequence = 0  # the next event's number for the caller
        self.merged = 0  # events coalesced into one waiting before them

    def put(self, item: Any) -> bool:
        """Hand ``item`` (an event, numbered here, or :data:`DONE`) to the reader; False
        when the reader's event loop is closed: nobody will ever read it."""
        with self.lock:
            if item is DONE or not self._coalesce(item):
                if item is not DONE:
                    item.sequence = self.sequence
                    self.sequence += 1
                self.items.append(item)
            if self.loop is None:
                self.ready.notify()
                return True
            wake = self.waiting
            self.waiting = False
        if wake:
            try:
                self.loop.call_soon_threadsafe(self.event.set)  # type: ignore[union-attr]
            except RuntimeError:  # "Event loop is closed"
                return False
        return not self.loop.is_closed()

    def _coalesce(self, item: Any) -> bool:
        """(Lock held.) Fold ``item`` into what waits, if the reader lags; True if done."""
        items = self.items
        if len(items) < self.coalesce_after:
            return False
        if type(item) is ImageProgress and not item.is_last:
            for i in range(len(items) - 1, -1, -1):
                old = items[i]
                if type(old) is ImageProgress and old.stage == item.stage and not old.is_last:
                    item.sequence = old.sequence
                    items[i] = item
                    self.merged += 1
                    return True
            return False
        last = items[-1]
        if not _mergeable(last, item):
            return False
        last.tokens = (last.tokens or []) + (item.tokens or [])
        if item.logprobs is not None:
            last.logprobs = last.logprobs + item.logprobs
        last.payload = _merge_payload(last.payload, item.payload)
        last.is_last = item.is_last
        self.merged += 1
        return True

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        assert self.loop is None, "use 'async for' on an async handle"
        while True:
            with self.ready:
                while not self.items:
                    self.ready.wait()
                item = self.items.popleft()
            if item is DONE:
                return
            yield item

    async def __aiter__(self) -> AsyncIterator[Any]:
        assert self.event is not None, "iterate a handle made without a loop synchronously"
        while True:
            with self.lock:
                item = self.items.popleft() if self.items else None
                if item is None:
                    self.waiting = True
                    self.event.clear()
            if item is None:
                await self.event.wait()
                continue
            if item is DONE:
                return
            yield item
