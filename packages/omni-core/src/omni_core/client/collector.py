"""The caller's side of a request: what arrives from the stages, turned into one stream.

Both backends (worker processes and in-process) hand every event that reaches the caller
to a :class:`Collector`. It checks per-stage order, resolves arrays (copied out of shared
memory so the slot can go back at once), renumbers events strictly per request, and ends
the request with exactly one terminal event: completed when every sink and streaming
stage completed, else the first error, cancel or timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from omni_core.client.delivery import DONE, Inbox
from omni_core.dataplane.serial import ArrayCodec
from omni_core.events import (
    AnyEvent,
    Cancelled,
    Completed,
    Error,
    Event,
    ImageProgress,
    Segment,
    ShmHandle,
    TraceMark,
    is_droppable,
)


@dataclass
class RequestOutput:
    """A finished request, as ``Pipeline.generate`` returns it."""

    request_id: str
    """The request's id."""
    finish_reason: str  # "completed" | "error" | "cancelled" | "timeout"
    """``completed``, ``error``, ``cancelled`` or ``timeout``."""
    events: list[AnyEvent]  # every non-terminal event, in order
    """Every non-terminal event, in order."""
    error: str | None = None
    """The error's message, when the request failed."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The request's latencies."""

    @property
    def ok(self) -> bool:
        """The request completed."""
        return self.finish_reason == "completed"

    @property
    def tokens(self) -> list[int]:
        """The tokens of every segment, in order."""
        return [t for e in self.events if isinstance(e, Segment) and e.tokens for t in e.tokens]

    @property
    def final(self) -> AnyEvent | None:
        """The last non-terminal event (for an image request, the final image)."""
        return self.events[-1] if self.events else None

    def by_stage(self, stage: str) -> list[AnyEvent]:
        """The events ``stage`` emitted."""
        return [e for e in self.events if e.stage == stage]


class RequestHandle:
    """One request in flight; its events can be read synchronously or with asyncio."""

    def __init__(self, request_id: str, sinks: set[str], loop: asyncio.AbstractEventLoop | None):
        self.request_id = request_id
        self.wire_id = request_id  # the id the stages know this attempt by
        self.attempt = 0
        self.request: dict[str, Any] = {}
        self.deadline_wall: float | None = None
        self.delivered: dict[str, int] = {}  # per stage: must-deliver events the caller has
        self.edges_done: set[tuple[str, str]] = set()  # (upstream, downstream) streams received
        self.last_event = 0.0
        self.sinks_left = set(sinks)
        self.stages_done: set[str] = set()
        # replicated stage -> the replica this attempt is bound to; those still counted
        # as outstanding there (until the stage completes the request, or it ends)
        self.routes: dict[str, int] | None = None
        self.bound: set[str] = set()
        self.next_seq: dict[str, int] = {}
        self.done = False
        self.finish_reason = ""
        self.submitted = time.monotonic()
        self.first_event: float | None = None
        self.finished: float | None = None
        self.deadline: float | None = None
        self._inbox = Inbox(loop)

    @property
    def sequence(self) -> int:
        """The caller's sequence number of the next event."""
        return self._inbox.sequence

    @property
    def waiting(self) -> int:
        """Events delivered to this request that its reader has not taken yet."""
        return len(self._inbox)

    def _put(self, item: Any) -> bool:
        """Hand ``item`` to the reader; False when the reader's event loop is closed (the
        caller is gone: the request is cancelled)."""
        return self._inbox.put(item)

    def __iter__(self) -> Iterator[AnyEvent]:
        return iter(self._inbox)

    def __aiter__(self) -> AsyncIterator[AnyEvent]:
        return self._inbox.__aiter__()


