"""The bounded work queue between a worker's I/O thread and its stage thread.

Upstream messages become work items (through the stage host: windows, fan-in pairing)
only while fewer than ``queue_capacity`` items wait; the rest of a frame stays decoded in
``stash`` and the I/O thread stops reading its data socket, so a slow stage pushes back
on its producers through the sockets. A message that makes more items than there is
room for (the window a stream's end flushes, a fan-in pairing) leaves the extra items at
the head of the stash, so the queue never holds more than ``queue_capacity``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from omni_core.errors import UserInputError
from omni_core.events import Ack, Completed, SegmentRun, ShmHandle, Submit
from omni_core.scheduling import request_priority
from omni_core.worker.host import CLIENT, RequestFailed, WorkItem

if TYPE_CHECKING:
    from collections.abc import Callable

    import msgspec

    from omni_core.dataplane.transport import Waker
    from omni_core.worker.state import WorkerState


class WorkQueue:
    """The ready work items (in arrival order, at most ``capacity``; ``state.lock``
    guards them; taken by arrival, or by priority with ``by_priority``) and
    the upstream messages the I/O thread decoded but has not taken in yet, with the items
    made past the capacity ahead of them (``stash``, the I/O thread's)."""

    def __init__(
        self,
        state: WorkerState,
        capacity: int,
        waker: Waker,
        stage_name: str,
        send_status: Callable[[msgspec.Struct], None],
        by_priority: bool = False,
    ) -> None:
        self.state = state
        self.host = state.host
        self.capacity = capacity
        self.waker = waker  # wakes the I/O thread to take in again
        self.stage_name = stage_name  # the stage an edge_end Ack names
        self.send_status = send_status  # (I/O thread) to the orchestrator
        self.ready: deque[WorkItem] = deque()
        self.stash: deque[Any] = deque()  # decoded messages (and WorkItems) not yet taken in
        self.idle_stage = False  # the stage thread waits for work (only then notify)
        self.by_priority = by_priority  # scheduler_policy: priority (else first come first)

    def has_room(self) -> bool:
        with self.state.lock:
            return len(self.ready) < self.capacity and not self.state.stopping

    def intake(self) -> None:
        """(I/O thread.) Turn stashed messages into work items while there is room."""
        w, host, stash = self.state, self.host, self.stash
        now = time.monotonic()  # one clock read per intake: the items' queue entry
        with w.work:
            while stash and len(self.ready) < self.capacity:
                msg = stash.popleft()
                if type(msg) is WorkItem:  # made past the capacity earlier: its turn now
                    self.ready.append(msg)
                    continue
                try:
                    if type(msg) is SegmentRun:
                        items, n = host.receive_run(msg, self.capacity - len(self.ready))
                        if n < len(msg):  # the queue is full: the rest waits
                            stash.appendleft(msg.tail(n))
                        w.stats.received += n
                    elif isinstance(msg, Submit):
                        items = host.submit(msg)
                        w.stats.received += 1
                    else:
                        items = host.receive(msg)
                        w.stats.received += 1
                        if type(msg) is Completed:
                            ack = Ack(
                                stage=self.stage_name,
                                kind="edge_end",
                                request_id=msg.request_id,
                                source=msg.stage,
                            )
                            self.send_status(ack)
                except Exception as e:  # ends this request only; the I/O thread goes on
                    plain = isinstance(e, RequestFailed | UserInputError)
                    why = str(e) if plain else f"{type(e).__name__}: {e}"
                    code = e.code if isinstance(e, UserInputError) else "stage_error"
                    own = getattr(msg, "device_handles", {}).values()
                    host.releasable.extend(h for h in own if isinstance(h, ShmHandle))
                    self.fail(msg.request_id, why, code)
                    continue
                for item in items:
                    item.queued_at = now
                room = self.capacity - len(self.ready)
                if len(items) > room:  # the rest waits at the head of the stash
                    stash.extendleft(reversed(items[room:]))
                    items = items[:room]
                self.ready.extend(items)
            if self.ready and self.idle_stage:
                w.work.notify()
            freed = w.take_releasable()
        w.release(freed)

    def fail(self, rid: str, why: str, code: str = "stage_error") -> None:
        """(I/O thread, lock held.) End ``rid`` here: the caller gets an error (and then
        cancels the request everywhere)."""
        host = self.host
        host.releasable.extend(host.forget(rid))
        self.state.outbox.put(CLIENT, host.error(rid, why, code), block=False)

    def drop(self, rid: str) -> list[ShmHandle]:
        """(I/O thread, lock held.) Forget a cancelled request: its queued items go (also
        those waiting in the stash); the slots freed."""
        freed = self.host.forget(rid)
        self.ready = self._without(self.ready, rid, freed)
        stash = self.stash
        if any(type(m) is WorkItem for m in stash):  # in place: the I/O thread holds it
            kept = self._without(stash, rid, freed)
            stash.clear()
            stash.extend(kept)
        if self.idle_stage:  # the stage thread calls end_request
            self.state.work.notify()
        return freed

    @staticmethod
    def _without(queue: deque[Any], rid: str, freed: list[ShmHandle]) -> deque[Any]:
        """``queue`` without ``rid``'s work items, whose slots go to ``freed``."""
        kept: deque[Any] = deque()
        for entry in queue:
            if type(entry) is WorkItem and entry.inp.request_id == rid:
                freed.extend(entry.release)
            else:
                kept.append(entry)
        return kept

    def best_waiting(self, busy: set[str]) -> int | None:
        """(Stage thread, lock held; ``by_priority``.) The best priority among the ready
        items that could start now (None: none)."""
        return min(
            (
                _priority(item)
                for item in self.ready
                if item.inp.request_id not in busy and not item.inp.cancelled
            ),
            default=None,
        )

    def take_batch(
        self, busy: set[str], max_batch: int, better_than: int | None = None
    ) -> list[WorkItem]:
        """(Stage thread, lock held.) The first ready item whose request is not running,
        then up to ``max_batch`` - 1 more: in order of arrival, or with ``by_priority``
        of (request priority, arrival), and then only items whose priority is below
        ``better_than`` when it is given."""
        if self.by_priority and (len(self.ready) > 1 or better_than is not None):
            batch = self._take_by_priority(busy, max_batch, better_than)
        else:
            batch = self._take_in_order(busy, max_batch)
        if batch:
            stats, now = self.state.stats, time.monotonic()
            stats.dequeued += len(batch)
            for item in batch:
                waited = now - item.queued_at
                stats.queued_s += waited
                if waited > stats.queued_max_s:
                    stats.queued_max_s = waited
        if batch and (self.stash or len(self.ready) + len(batch) >= self.capacity):
            # the I/O thread stopped taking in while the queue was full: room again now
            self.waker.kick()
        return batch

    def _take_in_order(self, busy: set[str], max_batch: int) -> list[WorkItem]:
        batch: list[WorkItem] = []
        rids: set[str] = set()
        skipped: deque[WorkItem] = deque()
        ready = self.ready
        while ready and len(batch) < max_batch:
            item = ready.popleft()
            rid = item.inp.request_id
            if item.inp.cancelled:
                self.host.releasable.extend(item.release)
                continue
            if rid in busy or rid in rids:  # keep a request's triggers in order
                skipped.append(item)
                continue
            batch.append(item)
            rids.add(rid)
        ready.extendleft(reversed(skipped))
        return batch

    def _take_by_priority(
        self, busy: set[str], max_batch: int, better_than: int | None
    ) -> list[WorkItem]:
        # sorted() is stable: equal priorities keep their order of arrival, and a
        # request's items (one priority) stay in order
        batch: list[WorkItem] = []
        rids: set[str] = set()
        gone: set[int] = set()  # ids of the items taken or dropped
        for item in sorted(self.ready, key=_priority):
            if len(batch) == max_batch:
                break
            if better_than is not None and _priority(item) >= better_than:
                break
            rid = item.inp.request_id
            if item.inp.cancelled:
                self.host.releasable.extend(item.release)
                gone.add(id(item))
            elif rid not in busy and rid not in rids:
                batch.append(item)
                rids.add(rid)
                gone.add(id(item))
            else:  # its request runs, or an earlier item of it goes first: none may pass
                rids.add(rid)
        if gone:
            self.ready = deque(item for item in self.ready if id(item) not in gone)
        return batch


def _priority(item: WorkItem) -> int:
    return request_priority(item.inp.request)
