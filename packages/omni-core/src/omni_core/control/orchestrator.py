"""The control plane around the stage workers, the same on every backend.

Through its launcher (:mod:`omni_core.control.launcher`: local processes, or Ray actors) the
orchestrator starts the workers, waits for the ready handshake and seeds requests into the
source stages. It is not on the data path between stages: workers write straight to each
other, and the stages that stream to the caller write straight to the caller's collector
socket. Three parts: the :class:`~omni_core.control.supervisor.Supervisor` (the workers' lives),
the :class:`~omni_core.control.request_table.RequestTable` (open requests), and the
:class:`ControlLoop`, the one I/O thread that owns this process's sockets; caller threads
talk to it through an outbox.

If the control loop itself fails, the runtime fails loudly (vLLM's ``EngineDeadError``
contract): every open request ends with ``runtime_failed``, :attr:`Orchestrator.failure`
says what failed, health is unhealthy, and ``submit`` raises :class:`RuntimeFailedError`.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from omni_core.client.backend import Backend, ReaderLoop
from omni_core.client.collector import Collector, RequestHandle
from omni_core.config import PipelineConfig, replica_name
from omni_core.control.launcher import Launcher, ProcessLauncher, WorkerHandle, report
from omni_core.control.lifecycle import Life
from omni_core.control.replicas import Autoscaler, Router
from omni_core.control.request_table import RequestTable
from omni_core.control.supervisor import Supervisor, WorkerRecord
from omni_core.dataplane.poll_loop import PollLoop
from omni_core.dataplane.serial import (
    ArrayCodec,
    BadMessage,
    decode_event_frame,
    decode_status_frame,
    releases,
    salvage_frame,
)
from omni_core.dataplane.shm import SegmentReader
from omni_core.dataplane.transport import (
    Addresses,
    Outbox,
    Waker,
    control_dest,
    data_dest,
    pull_socket,
    push_socket,
)
from omni_core.errors import StageDeadError, StageStartError
from omni_core.events import (
    Ack,
    Cancel,
    Error,
    Heartbeat,
    ReaderLost,
    SegmentGone,
    ShmHandle,
    Shutdown,
    StageStats,
    Submit,
)
from omni_core.health import Failure, Health, Metrics
from omni_core.observability.trace import TraceLog
from omni_core.worker.host import CLIENT

log = logging.getLogger("omni.orchestrator")

__all__ = ["Orchestrator", "StageDeadError", "StageStartError"]


class ControlLoop(PollLoop):
    """The orchestrator's I/O thread: results to callers, worker status, deaths and
    restarts, liveness, deadlines, and the segments of dead workers."""

    name = "orchestrator control"

    def __init__(self, orch: Orchestrator) -> None:
        super().__init__(orch.waker, orch.outbox, orch.sockets)
        self.o = orch
        self.cfg = orch.cfg
        self.sup = orch.supervisor
        self.table = orch.requests
        self.collector = orch.collector
        # segments of dead workers: (stage, its worker, requests open when it died)
        self.retired: list[tuple[str, WorkerHandle, set[str]]] = []
        self.watch(orch.results, self.drain_results)
        self.watch(orch.status, orch.drain_status)
        for p in self.sup.procs.values():
            self._watch_exit(p)

    def _watch_exit(self, p: WorkerRecord) -> None:
        fd = p.worker.fileno()
        if fd is not None:
            self.watch(fd, lambda: None)  # seen in tick(), through supervisor.ended

    def done(self) -> bool:
        return self.o.closing

    def tick(self, events: dict[Any, int]) -> None:
        failure = self.o.launcher.failure()
        if failure is not None and self.o.failure is None:
            self.o.fail_runtime(failure["part"], failure["error"])
        for p in self.sup.ended(events):
            fd = p.worker.fileno()
            if fd is not None:
                self.unwatch(fd)
            self.on_death(p)
        for p in self.sup.due_restarts():
            self._watch_exit(p)
        self.sup.check_liveness()
        self.scale()
        for wire_id in self.table.expire():
            self.broadcast_cancel(wire_id, "timeout")
        for wire_id in self.collector.take_orphans():
            self.broadcast_cancel(wire_id, "cancelled")
        self.retire_segments()

    # -- results to callers ------------------------------------------------------
    def drain_results(self) -> None:
        for _ in range(256):
            try:
                frame = self.o.results.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            bad: list[BadMessage] = []
            try:
                events = decode_event_frame(frame)
            except msgspec.DecodeError:
                events, bad = salvage_frame(frame, "event")
            failed: list[str | None] = [self.on_bad_message(b) for b in bad]
            freed: list[ShmHandle] = []
            with self.table.lock:
                for ev in events:
                    wire_id = ev.request_id  # the collector renames it to the caller's id
                    try:
                        shm, did_fail = self.collector.on_event(ev)
                    except Exception:  # a bug met with this event: its request only
                        did_fail, shm = self._event_failed(ev), []
                    freed.extend(shm)
                    if did_fail:
                        failed.append(wire_id)
            self.release(freed)
            for failed_id in failed:
                if failed_id is not None:
                    self.broadcast_cancel(failed_id, "error")

    def on_bad_message(self, bad: BadMessage) -> str | None:
        """A message for the caller that does not decode: its request fails with an error
        naming the stage; the other messages of its frame were delivered."""
        where = f"stage {bad.stage!r}" if bad.stage else "an unknown stage"
        message = f"{where} sent a message that cannot be decoded: {bad.error}"
        log.error("%s (request %s)", message, bad.request_id, extra={"stage": bad.stage or ""})
        with self.table.lock:
            h = self.collector.wire.get(bad.request_id or "")
            if h is None:
                return None
            stage = bad.stage or ""
            err = Error(request_id=h.request_id, stage=stage, message=message, code="bad_message")
            self.collector.finish(h, err)
        return bad.request_id

    def _event_failed(self, ev: Any) -> bool:
        log.error(
            "delivering %s of request %s from stage %s failed:\n%s",
            type(ev).__name__,
            ev.request_id,
            ev.stage,
            traceback.format_exc(),
        )
        h = self.collector.wire.get(ev.request_id)
        if h is None:
            return False
        message = f"stage {ev.stage!r}: its {ev.event_type} event could not be delivered"
        err = Error(request_id=h.request_id, stage=ev.stage, message=message, code="internal")
        self.collector.finish(h, err)
        return True

    # -- replicas coming and going -------------------------------------------------
    def scale(self) -> None:
        """Carry out the autoscaler's decisions; stop drained replicas. Under the request
        table's lock: ``submit`` binds requests to replicas under it, so no request is
        bound to a replica that is being stopped, and the replica set does not change
        while a caller reads it."""
        if self.o.shutting_down:
            return
        with self.table.lock:
            self._scale()

    def _scale(self) -> None:
        if self.o.autoscaler.specs:
            start, drain = self.o.autoscaler.tick()
            for name in start:
                self.add_replica(name)
            for p in drain:
                self.sup.drain(p)  # no new bindings from now on
                self.o.autoscaler.record("drain", p.stage, worker=p.name)
                log.info("stage %s: draining replica %s", p.stage, p.name, extra={"stage": p.stage})
        now = self.sup.clock()
        for p in list(self.sup.procs.values()):
            late = now - p.spawned_at > self.cfg.ready_timeout_s
            if p.scaled and p.state == Life.STARTING and late:
                # not placed or not loaded in time (e.g. Ray has no node for it): reported,
                # and let go; its end is seen like a death that restarts nothing
                why = self.o.launcher.waiting(p.name) or "not ready within ready_timeout_s"
                self.o.autoscaler.cannot_place(p.stage, why)
                self.sup.stop(p)
                p.worker.kill()
            if p.state == Life.DRAINING and not self.table.holds(
                p.stage, p.replica, [e.target for e in self.cfg.outbound(p.stage)]
            ):
                self.sup.stop(p)  # its requests are past it, their output arrived
                msg = Shutdown(drain=True, deadline=time.time() + 30.0)
                self.outbox.put(control_dest(p.name), msg, block=False)

    def add_replica(self, name: str) -> None:
        try:
            p = self.sup.spawn(name, scaled=True)
        except Exception as e:  # cannot be placed here (devices, resources): reported
            stage = name.partition("#")[0]
            self.o.autoscaler.cannot_place(stage, f"{type(e).__name__}: {e}")
            return
        self.o.autoscaler.record("start", p.stage, worker=name)
        log.info("stage %s: starting replica %s", p.stage, name, extra={"stage": p.stage})
        self._watch_exit(p)

    # -- deaths --------------------------------------------------------------------
    def on_death(self, p: WorkerRecord) -> None:
        """A worker exited: end or replay its requests, reclaim its slots, restart it."""
        if self.o.closing or self.o.shutting_down:  # told to stop: not a crash
            self.sup.reaped(p)
            return
        never_up = p.scaled and p.state == Life.STARTING  # an added replica that failed
        self.sup.on_death(p, restart=not never_up)
        why, code = self.sup.why(p)
        if never_up:
            self.o.autoscaler.cannot_place(p.stage, f"{p.name}: {p.load_error or why}")
        if p.state == Life.STOPPED:  # a replica scaled down, or one that never came up
            log.info("%s after draining", why, extra={"stage": p.stage})
            self.o.autoscaler.record("stopped", p.stage, worker=p.name)
            with self.table.lock:  # the replica set changes: not while submit reads it
                del self.sup.procs[p.name]
        else:
            log.error("%s", why, extra={"stage": p.stage})
        # slots the dead worker was reading go back to its producers; its own arena goes
        for e in self.cfg.inbound(p.stage):
            for source in self.cfg.workers(e.source):
                self.outbox.put(control_dest(source), ReaderLost(reader=p.name), block=False)
        downstream = [e.target for e in self.cfg.outbound(p.stage)]
        # a replica scaled down had nothing left; one that crashed while draining may have
        replayable = p.idempotent and p.state in (Life.RESTARTING, Life.STOPPED)
        replica = p.replica if self.cfg.replicated(p.stage) else None
        cancel, replay = self.table.on_stage_death(
            p.stage, replica, downstream, replayable, why, code
        )
        for wire_id in cancel:  # queued for the restarted worker too: stale input is dropped
            self.broadcast_cancel(wire_id, "error", include_dead=True)
        for h in replay:
            self.o.resubmit(h)
        # readers may still hold data of requests that went past the dead worker: its
        # segment goes once those requests have ended
        self.retired.append((p.stage, p.worker, self.table.wire_ids()))

    def retire_segments(self) -> None:
        """Unlink dead workers' segments once no request that may read them is open."""
        if not self.retired:
            return
        open_ids = self.table.wire_ids()
        keep = []
        for stage, worker, waiting in self.retired:
            waiting &= open_ids
            if waiting:
                keep.append((stage, worker, waiting))
                continue
            self.o.launcher.unlink_segment(worker)
            self.o.codec.reader.forget(worker.segment)
            for e in self.cfg.outbound(stage):
                for target in self.cfg.workers(e.target):
                    msg = SegmentGone(segment=worker.segment)
                    self.outbox.put(control_dest(target), msg, block=False)
        self.retired = keep

    # -- messages out --------------------------------------------------------------
    def release(self, handles: list[ShmHandle]) -> None:
        for producer, msg in releases(handles, CLIENT):
            self.outbox.put(control_dest(producer), msg, block=False)

    def broadcast_cancel(self, wire_id: str, reason: str, include_dead: bool = False) -> None:
        for name, p in self.sup.procs.items():
            if include_dead or not p.dead:
                msg = Cancel(request_id=wire_id, reason=reason)
                self.outbox.put(control_dest(name), msg, block=False)


