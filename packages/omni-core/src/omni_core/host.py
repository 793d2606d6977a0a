"""The transport-free part of running a stage: windows in, events out.

A :class:`StageHost` owns one stage's per-request state: a :class:`WindowState` per inbound
edge, fan-in pairing of windows into :class:`WorkItem` s, per-request output sequence
numbers, and the stamping of a stage's events for each destination.
The worker process and the in-process runner both drive a host; only how events move
differs.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from omni_core.config import PipelineConfig
from omni_core.events import (
    AnyEvent,
    Completed,
    Error,
    Event,
    Handle,
    ImageProgress,
    Segment,
    SegmentRun,
    ShmHandle,
    Submit,
    is_droppable,
)
from omni_core.serial import ArrayCodec
from omni_core.stage import Stage, StageContext, StageInput
from omni_core.windows import Piece, RunPiece, Window, WindowState

CLIENT = "client"  # the destination name of the caller's collector
log = logging.getLogger("omni.host")
MAX_TOMBSTONES = 65536  # ended requests remembered, so late events for them are dropped


class RequestFailed(Exception):
    """A request cannot go on at this stage (bad stream, stage error); ends that request."""


def stage_context(cfg: PipelineConfig, name: str, devices: str | None = None) -> StageContext:
    """What a stage of ``cfg`` is told about where it runs."""
    st = cfg.stage(name)
    return StageContext(
        name=name,
        kind=st.kind,
        options=st.options,
        devices=devices,
        upstream=tuple(e.source for e in cfg.inbound(name)),
        downstream=tuple(e.target for e in cfg.outbound(name)),
        logger=logging.getLogger(f"omni.stage.{name}"),
    )


@dataclass
class WorkItem:
    inp: StageInput
    release: list[ShmHandle] = field(default_factory=list)  # after processing
    droppable_outputs: int = 0


@dataclass
class _Request:
    request: dict[str, Any] | None = None
    windows: dict[str, WindowState] = field(default_factory=dict)
    pending: dict[str, deque[Window]] = field(default_factory=dict)
    exhausted: set[str] = field(default_factory=set)
    next_seq: dict[str, int] = field(default_factory=dict)
    out_seq: int = 0
    triggers: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    all_triggered: bool = False


class StageHost:
    def __init__(self, cfg: PipelineConfig, name: str, stage: Stage, codec: ArrayCodec) -> None:
        self.cfg = cfg
        self.name = name
        self.stage = stage
        self.codec = codec
        self.inbound = {e.source: cfg.window(e) for e in cfg.inbound(name)}
        self.downstream = [e.target for e in cfg.outbound(name)]
        self.to_client = cfg.streams_to_client(cfg.stage(name))
        self.readers = {d: 1 for d in self.downstream}
        if self.to_client:
            self.readers[CLIENT] = 1
        self.data_destinations = list(self.readers)
        # client_stream "previews": previews go to the caller only, and do not take a
        # sequence number (downstream stages never see them)
        self.previews_to_client = name in cfg.preview_streams()
        self.requests: dict[str, _Request] = {}
        self.ended: OrderedDict[str, int] = OrderedDict()  # request -> next out sequence
        self.releasable: list[ShmHandle] = []  # slots to hand back; the driver drains it
        self.to_end: list[str] = []  # requests whose stage state is to be dropped
        self.window_triggers = 0
        self.dropped_late = 0

    # ------------------------------------------------------------------ intake
    def submit(self, msg: Submit) -> list[WorkItem]:
        """A new request at a source stage."""
        if msg.request_id in self.ended:  # cancelled before it arrived
            return []
        st = self.requests.setdefault(msg.request_id, _Request())
        st.request = msg.request
        st.all_triggered = True
        st.triggers = 1
        inp = StageInput(msg.request_id, msg.request, {}, True, True, st.cancel)
        return [WorkItem(inp)]

    def _stream(self, event: AnyEvent | SegmentRun) -> tuple[_Request, WindowState] | None:
        """The state of ``event``'s request and edge, checked against its sequence number;
        None when the request already ended here (the event is dropped)."""
        edge = event.stage
        spec = self.inbound.get(edge)
        if spec is None:
            raise RequestFailed(
                f"stage {self.name!r} got an event from {edge!r}, which has no edge to it"
            )
        rid = event.request_id
        st = self.requests.get(rid)
        if st is None:
            if rid in self.ended:  # cancelled or failed here: drop, free its slots
                self._release_handles(event)
                return None
            st = self.requests[rid] = _Request()
        expected = st.next_seq.get(edge, 0)
        if event.sequence != expected:  # the caller fails the request and frees its slots
            raise self._out_of_order(edge, event.sequence, expected)
        if expected == 0 and st.request is None:
            st.request = getattr(event, "request", None)
        ws = st.windows.get(edge)
        if ws is None:
            ws = st.windows[edge] = WindowState(edge, spec.size, spec.overlap)
        return st, ws

    def _release_handles(self, event: AnyEvent | SegmentRun) -> None:
        handles = getattr(event, "device_handles", None)
        if handles:
            self.releasable.extend(h for h in handles.values() if isinstance(h, ShmHandle))

    def receive(self, event: AnyEvent) -> list[WorkItem]:
        """An event from an upstream stage; returns the work it makes ready."""
        found = self._stream(event)
        if found is None:
            self.dropped_late += 1
            return []
        st, ws = found
        if not is_droppable(event):
            st.next_seq[event.stage] = event.sequence + 1
        kind = type(event)
        if kind is Segment or kind is ImageProgress:
            if event.device_handles:
                arrays, handles = self.codec.unpack(event.device_handles)
            else:
                arrays, handles = {}, []
            if kind is Segment:
                piece = Piece(
                    event.sequence,
                    event.tokens,
                    arrays,
                    event.payload,
                    handles,
                    None,
                    event.logprobs,
                )
            else:
                piece = Piece(event.sequence, None, arrays, event.payload, handles, event.step)
            windows = ws.push(piece, event.is_last)
        elif kind is Completed:
            windows = ws.end()
        else:  # errors and cancels travel on the control plane, never on an edge
            raise RequestFailed(f"unexpected {kind.__name__} on edge {event.stage} -> {self.name}")
        return self._windows_done(event.request_id, st, event.stage, windows)

    def receive_run(self, run: SegmentRun, limit: int) -> tuple[list[WorkItem], int]:
        """A run of segments (the hot path), taken in one go up to the segment that makes
        ``limit`` more windows (more only if that segment holds more than a window, or
        ends the stream); returns (the work made ready, segments consumed)."""
        found = self._stream(run)
        if found is None:
            self.dropped_late += len(run)
            return [], len(run)
        st, ws = found
        tokens = run.tokens
        units = [1 if t is None else len(t) for t in tokens]  # no arrays: a tokenless one is 1
        n = take = len(units)
        room = ws.room(limit)
        if room is not None:  # up to the segment that makes the limit's last window
            take = min(n, bisect_left(list(accumulate(units)), room) + 1)
        seq = run.sequence
        done = run.is_last and take == n
        payloads, lps = run.payloads, run.logprobs
        if take < n:  # the rest waits for room
            tokens, units, payloads = tokens[:take], units[:take], payloads[:take]
            lps = lps[:take] if lps is not None else None
        total = sum(units)
        part = RunPiece(seq, tokens, payloads, lps, units, total)
        # a unit-less segment goes with its spot in a window: only pieces know how
        parts: list[Piece | RunPiece] = part.pieces() if 0 in units else [part]
        st.next_seq[run.stage] = seq + take
        windows = ws.push_many(parts, total, done)
        return self._windows_done(run.request_id, st, run.stage, windows), take

    def _windows_done(
        self, rid: str, st: _Request, edge: str, windows: list[Window]
    ) -> list[WorkItem]:
        if not windows:
            return []
        self.window_triggers += len(windows)
        pending = st.pending.get(edge)
        if pending is None:
            pending = st.pending[edge] = deque()
        pending.extend(windows)
        return self._pair(rid, st)

    def _out_of_order(self, edge: str, got: int, expected: int) -> RequestFailed:
        return RequestFailed(
            f"edge {edge} -> {self.name}: event sequence {got} where "
            f"{expected} was expected (lost or reordered event)"
        )

    def _pair(self, rid: str, st: _Request) -> list[WorkItem]:
        items = []
        while not st.all_triggered:
            live = [e for e in self.inbound if e not in st.exhausted]
            if not all(st.pending.get(e) for e in live):
                break
            windows = {e: st.pending[e].popleft() for e in live}
            for e, w in windows.items():
                if w.is_last:
                    st.exhausted.add(e)
            last = len(st.exhausted) == len(self.inbound)
            st.all_triggered = last
            release = [h for w in windows.values() for h in w.release]
            inp = StageInput(rid, st.request or {}, windows, st.triggers == 0, last, st.cancel)
            st.triggers += 1
            items.append(WorkItem(inp, release))
        return items

    # ------------------------------------------------------------------ output
    def _client_preview(self, ev: Event) -> bool:
        return self.previews_to_client and type(ev) is ImageProgress and not ev.is_last

    def droppable(self, ev: Event) -> bool:
        """May be coalesced under backpressure (see :func:`is_droppable`)."""
        return is_droppable(ev) or self._client_preview(ev)

    def _stamp(self, rid: str, event: Event) -> Event:
        st = self.requests.get(rid)
        event.stage = self.name
        if st is None:
            if rid in self.ended:
                event.sequence = self.ended[rid]
                self.ended[rid] += 1
                return event
            st = self.requests[rid] = _Request()
        event.sequence = st.out_seq
        if self.droppable(event):
            return event
        if st.out_seq == 0 and hasattr(event, "request"):
            event.request = st.request  # type: ignore[attr-defined]
        st.out_seq += 1
        return event

    def pack(self, ev: Event) -> dict[str, Handle]:
        """Write an event's arrays for every reader (may block on a full pool: no lock held)."""
        arrays = ev.__dict__.get("arrays")
        if not arrays:
            return {}
        return self.codec.pack(arrays, {CLIENT: 1} if self._client_preview(ev) else self.readers)

    def emit(
        self, ev: Segment | ImageProgress | Error, handles: dict[str, Handle] | None = None
    ) -> tuple[Event, list[str]]:
        """Stamp a stage's event; returns it with the destinations it goes to."""
        if type(ev) is Error:
            ev.message = f"stage {self.name!r}: {ev.message}"
            return self._stamp(ev.request_id, ev), [CLIENT]
        if handles is None:
            handles = self.pack(ev)
        if handles:
            ev.device_handles = handles
        dests = [CLIENT] if self._client_preview(ev) else self.data_destinations
        return self._stamp(ev.request_id, ev), dests

    def emit_plain(self, evs: list[Segment]) -> list[Segment | SegmentRun]:
        """Stamp array-free segments yielded in one step (the hot path): each request's
        consecutive ones become one :class:`SegmentRun`; events of requests that ended
        here are left out."""
        out: list[Segment | SegmentRun] = []
        n = len(evs)
        i = 0
        while i < n:
            first = evs[i]
            rid = first.request_id
            j = i + 1
            while j < n and evs[j].request_id == rid and not evs[j - 1].is_last:
                j += 1
            st = self.requests.get(rid)
            if st is not None and not st.cancel.is_set():
                seq = st.out_seq
                if j - i == 1:
                    first.stage = self.name
                    first.sequence = seq
                    if seq == 0:
                        first.request = st.request
                    out.append(first)
                else:
                    request = st.request if seq == 0 else None
                    out.append(SegmentRun.of(evs[i:j], self.name, seq, request))
                st.out_seq = seq + j - i
            i = j
        return out

    def finish(self, item: WorkItem) -> list[tuple[Event, list[str]]]:
        """After an item ran: close the request's streams if it was the last trigger."""
        if not item.inp.last:
            return []
        rid = item.inp.request_id
        ev = self._stamp(rid, Completed(request_id=rid))
        self.forget(rid)
        return [(ev, [*self.downstream, CLIENT])]

    def error(self, rid: str, message: str, code: str = "stage_error") -> Error:
        ev = Error(request_id=rid, message=f"stage {self.name!r}: {message}", code=code)
        return self._stamp(rid, ev)  # type: ignore[return-value]

    # ------------------------------------------------------------------ state
    def is_cancelled(self, rid: str) -> bool:
        st = self.requests.get(rid)
        return st is not None and st.cancel.is_set()

    def forget(self, rid: str) -> list[ShmHandle]:
        """Drop a request's state; returns the slots it still held."""
        st = self.requests.pop(rid, None)
        if st is None:  # not seen yet (cancelled early): still drop what comes later
            if rid not in self.ended:
                self.ended[rid] = 0
                if len(self.ended) > MAX_TOMBSTONES:
                    self.ended.popitem(last=False)
            return []
        self.ended[rid] = st.out_seq
        if len(self.ended) > MAX_TOMBSTONES:
            self.ended.popitem(last=False)
        st.cancel.set()
        freed = [h for ws in st.windows.values() for h in ws.drop()]
        for q in st.pending.values():
            for w in q:
                freed.extend(w.release)
        self.to_end.append(rid)  # the stage thread calls end_request (see end_requests)
        return freed

    def take_ended(self) -> list[str]:
        """The requests that ended here since the last call (under the driver's lock)."""
        ended, self.to_end = self.to_end, []
        return ended

    def end_requests(self, rids: list[str]) -> None:
        """Call the stage's ``end_request`` for each of ``rids``. Only the stage thread
        calls this, between steps: a stage never sees ``end_request`` while its
        ``process`` runs."""
        for rid in rids:
            try:
                self.stage.end_request(rid)
            except Exception:  # a plug-in's cleanup must not take the stage down
                log.exception("stage %s: end_request(%s) failed", self.name, rid)
