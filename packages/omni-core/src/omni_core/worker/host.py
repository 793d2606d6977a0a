"""The transport-free part of running a stage: windows in, events out.

A :class:`StageHost` owns one stage's per-request state: a :class:`WindowState` per inbound
edge and fan-in pairing of windows into :class:`WorkItem` s; its base
:class:`~omni_core.worker.stage_output.StageOutput` numbers and stamps what the stage emits.
The worker process and the in-process runner both drive a host; only how events move
differs.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections import deque
from itertools import accumulate

from omni_core.config import PipelineConfig
from omni_core.dataplane.serial import ArrayCodec
from omni_core.dataplane.windows import Piece, RunPiece, Window, WindowState
from omni_core.events import (
    AnyEvent,
    Completed,
    ImageProgress,
    Segment,
    SegmentRun,
    ShmHandle,
    Submit,
    is_droppable,
)
from omni_core.stage import Stage, StageContext, StageInput
from omni_core.worker.stage_output import CLIENT, RequestState, StageOutput, WorkItem

log = logging.getLogger("omni.host")
__all__ = ["CLIENT", "RequestFailed", "StageHost", "WorkItem", "stage_context"]


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
        scheduler_policy=cfg.setting(st, "scheduler_policy"),
    )


class StageHost(StageOutput):
    """One stage's per-request state: windows in, fan-in pairing, work items out (and,
    from :class:`StageOutput`, the stamping of what the stage emits)."""

    def __init__(self, cfg: PipelineConfig, name: str, stage: Stage, codec: ArrayCodec) -> None:
        super().__init__(cfg, name, codec)
        self.stage = stage
        self.inbound = {e.source: cfg.window(e) for e in cfg.inbound(name)}
        self.releasable: list[ShmHandle] = []  # slots to hand back; the driver drains it
        self.to_end: list[str] = []  # requests whose stage state is to be dropped
        self.window_triggers = 0
        self.dropped_late = 0

    # ------------------------------------------------------------------ intake
    def submit(self, msg: Submit) -> list[WorkItem]:
        """A new request at a source stage."""
        if msg.request_id in self.ended:  # cancelled before it arrived
            return []
        st = self.requests.setdefault(msg.request_id, RequestState())
        st.request = msg.request
        st.routes = msg.routes
        st.all_triggered = True
        st.triggers = 1
        inp = StageInput(msg.request_id, msg.request, {}, True, True, st.cancel)
        return [WorkItem(inp)]

    def _stream(self, event: AnyEvent | SegmentRun) -> tuple[RequestState, WindowState] | None:
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
            st = self.requests[rid] = RequestState()
        expected = st.next_seq.get(edge, 0)
        if event.sequence != expected:  # the caller fails the request and frees its slots
            raise self._out_of_order(edge, event.sequence, expected)
        if expected == 0 and st.request is None:
            st.request = getattr(event, "request", None)
        if st.routes is None:
            st.routes = getattr(event, "routes", None)
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
        self, rid: str, st: RequestState, edge: str, windows: list[Window]
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

    def _pair(self, rid: str, st: RequestState) -> list[WorkItem]:
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

    # ------------------------------------------------------------------ state
    def is_cancelled(self, rid: str) -> bool:
        st = self.requests.get(rid)
        return st is not None and st.cancel.is_set()

    def forget(self, rid: str) -> list[ShmHandle]:
        """Drop a request's state; returns the slots it still held."""
        st = self.end(rid)
        if st is None:  # not seen yet (cancelled early): what comes later is dropped
            return []
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
