"""The output side of a stage: its per-request state, and the stamping of each event it
emits (its stage name, the request's next sequence number, its arrays packed once for every
reader, its destinations). :class:`~omni_core.worker.host.StageHost` adds the input side.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from omni_core.config import PipelineConfig
from omni_core.dataplane.serial import ArrayCodec
from omni_core.dataplane.windows import Window, WindowState
from omni_core.events import (
    Completed,
    Error,
    Event,
    Handle,
    ImageProgress,
    Segment,
    SegmentRun,
    ShmHandle,
    is_droppable,
)
from omni_core.stage import StageInput

log = logging.getLogger("omni.host")
CLIENT = "client"  # the destination name of the caller's collector
MAX_TOMBSTONES = 65536  # ended requests remembered, so late events for them are dropped


@dataclass
class WorkItem:
    inp: StageInput
    release: list[ShmHandle] = field(default_factory=list)  # after processing
    droppable_outputs: int = 0
    queued_at: float = 0.0  # time.monotonic() when it entered a worker's queue


@dataclass
class RequestState:
    """One request at one stage: its windows in and its sequence numbers out."""

    request: dict[str, Any] | None = None
    routes: dict[str, int] | None = None  # replicated stage -> the replica bound to
    windows: dict[str, WindowState] = field(default_factory=dict)
    pending: dict[str, deque[Window]] = field(default_factory=dict)
    exhausted: set[str] = field(default_factory=set)
    next_seq: dict[str, int] = field(default_factory=dict)
    out_seq: int = 0
    triggers: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    all_triggered: bool = False


class StageOutput:
    def __init__(self, cfg: PipelineConfig, name: str, codec: ArrayCodec) -> None:
        self.cfg = cfg
        self.name = name
        self.codec = codec
        self.downstream = [e.target for e in cfg.outbound(name)]
        self.to_client = cfg.streams_to_client(cfg.stage(name))
        self.readers = {d: 1 for d in self.downstream}
        if self.to_client:
            self.readers[CLIENT] = 1
        self.data_destinations = list(self.readers)
        # downstream stages with replicas: each request goes to the one it is bound to
        self.replicated = {d: cfg.workers(d) for d in self.downstream if cfg.replicated(d)}
        # client_stream "previews": previews go to the caller only, and do not take a
        # sequence number (downstream stages never see them)
        self.previews_to_client = name in cfg.preview_streams()
        self.requests: dict[str, RequestState] = {}
        self.ended: OrderedDict[str, int] = OrderedDict()  # request -> next out sequence

    def forget(self, rid: str) -> list[ShmHandle]:
        """Drop a request's state; returns the slots it still held."""
        self.end(rid)
        return []

    def end(self, rid: str) -> RequestState | None:
        """The request ended here: remember where its output stopped (late events are
        dropped, a late error still numbered); its state, if it had any."""
        st = self.requests.pop(rid, None)
        self.ended[rid] = st.out_seq if st is not None else self.ended.get(rid, 0)
        if len(self.ended) > MAX_TOMBSTONES:
            self.ended.popitem(last=False)
        if st is not None:
            st.cancel.set()
        return st

    def route(self, rid: str, stages: list[str]) -> list[str]:
        """The workers that ``stages`` (downstream stages, or the caller) mean for request
        ``rid``: a replicated stage's is the replica the request is bound to."""
        if not self.replicated:
            return stages
        st = self.requests.get(rid)
        routes = st.routes if st is not None else None
        out = []
        for d in stages:
            workers = self.replicated.get(d)
            if workers is None:
                out.append(d)
                continue
            index = routes.get(d) if routes else None
            if index is None or not 0 <= index < len(workers):
                # never expected: the binding travels with the request's first event
                index = zlib.crc32(rid.encode()) % len(workers)
                log.error("request %s has no binding for stage %s; using %s", rid, d, index)
            out.append(workers[index])
        return out

    def destinations(self, rid: str) -> list[str]:
        """Where request ``rid``'s events go from this stage (downstream and the caller)."""
        if not self.replicated:
            return self.data_destinations
        return self.route(rid, self.data_destinations)

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
            st = self.requests[rid] = RequestState()
        event.sequence = st.out_seq
        if self.droppable(event):
            if st.out_seq == 0 and hasattr(event, "routes"):
                event.routes = st.routes  # type: ignore[attr-defined]
            return event
        if st.out_seq == 0 and hasattr(event, "request"):
            event.request = st.request  # type: ignore[attr-defined]
            event.routes = st.routes  # type: ignore[attr-defined]
        st.out_seq += 1
        return event

    def pack(self, ev: Event) -> dict[str, Handle]:
        """Write an event's arrays for every reader (may block on a full pool: no lock held)."""
        arrays = ev.__dict__.get("arrays")
        if not arrays:
            return {}
        if self._client_preview(ev):
            readers = {CLIENT: 1}
        elif self.replicated:
            readers = dict.fromkeys(self.destinations(ev.request_id), 1)
        else:
            readers = self.readers
        return self.codec.pack(arrays, readers)

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
        dests = [CLIENT] if self._client_preview(ev) else self.destinations(ev.request_id)
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
                        first.routes = st.routes
                    out.append(first)
                else:
                    request, routes = (st.request, st.routes) if seq == 0 else (None, None)
                    out.append(SegmentRun.of(evs[i:j], self.name, seq, request, routes))
                st.out_seq = seq + j - i
            i = j
        return out

    def by_destination(self, out: list[Segment | SegmentRun]) -> dict[str, list[Any]]:
        """``out`` (of :meth:`emit_plain`, several requests) split by the worker each
        message goes to, in order."""
        if not self.replicated:
            return dict.fromkeys(self.data_destinations, out)
        groups: dict[str, list[Any]] = {}
        for m in out:
            for d in self.destinations(m.request_id):
                groups.setdefault(d, []).append(m)
        return groups

    def finish(self, item: WorkItem) -> list[tuple[Event, list[str]]]:
        """After an item ran: close the request's streams if it was the last trigger."""
        if not item.inp.last:
            return []
        rid = item.inp.request_id
        dests = [*self.route(rid, self.downstream), CLIENT]
        ev = self._stamp(rid, Completed(request_id=rid))
        self.forget(rid)
        return [(ev, dests)]

    def error(self, rid: str, message: str, code: str = "stage_error") -> Error:
        ev = Error(request_id=rid, message=f"stage {self.name!r}: {message}", code=code)
        return self._stamp(rid, ev)  # type: ignore[return-value]
