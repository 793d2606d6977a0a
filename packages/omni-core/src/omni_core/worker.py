"""A stage worker: the loop of one stage, in a process of its own.

The local launcher starts it as ``python -c ... main(spec_path)``; other launchers (the
Ray backend) call :func:`serve` with the spec inside a process they started.

Two threads. The I/O thread owns the sockets: it takes in upstream events (only while the
work queue has room, so a slow stage pushes back on its producers), applies control
messages at once (cancel, slot releases, shutdown) even while the stage computes, sends
what the stage emitted, and heartbeats. The stage thread is the busy loop: take a batch,
run the stage's generator, hand each output over; it checks cancellation between yields.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from omni_core.config import PipelineConfig
from omni_core.events import (
    Ack,
    Cancel,
    Completed,
    Error,
    Heartbeat,
    LoadFailed,
    ReaderLost,
    Ready,
    Release,
    Segment,
    SegmentGone,
    SegmentRun,
    ShmHandle,
    Shutdown,
    StageStats,
    Submit,
    TraceMark,
    TraceSpan,
)
from omni_core.host import CLIENT, RequestFailed, StageHost, WorkItem, stage_context
from omni_core.logs import configure_logging
from omni_core.registry import load_stage_class
from omni_core.serial import (
    ArrayCodec,
    decode_control_frame,
    decode_data_frame,
    decode_json,
    encode_frame,
    releases,
)
from omni_core.shm import Arena
from omni_core.stage import StageEvent
from omni_core.transport import Addresses, Outbox, Sender, Waker, pull_socket, push_socket

log = logging.getLogger("omni.worker")


class WorkerSpec(msgspec.Struct, kw_only=True):
    """Everything a worker needs, written by the orchestrator into its socket directory."""

    stage: str
    config: PipelineConfig
    socket_dir: str
    arena: str  # the shared-memory segment this stage writes into
    owner_pid: int = 0  # the orchestrator's pid: the worker exits if it goes away (0: no check)
    devices: str | None = None
    # where the worker binds its own inbound sockets, when not ``socket_dir`` (the Ray
    # backend: senders reach it through the node's gateway, which binds ``socket_dir``)
    bind_dir: str | None = None


@dataclass
class _Active:
    gen: Iterator[StageEvent]
    items: list[WorkItem]
    rids: set[str] = field(default_factory=set)
    cancels: list[threading.Event] = field(default_factory=list)
    started: float = 0.0
    outputs: int = 0


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        cfg = spec.config
        self.name = spec.stage
        st = cfg.stage(self.name)
        self.max_inflight = cfg.setting(st, "max_inflight")
        self.max_batch = cfg.setting(st, "max_batch_size")
        self.capacity = cfg.setting(st, "queue_capacity")
        self.addr = Addresses(spec.socket_dir)
        cls = load_stage_class(st.kind)
        self.stage = cls(stage_context(cfg, self.name, spec.devices))
        self.arena = Arena(spec.arena)
        self.codec = ArrayCodec(self.name, self.arena, threshold=cfg.shm_threshold_bytes)
        self.host = StageHost(cfg, self.name, self.stage, self.codec)
        self.lock = threading.Lock()  # guards host state (both threads touch it)
        self.work = threading.Condition(self.lock)
        self.ready: deque[WorkItem] = deque()
        self.stash: deque[Any] = deque()  # decoded upstream messages not yet taken in
        self.stopping = False
        self.io_done = False  # set by the stage thread when the I/O thread may exit
        self.idle_stage = False  # the stage thread waits for work (only then notify)
        self.trace = spec.config.trace  # record spans and marks for `omni trace`
        self.spans: list[TraceSpan] = []
        self.marks: list[TraceMark] = []
        self.drain = False
        self.deadline: float | None = None
        self.inflight = 0
        self.stats = StageStats()
        self.waker = Waker()
        self.outbox = Outbox(self.waker, capacity=max(64, self.capacity * 4))
        self.zctx = zmq.Context()

    # ================================================================ I/O thread
    def _open_sockets(self) -> None:
        cfg = self.spec.config
        hwm = self.capacity
        own = Addresses(self.spec.bind_dir) if self.spec.bind_dir else self.addr
        self.data_in = pull_socket(self.zctx, own.data(self.name), hwm)
        self.ctl_in = pull_socket(self.zctx, own.control(self.name), 100_000)
        self.status = push_socket(self.zctx, self.addr.status, 100_000)
        # the stage thread's sockets: events to downstream stages and to the caller
        data = {CLIENT: push_socket(self.zctx, self.addr.results, hwm)}
        for e in cfg.outbound(self.name):
            hwm_e = e.capacity or cfg.setting(cfg.stage(e.target), "queue_capacity")
            data[e.target] = push_socket(self.zctx, self.addr.data(e.target), hwm_e)
        self.sender = Sender(
            data, self.waker, on_unencodable=self._unencodable, on_drop=self._dropped
        )
        # the I/O thread's sockets: its own errors to the caller, releases to producers
        self.out: dict[str, zmq.Socket] = {
            CLIENT: push_socket(self.zctx, self.addr.results, 100_000)
        }
        for e in cfg.inbound(self.name):
            self.out[f"ctl:{e.source}"] = push_socket(
                self.zctx, self.addr.control(e.source), 100_000
            )

    def _dropped(self, msg: Any, dest: str) -> None:
        """``msg`` will never reach ``dest``: release its slots on that reader's behalf."""
        own = [
            (h.offset, h.rental)
            for h in getattr(msg, "device_handles", {}).values()
            if isinstance(h, ShmHandle) and h.segment == self.arena.name
        ]
        if own:
            self.arena.release(own, dest)

    def _unencodable(self, msg: Any, exc: Exception, dest: str) -> Error | None:
        """An output that cannot go on the wire fails its request (only): the caller gets
        an error (and cancels the request everywhere); other destinations get nothing."""
        self._dropped(msg, dest)
        if dest != CLIENT:
            return None
        self.stats.errors += 1
        err = Error(
            request_id=msg.request_id,
            stage=self.name,
            message=f"stage {self.name!r}: output cannot be serialized: {exc}",
        )
        err.code = "bad_output"
        return err

    def send_status(self, msg: msgspec.Struct) -> None:
        self.status.send(encode_frame([msg]))

    def io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.ctl_in, zmq.POLLIN)
        poller.register(self.waker.fd, zmq.POLLIN)
        data_on = False
        pollout: set[str] = set()
        interval = self.spec.config.heartbeat_interval_s
        next_beat = 0.0
        while True:
            with self.lock:
                room = len(self.ready) < self.capacity and not self.stopping
            if room and self.stash:
                self._intake()
            if room != data_on:
                if room:
                    poller.register(self.data_in, zmq.POLLIN)
                else:
                    poller.unregister(self.data_in)
                data_on = room
            for dest in pollout:
                poller.register(self.out[dest], zmq.POLLOUT)
            now = time.monotonic()
            timeout = max(0.0, next_beat - now)
            # While the stage streams output, look every gap_s for a batched tail to send,
            # rather than being woken per frame (a wake-up costs a GIL round trip per
            # frame). While it computes without output (a model step), sleep: a tick every
            # gap_s would take the GIL from it a thousand times a second.
            busy = self.sender.waiting > 0 or self.sender.streaming()
            if busy:
                timeout = min(timeout, self.sender.gap_s)
            self.waker.idle = not busy  # before reading the outbox: no wake-up is missed
            if self.outbox.count > 0 and not pollout:
                timeout = 0.0
            events = dict(poller.poll(timeout * 1000))
            self.waker.idle = False
            for dest in pollout:
                poller.unregister(self.out[dest])
            if self.waker.fd in events:
                self.waker.clear()
            if self.ctl_in in events:
                self._drain_control()
            if data_on and self.data_in in events:
                self._drain_data()
            self.sender.flush_due()
            pollout = set(self.outbox.flush(self.out))
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + interval
                self._heartbeat()
                if self.spec.owner_pid and os.getppid() != self.spec.owner_pid:
                    log.error(
                        "orchestrator went away; worker %s exits",
                        self.name,
                        extra={"stage": self.name},
                    )
                    os._exit(3)
            if self.io_done:
                break
        self.outbox.flush(self.out)

    def _heartbeat(self) -> None:
        s = self.stats
        with self.lock:
            s.queue_depth = len(self.ready)
        s.inflight = self.inflight
        s.outbox_depth = self.sender.pending
        s.dropped = self.sender.drops
        s.blocked_s = self.sender.blocked_s + self.arena.blocked_s
        s.window_triggers = self.host.window_triggers
        s.emitted = self.sender.sent
        s.shm_slots_in_use = self.arena.slots_in_use
        spans, self.spans = self.spans, []
        marks, self.marks = self.marks, []
        self.send_status(
            Heartbeat(
                stage=self.name, pid=os.getpid(), ts=time.time(), stats=s, spans=spans, marks=marks
            )
        )

    def _drain_control(self) -> None:
        while True:
            try:
                frame = self.ctl_in.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            for msg in decode_control_frame(frame.buffer):
                if isinstance(msg, Release):
                    if msg.segment == self.arena.name:  # else: meant for an earlier life
                        self.arena.release(msg.slots, msg.reader)
                elif isinstance(msg, ReaderLost):
                    self.arena.forget_reader(msg.reader)
                elif isinstance(msg, SegmentGone):
                    self.codec.reader.forget(msg.segment)
                elif isinstance(msg, Cancel):
                    with self.work:
                        freed = self.host.forget(msg.request_id)
                        kept = [w for w in self.ready if w.inp.request_id != msg.request_id]
                        for w in self.ready:
                            if w.inp.request_id == msg.request_id:
                                freed.extend(w.release)
                        self.ready = deque(kept)
                    self._release(freed)
                    self.send_status(Ack(stage=self.name, kind="cancel", request_id=msg.request_id))
                elif isinstance(msg, Shutdown):
                    self.sender.stop = True  # a producer blocked on a full socket gives up
                    with self.work:
                        self.stopping = True
                        self.drain = msg.drain
                        self.deadline = msg.deadline
                        self.work.notify_all()

    def _drain_data(self) -> None:
        """Take in upstream messages while the work queue has room; the rest of a frame
        waits in ``stash`` so the queue never holds more than ``queue_capacity`` items."""
        for _ in range(64):  # bounded, so control messages are not starved
            if self.stash:
                self._intake()
                if self.stash:
                    return
            try:
                frame = self.data_in.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self.stash.extend(decode_data_frame(frame.buffer))
            except msgspec.DecodeError as e:
                log.error(
                    "stage %s: undecodable frame dropped: %s",
                    self.name,
                    e,
                    extra={"stage": self.name},
                )

    def _intake(self) -> None:
        stash = self.stash
        with self.work:
            while stash and len(self.ready) < self.capacity:
                msg = stash.popleft()
                try:
                    if type(msg) is SegmentRun:
                        room = self.capacity - len(self.ready)
                        items, n = self.host.receive_run(msg, room)
                        if n < len(msg):  # the queue is full: the rest waits
                            stash.appendleft(msg.tail(n))
                        self.stats.received += n
                    elif isinstance(msg, Submit):
                        items = self.host.submit(msg)
                        self.stats.received += 1
                    else:
                        items = self.host.receive(msg)
                        self.stats.received += 1
                        if type(msg) is Completed:
                            self.send_status(
                                Ack(
                                    stage=self.name,
                                    kind="edge_end",
                                    request_id=msg.request_id,
                                    source=msg.stage,
                                )
                            )
                except Exception as e:  # ends this request only; the I/O thread goes on
                    why = str(e) if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
                    own = getattr(msg, "device_handles", {}).values()
                    self.host.releasable.extend(h for h in own if isinstance(h, ShmHandle))
                    self.host.releasable.extend(self.host.forget(msg.request_id))
                    self.outbox.put(CLIENT, self.host.error(msg.request_id, why), block=False)
                    continue
                self.ready.extend(items)
            if self.ready and self.idle_stage:
                self.work.notify()
            freed = self._take_releasable()
        self._release(freed)

    # ================================================================ stage thread
    def _take_releasable(self) -> list[ShmHandle]:
        freed, self.host.releasable = self.host.releasable, []
        return freed

    def _release(self, handles: list[ShmHandle]) -> None:
        """Hand slots back to their producers (through the I/O thread; never blocks)."""
        if not handles:
            return
        for producer, msg in releases(handles, self.name):
            self.outbox.put(f"ctl:{producer}", msg, block=False)

    def _take_batch(self, busy: set[str]) -> list[WorkItem]:
        """First ready item whose request is not running, then up to N-1 more, FIFO."""
        batch: list[WorkItem] = []
        rids: set[str] = set()
        skipped: deque[WorkItem] = deque()
        while self.ready and len(batch) < self.max_batch:
            w = self.ready.popleft()
            rid = w.inp.request_id
            if w.inp.cancelled:
                self.host.releasable.extend(w.release)
                continue
            if rid in busy or rid in rids:  # keep a request's triggers in order
                skipped.append(w)
                continue
            batch.append(w)
            rids.add(rid)
        self.stats.dequeued += len(batch)
        if batch and (self.stash or len(self.ready) + len(batch) >= self.capacity):
            # the I/O thread stopped taking in while the queue was full: room again now
            self.waker.kick()
        self.ready.extendleft(reversed(skipped))
        return batch

    def run(self) -> None:
        active: list[_Active] = []
        while True:
            if not active:
                self.inflight = 0
                self.sender.flush()  # nothing runs: send the tail now, not at the next tick
            with self.work:
                while len(active) < self.max_inflight:
                    busy = {r for a in active for r in a.rids}
                    batch = self._take_batch(busy)
                    if batch:
                        active.append(self._start(batch))
                        self.inflight = len(active)
                        continue
                    if active:
                        break
                    if self.stopping and (not self.drain or not self.ready):
                        return
                    if self.deadline is not None and time.time() > self.deadline:
                        return
                    self.idle_stage = True
                    self.work.wait(0.2)
                    self.idle_stage = False
                self.inflight = len(active)
                freed = self._take_releasable()
            self._release(freed)
            if self.stopping and not self.drain:
                for a in active:
                    a.gen.close()
                return
            if len(active) == 1 and self.max_inflight == 1:
                self._run_to_end(active.pop())
                continue
            for a in list(active):  # round-robin one output per generator
                if not self._step(a):
                    active.remove(a)

    def _start(self, batch: list[WorkItem]) -> _Active:
        gen = self.stage.process([w.inp for w in batch])
        rids = {w.inp.request_id for w in batch}
        return _Active(
            iter(gen), batch, rids, [w.inp._cancelled for w in batch], started=time.time()
        )

    def _run_to_end(self, a: _Active) -> None:
        while self._step(a):
            if self.stopping and not self.drain:  # shutdown: do not finish a long generator
                a.gen.close()
                self._finish(a, failed=True)
                return

    def _step(self, a: _Active) -> bool:
        """Advance one output; False when the generator is done (and the items finished)."""
        if a.cancels[0].is_set() and all(c.is_set() for c in a.cancels):
            a.gen.close()
            self._finish(a, failed=True)
            return False
        try:
            out = next(a.gen)
        except StopIteration:
            self._finish(a, failed=False)
            return False
        except Exception as e:
            tb = traceback.format_exc(limit=8)
            log.error(
                "stage %s failed on %s:\n%s",
                self.name,
                sorted(a.rids),
                tb,
                extra={"stage": self.name, "request_id": ",".join(sorted(a.rids))},
            )
            self._fail_all(a, f"{type(e).__name__}: {e}")
            return False
        if out is None:  # the stage gives the other requests in flight a turn
            return True
        if type(out) is list:
            a.outputs += len(out)
            self._handle_many(out)
        else:
            a.outputs += 1
            self._handle(out)
        return True

    def _handle_many(self, evs: list[StageEvent]) -> None:
        """A list yielded in one step: array-free segments take the fast path."""
        plain = []
        for ev in evs:
            if type(ev) is Segment and "arrays" not in ev.__dict__:
                plain.append(ev)
            else:
                if plain:
                    self._send_plain(plain)
                    plain = []
                self._handle(ev)
        if plain:
            self._send_plain(plain)

    def _send_plain(self, evs: list[Segment]) -> None:
        with self.lock:
            out = self.host.emit_plain(evs)
        if not out:
            return
        if self.trace:
            for m in out:
                if type(m) is SegmentRun:
                    self.marks.extend(
                        TraceMark(m.request_id, m.sequence + k, "segment", ts)
                        for k, ts in enumerate(m.ts)
                    )
                else:
                    self.marks.append(TraceMark(m.request_id, m.sequence, "segment", m.ts))
        events = sum(len(m) if type(m) is SegmentRun else 1 for m in out)
        for d in self.host.data_destinations:
            self.sender.put_many(d, out, events)

    def _handle(self, ev: StageEvent) -> None:
        st = self.host.requests.get(ev.request_id)
        if st is None or st.cancel.is_set():  # ended, cancelled or failed here
            return
        error = type(ev) is Error
        try:
            handles = None if error else self.host.pack(ev)
        except Exception as e:
            self._fail_request(ev.request_id, f"cannot send output: {type(e).__name__}: {e}")
            return
        with self.lock:
            ev, dests = self.host.emit(ev, handles)
            freed = self.host.forget(ev.request_id) if error else None
        droppable = self.host.droppable(ev)
        if self.trace:
            self.marks.append(TraceMark(ev.request_id, ev.sequence, ev.event_type, ev.ts))
        for d in dests:
            self.sender.put(d, ev, droppable)
        if error:
            self.stats.errors += 1
            self._release(freed)

    def _fail_request(self, rid: str, message: str) -> None:
        with self.lock:
            ev = self.host.error(rid, message)
            freed = self.host.forget(rid)
            self.stats.errors += 1
        self.sender.put(CLIENT, ev)
        self._release(freed)

    def _fail_all(self, a: _Active, message: str) -> None:
        for w in a.items:
            if not w.inp.cancelled:
                self._fail_request(w.inp.request_id, message)
        self._finish(a, failed=True)

    def _finish(self, a: _Active, failed: bool) -> None:
        if self.trace:
            first = a.items[0].inp
            index = first.windows and next(iter(first.windows.values())).index or 0
            rids = [w.inp.request_id for w in a.items]
            self.spans.append(TraceSpan(rids, a.started, time.time(), a.outputs, index))
        freed: list[ShmHandle] = []
        sends = []
        with self.lock:
            for w in a.items:
                freed.extend(w.release)
                if not failed and not w.inp.cancelled:
                    sends.extend(self.host.finish(w))
                    if w.inp.last:
                        self.stats.completed += 1
            freed.extend(self._take_releasable())
        for ev, dests in sends:
            for d in dests:
                self.sender.put(d, ev)
        self._release(freed)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging()  # OMNI_LOG_LEVEL, OMNI_LOG_FORMAT (text | json)
    with open(argv[0], "rb") as f:
        spec = decode_json(f.read(), WorkerSpec)
    return serve(spec)