class Collector:
    """Tracks every open request of one pipeline; thread-safe only through its caller.

    A request is known to the stages by its *wire id*: the caller's id, or a fresh one
    per replay after a crash, so the stages never mix two attempts of one request.
    """

    MAX_REPLAYS = 2

    def __init__(
        self,
        sinks: list[str],
        streaming: list[str],
        codec: ArrayCodec,
        previews: list[str] = (),  # type: ignore[assignment]
    ) -> None:
        self.sinks = set(sinks)
        self.streaming = set(streaming)  # stages whose every event comes to the caller
        self.previews = set(previews)  # stages whose previews (only) come to the caller
        # a request ends once each of these completed: a streaming stage's events take
        # their own path to the caller and may arrive after a sink's
        self.awaited = self.sinks | self.streaming
        self.codec = codec
        self.handles: dict[str, RequestHandle] = {}  # by the caller's request id
        self.wire: dict[str, RequestHandle] = {}  # by wire id
        self.counts = {"completed": 0, "error": 0, "cancelled": 0, "timeout": 0, "replayed": 0}
        self.metrics = RequestMetrics()
        self.trace: list[TraceMark] | None = None  # set to a list to record arrivals
        self.orphans: list[str] = []  # wire ids of requests whose reader's loop closed
        # (stage, replica) -> requests bound to it and not past it: the replica's load
        self.outstanding: dict[tuple[str, int], int] = {}

    def open(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        if request_id in self.handles:
            raise ValueError(f"request id {request_id!r} is already in flight")
        h = self.handles[request_id] = self.wire[request_id] = RequestHandle(
            request_id, self.awaited, loop
        )
        return h

    def bind(self, h: RequestHandle, routes: dict[str, int] | None) -> None:
        """Bind ``h`` (this attempt) to ``routes``' replicas; each counts it as outstanding
        until its stage completes the request or the request ends."""
        self.unbind(h)
        h.routes = routes
        if routes and not h.done:
            h.bound = set(routes)
            for key in routes.items():
                self.outstanding[key] = self.outstanding.get(key, 0) + 1

    def unbind(self, h: RequestHandle, stage: str | None = None) -> None:
        """``h`` is past ``stage`` (every stage when None): no longer outstanding there."""
        if not h.bound:
            return
        for s in [stage] if stage is not None else list(h.bound):
            if s in h.bound:
                h.bound.discard(s)
                key = (s, h.routes[s])  # type: ignore[index]
                self.outstanding[key] -= 1

    def replay(self, h: RequestHandle) -> str | None:
        """Start a new attempt of ``h`` (its stage crashed); the new wire id, or None when
        it was replayed too often. Events the caller already has are not sent again."""
        if h.attempt >= self.MAX_REPLAYS:
            return None
        self.wire.pop(h.wire_id, None)
        h.attempt += 1
        h.wire_id = f"{h.request_id}~{h.attempt}"
        h.next_seq.clear()
        h.stages_done.clear()
        h.edges_done.clear()
        h.sinks_left = set(self.awaited)
        self.wire[h.wire_id] = h
        self.counts["replayed"] += 1
        return h.wire_id

    def on_event(self, ev: AnyEvent) -> tuple[list[ShmHandle], bool]:
        """Take one event from a stage; returns (slots to release, request just failed)."""
        h = self.wire.get(ev.request_id)
        if h is None or h.done:  # late event of a finished request: just free its slots
            return [x for x in ev.device_handles.values() if isinstance(x, ShmHandle)], False
        try:
            arrays, shm = (
                self.codec.unpack(ev.device_handles, copy=True) if ev.device_handles else ({}, [])
            )
        except Exception as e:  # e.g. the producer's segment is gone: this request fails
            shm = [x for x in ev.device_handles.values() if isinstance(x, ShmHandle)]
            err = Error(request_id=h.request_id, stage=ev.stage, message=f"stage {ev.stage!r}: {e}")
            self.finish(h, err)
            return shm, True
        expected = h.next_seq.get(ev.stage, 0)
        if ev.stage in self.streaming and ev.sequence != expected and not isinstance(ev, Error):
            self.finish(
                h,
                Error(
                    request_id=h.request_id,
                    stage=ev.stage,
                    message=f"stage {ev.stage!r}: event sequence {ev.sequence} where "
                    f"{expected} was expected "
                    + ("(lost event)" if ev.sequence > expected else "(repeated event)"),
                    code="sequence_gap",
                ),
            )
            return shm, True
        droppable = is_droppable(ev) or (
            ev.stage in self.previews and type(ev) is ImageProgress and not ev.is_last
        )
        if not droppable:
            h.next_seq[ev.stage] = expected + 1
        if isinstance(ev, (Segment, ImageProgress)):
            seen = h.delivered.get(ev.stage, 0)
            if ev.sequence < seen:  # a replay re-made what the caller already has
                return shm, False
            if not droppable:
                h.delivered[ev.stage] = ev.sequence + 1
            ev.arrays = arrays
            self.deliver(h, ev)
        elif isinstance(ev, Completed):
            h.stages_done.add(ev.stage)
            self.unbind(h, ev.stage)
            h.sinks_left.discard(ev.stage)
            if not h.sinks_left:
                self.finish(h, Completed(request_id=h.request_id, stage=ev.stage))
        elif isinstance(ev, Error):
            self.finish(h, ev)
            return shm, True
        return shm, False

    def deliver(self, h: RequestHandle, ev: Event) -> None:
        """Hand ``ev`` (arrays unpacked) to the caller of ``h``."""
        now = time.monotonic()
        if h.first_event is None:
            h.first_event = now
            self.metrics.first_event_s.add(now - h.submitted)
        elif not ev.terminal:
            self.metrics.between_events_s.add(now - h.last_event)
        h.last_event = now
        if self.trace is not None:
            self.trace.append(TraceMark(h.request_id, h.sequence, ev.event_type, time.time()))
        ev.request_id = h.request_id
        if not hasattr(ev, "arrays"):
            ev.arrays = {}
        if not h._put(ev) and not h.done:  # nobody can read it: cancel it everywhere
            self.orphans.append(h.wire_id)
            self.finish(h, Cancelled(request_id=h.request_id, reason="cancelled"))

    def finish(self, h: RequestHandle, terminal: Completed | Error | Cancelled) -> None:
        """End a request with its one terminal event (no-op if it already ended)."""
        if h.done:
            return
        h.done = True
        h.finished = time.monotonic()
        if isinstance(terminal, Completed):
            h.finish_reason = "completed"
            self.metrics.latency_s.add(h.finished - h.submitted)
        elif isinstance(terminal, Cancelled):
            h.finish_reason = terminal.reason
        else:
            h.finish_reason = "error"
        self.counts[h.finish_reason] += 1
        self.unbind(h)
        self.deliver(h, terminal)
        h._put(DONE)
        self.handles.pop(h.request_id, None)
        self.wire.pop(h.wire_id, None)

    def forget(self, h: RequestHandle) -> None:
        """Drop a request that was never sent: it ends with no event and counts nowhere."""
        self.unbind(h)
        self.handles.pop(h.request_id, None)
        self.wire.pop(h.wire_id, None)

    def take_orphans(self) -> list[str]:
        orphans, self.orphans = self.orphans, []
        return orphans

    def fail_all(self, message: str, code: str = "pipeline_closed", stage: str = "") -> None:
        for h in list(self.handles.values()):
            self.finish(h, Error(request_id=h.request_id, stage=stage, message=message, code=code))


class Summary:
    """Count, mean and percentiles of the last ``keep`` samples of one quantity."""

    def __init__(self, keep: int = 4096) -> None:
        self.samples: deque[float] = deque(maxlen=keep)
        self.count = 0
        self.total = 0.0

    def add(self, x: float) -> None:
        self.samples.append(x)
        self.count += 1
        self.total += x

    def report(self) -> dict[str, float]:
        if not self.count:
            return {"count": 0}
        xs = sorted(self.samples)
        pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
        return {
            "count": self.count,
            "mean": self.total / self.count,
            "p50": pick(0.5),
            "p95": pick(0.95),
            "max": xs[-1],
        }


@dataclass
class RequestMetrics:
    first_event_s: Summary = field(default_factory=Summary)  # time to first event (TTFT)
    between_events_s: Summary = field(default_factory=Summary)  # time between events
    latency_s: Summary = field(default_factory=Summary)  # completion latency

    def report(self) -> dict[str, dict[str, float]]:
        return {
            "time_to_first_event_s": self.first_event_s.report(),
            "time_between_events_s": self.between_events_s.report(),
            "completion_latency_s": self.latency_s.report(),
        }


def collect(handle: RequestHandle) -> RequestOutput:
    """Read a handle to its end into a :class:`RequestOutput`."""
    events: list[AnyEvent] = []
    error = None
    for ev in handle:
        if ev.terminal:
            if isinstance(ev, Error):
                error = ev.message
            break
        events.append(ev)
    return RequestOutput(
        handle.request_id, handle.finish_reason, events, error, request_metrics(handle)
    )


def request_metrics(h: RequestHandle) -> dict[str, float]:
    m: dict[str, float] = {}
    if h.first_event is not None:
        m["time_to_first_event_s"] = h.first_event - h.submitted
    if h.finished is not None:
        m["latency_s"] = h.finished - h.submitted
    return m