class Orchestrator(Backend):
    def __init__(self, cfg: PipelineConfig, launcher: Launcher | None = None) -> None:
        self.cfg = cfg
        self.sources = cfg.sources()
        self.launcher = launcher or ProcessLauncher(cfg)
        self.supervisor = Supervisor(cfg, self.launcher)
        self.addr = Addresses(self.launcher.socket_dir)
        # results name only this pipeline's segments (a socket's peer cannot widen that)
        self.codec = ArrayCodec(CLIENT, reader=SegmentReader(scope=self.launcher.segment_scope))
        self.collector = Collector(
            cfg.sinks(), cfg.client_streams(), self.codec, cfg.preview_streams()
        )
        if cfg.trace:
            self.collector.trace = []
        self.requests = RequestTable(cfg, self.collector)
        self.lock = self.requests.lock
        self.router = Router(cfg, self.supervisor, self.collector)
        self.autoscaler = Autoscaler(cfg, self.supervisor, self.collector)
        self.waker = Waker()
        self.outbox = Outbox(self.waker, capacity=1 << 16)
        self.zctx = zmq.Context()
        self.status = pull_socket(self.zctx, self.addr.status, 1 << 20)
        self.results = pull_socket(self.zctx, self.addr.results, 1 << 16)
        self.sockets: dict[str, zmq.Socket[Any]] = {}
        self.acks: dict[str, int] = {}
        self.closing = False
        self.shutting_down = False  # workers were told to stop (close)
        self.loop: ControlLoop | None = None
        self._thread: threading.Thread | None = None
        self.trace = TraceLog(cfg.all_workers())
        # set once a part of the runtime failed for good: {"part": ..., "error": ...}
        self.failure: Failure | None = None

    @property
    def procs(self) -> dict[str, WorkerRecord]:
        """The workers now (a copy: the autoscaler adds and removes replicas)."""
        return dict(self.supervisor.procs)

    @property
    def retired(self) -> list[tuple[str, WorkerHandle, set[str]]]:
        return self.loop.retired if self.loop is not None else []

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        t0 = time.monotonic()
        try:
            for st in self.cfg.stages:  # a replicated stage starts with its minimum
                for name in self.cfg.workers(st.name)[: self.cfg.replica_range(st.name)[0]]:
                    self.supervisor.spawn(name)
            self._wait_ready(t0)
        except BaseException:
            self.close(graceful=False)
            raise
        for st in self.cfg.stages:  # every replica a stage may have, started or not
            for name in self.cfg.workers(st.name):
                hwm = self.cfg.setting(st, "queue_capacity")
                self.sockets[data_dest(name)] = push_socket(self.zctx, self.addr.data(name), hwm)
                ctl = push_socket(self.zctx, self.addr.control(name), 1 << 16)
                self.sockets[control_dest(name)] = ctl
        self.loop = ControlLoop(self)
        self._thread = threading.Thread(
            target=self.loop.run,
            args=(self._loop_failed,),
            name="omni-orchestrator",
            daemon=True,
        )
        self._thread.start()

    def _wait_ready(self, t0: float) -> None:
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
            events = dict(poller.poll(int(min(left, 0.5) * 1000)))
            if self.status in events:
                self.drain_status()
            ended = self.supervisor.ended(events)
            for p in self.procs.values():
                if p.load_error:
                    raise StageStartError(
                        f"stage {p.name!r} (kind {p.kind!r}) failed to load: {p.load_error}"
                    )
                if not p.ready and p in ended:
                    reason = self.supervisor.reaped(p)
                    self.drain_status()
                    detail = p.load_error or reason
                    raise StageStartError(
                        f"stage {p.name!r} (kind {p.kind!r}) failed to start: {detail}"
                    )
        report(f"{len(self.procs)} workers ready in {time.monotonic() - t0:.1f} s")

    def drain_status(self) -> None:
        """Every waiting status message (ready, load failure, heartbeat, ack); one that
        does not decode is logged, the rest of its frame applied."""
        while True:
            try:
                frame = self.status.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msgs = decode_status_frame(frame)
            except msgspec.DecodeError:
                msgs, bad = salvage_frame(frame, "status")
                for b in bad:
                    log.error("undecodable status message from %s: %s", b.stage, b.error)
            for msg in msgs:
                self.on_status(msg)

    def on_status(self, msg: Any) -> None:
        self.supervisor.on_status(msg)
        if isinstance(msg, Heartbeat) and (msg.spans or msg.marks):
            self.trace.add(msg.stage, msg.spans, msg.marks)
        elif isinstance(msg, Ack):
            self.acks[msg.kind] = self.acks.get(msg.kind, 0) + 1
            if msg.kind == "edge_end":
                with self.requests.lock:
                    h = self.collector.wire.get(msg.request_id)
                    if h is not None:
                        h.edges_done.add((msg.source, msg.stage))

    def _loop_failed(self, e: BaseException) -> None:
        self.fail_runtime("orchestrator control loop", f"{type(e).__name__}: {e}")

    def fail_runtime(self, part: str, error: str) -> None:
        """A part of the runtime cannot go on: fail loudly, never hang."""
        self.failure = {"part": part, "error": error}
        log.critical("the runtime failed: %s: %s; every open request ends", part, error)
        self.requests.fail_all(
            f"the runtime failed ({part}: {error}); restart the pipeline", code="runtime_failed"
        )

    # ------------------------------------------------------------------ API
    def running(self) -> bool:
        return not self.closing and self._thread is not None

    def check_serving(self) -> None:
        """Also raise :class:`StageDeadError` when a stage has no live worker left."""
        super().check_serving()
        live = {p.stage for p in self.procs.values() if p.state != Life.DEAD}
        dead = [p for p in self.procs.values() if p.state == Life.DEAD and p.stage not in live]
        if dead:
            p = dead[0]
            raise StageDeadError(
                f"stage {p.stage!r} is dead ({p.exit_reason}, after {p.restarts} restarts); "
                "the pipeline cannot serve requests"
            )

    def open_request(
        self, request_id: str, request: dict[str, Any], timeout_s: float | None, loop: ReaderLoop
    ) -> RequestHandle:
        """Admitted by the request table and bound to replicas (under its lock: the
        binding sees every earlier request's)."""
        with self.requests.lock:
            routes = self.router.bind()
            h = self.requests.open(request_id, request, timeout_s, loop)
            self.collector.bind(h, routes)
        return h

    def send_request(
        self, h: RequestHandle, request: dict[str, Any], timeout_s: float | None
    ) -> None:
        self.send_submit(h.wire_id, request, h.deadline_wall, h.routes)

    def abandon(self, h: RequestHandle) -> None:
        """The outbox queues a Submit before it waits for room: one interrupted there
        may be on its way to some source stages, so the request is cancelled everywhere
        (its workers drop it) rather than only forgotten here."""
        if not self.cancel(h.request_id):
            super().abandon(h)

    def resubmit(self, h: RequestHandle) -> None:
        """A new attempt of a request (its idempotent stage died), bound anew: the
        replica that died takes no new requests until it is back. (The loop's thread.)"""
        with self.requests.lock:
            if h.done:  # ended (cancelled, timed out) meanwhile
                return
            try:
                routes = self.router.bind()
            except StageDeadError as e:
                err = Error(request_id=h.request_id, message=str(e), code=StageDeadError.code)
                self.collector.finish(h, err)
                return
            self.collector.bind(h, routes)
        self.send_submit(h.wire_id, h.request, h.deadline_wall, routes, block=False)

    def send_submit(
        self,
        wire_id: str,
        request: dict[str, Any],
        deadline: float | None,
        routes: dict[str, int] | None = None,
        block: bool = True,
    ) -> None:
        """``block``: a caller thread waits while the outbox is full; the loop never does."""
        msg = Submit(request_id=wire_id, request=request, deadline=deadline, routes=routes)
        for s in self.sources:
            worker = s if routes is None or s not in routes else replica_name(s, routes[s])
            self.outbox.put(data_dest(worker), msg, block=block)

    def cancel(self, request_id: str) -> bool:
        wire_id = self.requests.cancel(request_id)
        if wire_id is None:
            return False
        for name in self.procs:
            msg = Cancel(request_id=wire_id, reason="cancelled")
            self.outbox.put(control_dest(name), msg, block=False)
        return True

    def health(self) -> Health:
        """Per stage: alive, healthy, state (starting | ready | unresponsive | hung |
        restarting | dead | failed), pid, restarts; every stage is unhealthy once the
        runtime failed."""
        out = self.supervisor.health()
        if self.failure is not None:
            for h in out.values():
                h["healthy"], h["state"] = False, "failed"
        return out

    def zygote(self) -> dict[str, Any] | None:
        """How workers start (the launcher's ``describe()``: the zygote's state, pid,
        restarts, what it preloaded); None for a launcher without one."""
        describe = getattr(self.launcher, "describe", None)
        return describe() if describe is not None else None

    def metrics(self) -> Metrics:
        """Stage counters (from heartbeats) with rates, and request latencies and counts."""
        stages = {}
        for n, p in self.procs.items():
            m = msgspec.structs.asdict(p.stats)
            m.update(restarts=p.restarts, state=str(p.state), **p.rates)
            stages[n] = m
        with self.requests.lock:
            return {
                "stages": stages,
                "requests": self.collector.metrics.report(),
                "counts": dict(self.collector.counts),
                "in_flight": len(self.collector.handles),
                "replicas": self.autoscaler.report(),
                "cancel_acks": self.acks.get("cancel", 0),
            }

    def stage_stats(self) -> dict[str, StageStats]:
        return {n: p.stats for n, p in self.procs.items()}

    def pids(self) -> dict[str, int | None]:
        return {n: p.worker.pid for n, p in self.procs.items()}

    def chrome_trace(self) -> dict[str, Any]:
        """The workers' spans and marks so far, with the caller's arrivals."""
        self.trace.add("client", [], self.collector.trace or [])
        self.collector.trace = []
        return self.trace.chrome({n: pid for n, pid in self.pids().items() if pid is not None})

    # ------------------------------------------------------------------ stop
    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        """Stop workers (draining queued work first when ``graceful``), free everything."""
        graceful = graceful and self._thread is not None and self._thread.is_alive()
        self.shutting_down = True
        if graceful:
            deadline = time.time() + timeout_s
            for name in self.procs:
                self.outbox.put(
                    control_dest(name), Shutdown(drain=False, deadline=deadline), block=False
                )
            t_end = time.monotonic() + 0.5
            while self.outbox.pending() and time.monotonic() < t_end:
                time.sleep(0.01)
        self.closing = True
        if self._thread is not None:
            self.waker.idle = True
            self.waker.wake()
            self._thread.join(timeout=5)
        t_end = time.monotonic() + (timeout_s if graceful else 0)
        for p in self.procs.values():
            if not p.dead:
                self.supervisor.stop_now(p, max(0.0, t_end - time.monotonic()))
        self.requests.fail_all("pipeline closed before the request finished", "pipeline_closed")
        for s in [self.status, self.results, *self.sockets.values()]:
            s.close(linger=0)
        self.zctx.term()
        self.waker.close()
        self.launcher.close()