def serve(spec: WorkerSpec) -> int:
    """Load the stage, report Ready (or LoadFailed) and run until shut down; the exit code."""
    sys.setswitchinterval(0.001)  # bound how long the I/O thread waits for the GIL
    t0 = time.monotonic()
    zctx = zmq.Context.instance()
    status = push_socket(zctx, Addresses(spec.socket_dir).status)
    try:
        worker = Worker(spec)
        worker.stage.load()
        worker._open_sockets()
    except BaseException as e:  # report any load failure, then exit non-zero
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        status.send(encode_frame([LoadFailed(stage=spec.stage, pid=os.getpid(), message=detail)]))
        status.close(linger=2000)
        return 1
    status.close(linger=2000)
    # Long-lived objects from the load step never need scanning again, and a stream of
    # short-lived events should not trigger a full collection every few hundred objects.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    # Ready goes out before the I/O thread owns the status socket
    worker.send_status(Ready(stage=spec.stage, pid=os.getpid(), load_s=time.monotonic() - t0))
    io = threading.Thread(target=worker.io_loop, name=f"omni-io-{spec.stage}", daemon=True)
    io.start()
    try:
        worker.run()
    finally:
        try:
            worker.sender.flush()
            worker.stage.close()
        finally:
            worker.io_done = True
            worker.waker.idle = True
            worker.waker.wake()
            io.join(timeout=5)
    return 0
