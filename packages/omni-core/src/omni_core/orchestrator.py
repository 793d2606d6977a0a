"""The control plane around the stage workers, the same on every backend.

Through its launcher (:mod:`omni_core.launcher`: local processes, or Ray actors) the
orchestrator starts the workers (with their devices and environment), waits for the
ready handshake, restarts dead ones, seeds requests into the source stages, and owns
every shared-memory segment. It is not on the data path between stages: workers write
straight to each other, and the stages that stream to the caller write straight to the
caller's collector socket.
One I/O thread (the pump) owns this process's sockets; caller threads talk to it through
an outbox.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from omni_core.collector import Collector, RequestHandle
from omni_core.config import PipelineConfig
from omni_core.errors import (
    OverloadedError,
    RuntimeFailedError,
    StageDeadError,
    StageStartError,
)
from omni_core.events import (
    Ack,
    Cancel,
    Cancelled,
    Error,
    Heartbeat,
    LoadFailed,
    ReaderLost,
    Ready,
    SegmentGone,
    ShmHandle,
    Shutdown,
    StageStats,
    Submit,
)
from omni_core.host import CLIENT
from omni_core.launcher import Launcher, ProcessLauncher, WorkerHandle
from omni_core.registry import load_stage_class
from omni_core.serial import (
    ArrayCodec,
    decode_event_frame,
    decode_status_frame,
    encode_frame,
    releases,
)
from omni_core.trace import TraceLog
from omni_core.transport import Addresses, Outbox, Waker, pull_socket, push_socket

log = logging.getLogger("omni.orchestrator")
MAX_BACKOFF_S = 10.0


@dataclass
class StageProc:
    """One stage's worker: the current process, and the stage's life across restarts."""

    name: str
    kind: str
    worker: WorkerHandle
    idempotent: bool = False
    ready: bool = False
    dead: bool = False  # this process has exited
    state: str = "starting"  # starting | ready | restarting | dead (for good)
    restarts: int = 0
    restart_at: float = 0.0
    exit_reason: str = ""
    load_error: str = ""
    load_s: float = 0.0
    last_heartbeat: float = 0.0
    stats: StageStats = field(default_factory=StageStats)
    rates: dict[str, float] = field(default_factory=dict)


class Orchestrator:
    def __init__(self, cfg: PipelineConfig, launcher: Launcher | None = None) -> None:
        self.cfg = cfg
        self.sources = cfg.sources()
        self.sinks = cfg.sinks()
        self.launcher = launcher or ProcessLauncher(cfg)
        self.socket_dir = self.launcher.socket_dir
        self.addr = Addresses(self.socket_dir)
        self.procs: dict[str, StageProc] = {}
        self.codec = ArrayCodec(CLIENT)
        self.collector = Collector(
            self.sinks, cfg.client_streams(), self.codec, cfg.preview_streams()
        )
        if cfg.trace:
            self.collector.trace = []
        self.lock = threading.RLock()  # guards the collector and stage table
        self.waker = Waker()
        self.outbox = Outbox(self.waker, capacity=1 << 16)
        self.zctx = zmq.Context()
        self.status = pull_socket(self.zctx, self.addr.status, 1 << 20)
        self.results = pull_socket(self.zctx, self.addr.results, 1 << 16)
        self.sockets: dict[str, zmq.Socket] = {}
        self.acks: dict[str, int] = {}
        self._closing = False
        self._pump: threading.Thread | None = None
        self.cancel_acks = 0
        self.trace = TraceLog([s.name for s in cfg.stages])
        # segments of dead workers: (stage, its worker, requests open when it died)
        self.retired: list[tuple[str, WorkerHandle, set[str]]] = []
        self.deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id)
        # set once a part of the runtime failed for good: {"part": ..., "error": ...}
        self.failure: dict[str, str] | None = None

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        try:
            for st in self.cfg.stages:
                self._spawn(st.name)
            self._wait_ready()
        except BaseException:
            self.close(graceful=False)
            raise
        for name in self.procs:
            self.sockets[f"data:{name}"] = push_socket(
                self.zctx,
                self.addr.data(name),
                self.cfg.setting(self.cfg.stage(name), "queue_capacity"),
            )
            self.sockets[f"ctl:{name}"] = push_socket(self.zctx, self.addr.control(name), 1 << 16)
        self._pump = threading.Thread(target=self._pump_loop, name="omni-orchestrator", daemon=True)
        self._pump.start()

    def _spawn(self, name: str) -> StageProc:
        st = self.cfg.stage(name)
        worker = self.launcher.spawn(name)
        idempotent = bool(getattr(load_stage_class(st.kind), "idempotent", False))
        p = StageProc(name, st.kind, worker, idempotent)
        old = self.procs.get(name)
        if old is not None:
            p.restarts = old.restarts
        self.procs[name] = p
        return p

    def _exits(self, events: dict[Any, int]) -> list[StageProc]:
        """Live workers that ended: their exit fd fired, or (no fd) they report it."""
        self.launcher.tick()
        ended = []
        for p in self.procs.values():
            if p.dead:
                continue
            fd = p.worker.fileno()
            if (fd in events) if fd is not None else p.worker.exited():
                ended.append(p)
        return ended

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        poller = zmq.Poller()
        poller.register(self.status, zmq.POLLIN)
        for p in self.procs.values():
            if p.worker.fileno() is not None:
                poller.register(p.worker.fileno(), zmq.POLLIN)
        while not all(p.ready for p in self.procs.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [n for n, p in self.procs.items() if not p.ready]
                why = "".join(f"; {n}: {w}" for n in waiting if (w := self.launcher.waiting(n)))
                raise StageStartError(
                    f"stages {waiting} were not ready within ready_timeout_s="
                    f"{self.cfg.ready_timeout_s}{why}"
                )
            events = dict(poller.poll(min(left, 0.5) * 1000))
            if self.status in events:
                self._drain_status()
            ended = self._exits(events)
            for p in self.procs.values():
                if p.load_error:
                    raise StageStartError(
                        f"stage {p.name!r} (kind {p.kind!r}) failed to load: {p.load_error}"
                    )
                if not p.ready and p in ended:
                    reason = p.worker.reap()
                    p.dead = True
                    self._drain_status()
                    detail = p.load_error or reason
                    raise StageStartError(
                        f"stage {p.name!r} (kind {p.kind!r}) failed to start: {detail}"
                    )

    # ------------------------------------------------------------------ pump
    def _pump_loop(self) -> None:
        poller = self.poller = zmq.Poller()
        poller.register(self.status, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        poller.register(self.waker.fd, zmq.POLLIN)
        for p in self.procs.values():
            if p.worker.fileno() is not None:
                poller.register(p.worker.fileno(), zmq.POLLIN)
        pollout: set[str] = set()
        while not self._closing:
            for dest in pollout:
                poller.register(self.sockets[dest], zmq.POLLOUT)
            self.waker.idle = True
            timeout = 0 if (self.outbox.count and not pollout) else 100
            events = dict(poller.poll(timeout))
            self.waker.idle = False
            for dest in pollout:
                poller.unregister(self.sockets[dest])
            if self.waker.fd in events:
                self.waker.clear()
            if self.results in events:
                self._drain_results()
            if self.status in events:
                self._drain_status()
            for p in self._exits(events):
                if p.worker.fileno() is not None:
                    poller.unregister(p.worker.fileno())
                self._on_death(p)
            for p in list(self.procs.values()):
                if p.state == "restarting" and time.monotonic() >= p.restart_at:
                    self._restart(p)
            self._check_deadlines()
            self._retire_segments()
            pollout = set(self.outbox.flush(self.sockets))
        self.outbox.flush(self.sockets)

    def _drain_results(self) -> None:
        for _ in range(256):
            try:
                frame = self.results.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            events = decode_event_frame(frame)
            releases: list[ShmHandle] = []
            failed: list[str] = []
            with self.lock:
                for ev in events:
                    wire_id = ev.request_id  # the collector renames it to the caller's id
                    shm, did_fail = self.collector.on_event(ev)
                    releases.extend(shm)
                    if did_fail:
                        failed.append(wire_id)
            self._release(releases)
            for wire_id in failed:
                self._broadcast_cancel(wire_id, "error")

    def _drain_status(self) -> None:
        while True:
            try:
                frame = self.status.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            for msg in decode_status_frame(frame):
                p = self.procs.get(msg.stage)
                if p is None:
                    continue
                if isinstance(msg, Heartbeat):
                    now = time.monotonic()
                    if p.last_heartbeat and now > p.last_heartbeat:
                        dt = now - p.last_heartbeat
                        p.rates = {
                            "enqueue_per_s": (msg.stats.received - p.stats.received) / dt,
                            "dequeue_per_s": (msg.stats.dequeued - p.stats.dequeued) / dt,
                        }
                    p.last_heartbeat = now
                    p.stats = msg.stats
                    if msg.spans or msg.marks:
                        self.trace.add(p.name, msg.spans, msg.marks)
                elif isinstance(msg, Ready):
                    p.ready = True
                    p.state = "ready"
                    p.load_s = msg.load_s
                    p.last_heartbeat = time.monotonic()
                elif isinstance(msg, LoadFailed):
                    p.load_error = msg.message
                elif isinstance(msg, Ack):
                    self.acks[msg.kind] = self.acks.get(msg.kind, 0) + 1
                    if msg.kind == "edge_end":
                        with self.lock:
                            h = self.collector.wire.get(msg.request_id)
                            if h is not None:
                                h.edges_done.add((msg.source, msg.stage))

    def _release(self, handles: list[ShmHandle]) -> None:
        for producer, msg in releases(handles, CLIENT):
            self.outbox.put(f"ctl:{producer}", msg, block=False)

    def _broadcast_cancel(self, wire_id: str, reason: str, include_dead: bool = False) -> None:
        for name, p in self.procs.items():
            if include_dead or not p.dead:
                msg = Cancel(request_id=wire_id, reason=reason)
                self.outbox.put(f"ctl:{name}", msg, block=False)

    def _on_death(self, p: StageProc) -> None:
        """A worker exited: end or replay its requests, reclaim its slots, restart it."""
        p.exit_reason = p.worker.reap()
        p.dead = True
        p.ready = False
        if self._closing:
            return
        st = self.cfg.stage(p.name)
        log.error(
            "stage %s (pid %s) %s", p.name, p.worker.pid, p.exit_reason, extra={"stage": p.name}
        )
        # slots the dead worker was reading go back to its producers; its own arena goes
        for e in self.cfg.inbound(p.name):
            self.outbox.put(f"ctl:{e.source}", ReaderLost(reader=p.name), block=False)
        if p.restarts < st.max_restarts:
            p.state = "restarting"
            backoff = min(MAX_BACKOFF_S, st.restart_backoff_s * (2**p.restarts))
            p.restart_at = time.monotonic() + backoff
        else:
            p.state = "dead"
        why = f"stage {p.name!r} worker (pid {p.worker.pid}, {p.worker.where}) {p.exit_reason}"
        cancel: list[str] = []
        replay: list[RequestHandle] = []
        downstream = [e.target for e in self.cfg.outbound(p.name)]
        with self.lock:
            for h in list(self.collector.handles.values()):
                if p.name in h.stages_done and all(
                    (p.name, d) in h.edges_done or d in h.stages_done for d in downstream
                ):
                    continue  # it went past this stage, and its output arrived downstream
                cancel.append(h.wire_id)
                if p.idempotent and p.state == "restarting" and self.collector.replay(h):
                    replay.append(h)
                else:
                    err = Error(
                        request_id=h.request_id, stage=p.name, message=why, code="stage_died"
                    )
                    self.collector.finish(h, err)
        for wire_id in cancel:  # queued for the restarted worker too: stale input is dropped
            self._broadcast_cancel(wire_id, "error", include_dead=True)
        for h in replay:
            self._send_submit(h.wire_id, h.request, h.deadline_wall, block=False)
        # readers may still hold data of requests that went past the dead worker: its
        # segment goes once those requests have ended
        with self.lock:
            open_ids = set(self.collector.wire)
        self.retired.append((p.name, p.worker, open_ids))

    def _retire_segments(self) -> None:
        """Unlink dead workers' segments once no request that may read them is open."""
        if not self.retired:
            return
        with self.lock:
            open_ids = set(self.collector.wire)
        keep = []
        for stage, worker, waiting in self.retired:
            waiting &= open_ids
            if waiting:
                keep.append((stage, worker, waiting))
                continue
            self.launcher.unlink_segment(worker)
            self.codec.reader.forget(worker.segment)
            for e in self.cfg.outbound(stage):
                msg = SegmentGone(segment=worker.segment)
                self.outbox.put(f"ctl:{e.target}", msg, block=False)
        self.retired = keep

    def _restart(self, p: StageProc) -> None:
        p.restarts += 1
        log.warning("restarting stage %s (restart %d)", p.name, p.restarts, extra={"stage": p.name})
        try:
            new = self._spawn(p.name)
        except Exception as e:  # cannot even start a process: the stage is dead
            p.state = "dead"
            p.exit_reason = f"restart failed: {e}"
            return
        if new.worker.fileno() is not None:  # state "starting" until its Ready
            self.poller.register(new.worker.fileno(), zmq.POLLIN)

    def _check_deadlines(self) -> None:
        """Time out requests whose deadline passed (a heap: no scan of open requests)."""
        now = time.monotonic()
        if not self.deadlines or self.deadlines[0][0] > now:
            return
        expired = []
        with self.lock:
            while self.deadlines and self.deadlines[0][0] <= now:
                _, rid = heapq.heappop(self.deadlines)
                h = self.collector.handles.get(rid)
                if h is not None:  # else it ended already
                    self.collector.finish(h, Cancelled(request_id=h.request_id, reason="timeout"))
                    expired.append(h.wire_id)
        for wire_id in expired:
            self._broadcast_cancel(wire_id, "timeout")

    # ------------------------------------------------------------------ API
    def submit(
        self,
        request: dict[str, Any],
        request_id: str | None = None,
        timeout_s: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestHandle:
        if self.failure is not None:
            f = self.failure
            raise RuntimeFailedError(f"the runtime failed ({f['part']}: {f['error']})")
        if self._closing or self._pump is None:
            raise RuntimeError("pipeline is not running")
        dead = [p for p in self.procs.values() if p.state == "dead"]
        if dead:
            p = dead[0]
            raise StageDeadError(
                f"stage {p.name!r} is dead ({p.exit_reason}, after {p.restarts} restarts); "
                "the pipeline cannot serve requests"
            )
        rid = request_id or uuid.uuid4().hex
        timeout_s = timeout_s if timeout_s is not None else self.cfg.request_timeout_s
        try:
            encode_frame([request])
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"request {rid}: cannot be serialized: {e}") from None
        cap = self.cfg.max_queued_requests
        with self.lock:
            if cap is not None and len(self.collector.handles) >= cap:
                raise OverloadedError(
                    f"{len(self.collector.handles)} requests are open "
                    f"(max_queued_requests={cap}); retry later",
                    retry_after_s=1.0,
                )
            h = self.collector.open(rid, loop)
            h.request = request
            if timeout_s is not None:
                h.deadline = h.submitted + timeout_s
                h.deadline_wall = time.time() + timeout_s
                heapq.heappush(self.deadlines, (h.deadline, rid))
        self._send_submit(rid, request, h.deadline_wall)
        return h

    def _send_submit(
        self, wire_id: str, request: dict[str, Any], deadline: float | None, block: bool = True
    ) -> None:
        """``block``: a caller thread waits while the outbox is full; the pump never does."""
        msg = Submit(request_id=wire_id, request=request, deadline=deadline)
        for s in self.sources:
            self.outbox.put(f"data:{s}", msg, block=block)

    def cancel(self, request_id: str) -> bool:
        with self.lock:
            h = self.collector.handles.get(request_id)
            if h is None:
                return False
            self.collector.finish(h, Cancelled(request_id=request_id, reason="cancelled"))
        self._broadcast_cancel(h.wire_id, "cancelled")
        return True

    def health(self) -> dict[str, dict[str, Any]]:
        """Per stage: alive, state (starting | ready | restarting | dead), pid, restarts."""
        now = time.monotonic()
        return {
            n: {
                "alive": not p.dead and not p.worker.exited(),
                "healthy": p.state == "ready" and not p.dead,
                "state": p.state,
                "pid": p.worker.pid,
                "where": p.worker.where,
                "restarts": p.restarts,
                "exit": p.exit_reason,
                "heartbeat_age_s": now - p.last_heartbeat if p.last_heartbeat else None,
                "load_s": p.load_s,
            }
            for n, p in self.procs.items()
        }

    def metrics(self) -> dict[str, Any]:
        """Stage counters (from heartbeats) with rates, and request latencies and counts."""
        stages = {}
        for n, p in self.procs.items():
            m = msgspec.structs.asdict(p.stats)
            m.update(restarts=p.restarts, state=p.state, **p.rates)
            stages[n] = m
        with self.lock:
            return {
                "stages": stages,
                "requests": self.collector.metrics.report(),
                "counts": dict(self.collector.counts),
                "in_flight": len(self.collector.handles),
                "cancel_acks": self.acks.get("cancel", 0),
            }

    def stage_stats(self) -> dict[str, StageStats]:
        return {n: p.stats for n, p in self.procs.items()}

    def pids(self) -> dict[str, int]:
        return {n: p.worker.pid for n, p in self.procs.items()}

    # ------------------------------------------------------------------ stop
    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        """Stop workers (draining queued work first when ``graceful``), free everything."""
        if self._pump is not None and graceful:
            deadline = time.time() + timeout_s
            for name in self.procs:
                self.outbox.put(
                    f"ctl:{name}", Shutdown(drain=False, deadline=deadline), block=False
                )
            t_end = time.monotonic() + 0.5
            while self.outbox.pending() and time.monotonic() < t_end:
                time.sleep(0.01)
        self._closing = True
        if self._pump is not None:
            self.waker.idle = True
            self.waker.wake()
            self._pump.join(timeout=5)
        t_end = time.monotonic() + (timeout_s if graceful else 0)
        for p in self.procs.values():
            if not p.dead:
                p.worker.stop(max(0.0, t_end - time.monotonic()))
                p.dead = True
        with self.lock:
            self.collector.fail_all("pipeline closed before the request finished")
        for s in [self.status, self.results, *self.sockets.values()]:
            s.close(linger=0)
        self.zctx.term()
        self.waker.close()
        self.launcher.close()
