"""The worker process: its spec, its parts (the stage, its host, sockets, the two threads'
loops and the state they share), and its life (load, ready handshake, run, shut down)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from omni_core.config import PipelineConfig
from omni_core.dataplane.serial import ArrayCodec, decode_json, encode_frame
from omni_core.dataplane.shm import EXTERNAL_WRITERS, Arena, SegmentReader, owner_prefix
from omni_core.dataplane.transport import (
    Addresses,
    Outbox,
    Sender,
    Waker,
    control_dest,
    pull_socket,
    push_socket,
)
from omni_core.events import Error, LoadFailed, Ready, ShmHandle
from omni_core.observability.logs import configure_logging
from omni_core.registry import load_stage_class
from omni_core.worker.host import CLIENT, StageHost, stage_context
from omni_core.worker.io_thread import IOThread
from omni_core.worker.stage_thread import StageThread
from omni_core.worker.state import WorkerState
from omni_core.worker.work_queue import WorkQueue

log = logging.getLogger("omni.worker")
IO_FAILED_EXIT = 70  # the I/O thread failed: the worker exits, the orchestrator restarts it


class WorkerSpec(msgspec.Struct, kw_only=True):
    """Everything a worker needs, written by the orchestrator into its socket directory."""

    stage: str
    worker: str = ""  # this worker's name: ``STAGE#i`` for a replica ("": the stage's)
    config: PipelineConfig
    socket_dir: str
    arena: str  # the shared-memory segment this stage writes into
    owner_pid: int = 0  # the orchestrator's pid: the worker exits if it goes away (0: no check)
    devices: str | None = None
    # where the worker binds its own inbound sockets, when not ``socket_dir`` (the Ray
    # backend: senders reach it through the node's gateway, which binds ``socket_dir``)
    bind_dir: str | None = None


class Worker:
    """One stage's worker: the stage, its host, its sockets, and its parts (the work queue,
    the state both threads share, and, once the sockets are open, the threads' loops)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        cfg = spec.config
        # the worker's own name (sockets, its arena's producer name, status messages) and
        # its stage's (config, the events it stamps): they differ for a replica
        self.name = spec.worker or spec.stage
        self.stage_name = spec.stage
        st = cfg.stage(self.stage_name)
        self.max_inflight = cfg.setting(st, "max_inflight")
        self.max_batch = cfg.setting(st, "max_batch_size")
        self.capacity = cfg.setting(st, "queue_capacity")
        self.addr = Addresses(spec.socket_dir)
        cls = load_stage_class(st.kind)
        self.stage = cls(stage_context(cfg, self.stage_name, spec.devices))
        self.arena = Arena(spec.arena)
        # the segments this worker maps: its pipeline's on this node (its own arena's owner)
        reader = SegmentReader(scope=owner_prefix(spec.arena))
        self.codec = ArrayCodec(self.name, self.arena, reader, threshold=cfg.shm_threshold_bytes)
        self.host = StageHost(cfg, self.stage_name, self.stage, self.codec)
        self.waker = Waker()
        outbox = Outbox(self.waker, capacity=max(64, self.capacity * 4))
        self.state = WorkerState(self.name, self.host, outbox)
        self.queue = WorkQueue(
            self.state,
            self.capacity,
            self.waker,
            self.stage_name,
            self.send_status,
            by_priority=cfg.setting(st, "scheduler_policy") == "priority",
        )
        self.zctx = zmq.Context()

    def open_sockets(self) -> None:
        cfg = self.spec.config
        hwm = self.capacity
        own = Addresses(self.spec.bind_dir) if self.spec.bind_dir else self.addr
        self.data_in = pull_socket(self.zctx, own.data(self.name), hwm)
        self.ctl_in = pull_socket(self.zctx, own.control(self.name), 100_000)
        self.status = push_socket(self.zctx, self.addr.status, 100_000)
        # the stage thread's sockets: events to downstream stages and to the caller
        # (one socket per replica a downstream stage may have: each request's events go to
        # the replica it is bound to)
        data = {CLIENT: push_socket(self.zctx, self.addr.results, hwm)}
        for e in cfg.outbound(self.stage_name):
            hwm_e = e.capacity or cfg.setting(cfg.stage(e.target), "queue_capacity")
            for target in cfg.workers(e.target):
                data[target] = push_socket(self.zctx, self.addr.data(target), hwm_e)
        self.sender = Sender(
            data, self.waker, on_unencodable=self._unencodable, on_drop=self._dropped
        )
        # the I/O thread's sockets: its own errors to the caller, releases to producers
        self.out: dict[str, zmq.Socket] = {
            CLIENT: push_socket(self.zctx, self.addr.results, 100_000)
        }
        for e in cfg.inbound(self.stage_name):
            for source in cfg.workers(e.source):
                self.out[control_dest(source)] = push_socket(
                    self.zctx, self.addr.control(source), 100_000
                )

    def stage_loop(self) -> StageThread:
        """The stage thread's loop (after :meth:`open_sockets`: it sends through the
        sender)."""
        return StageThread(
            self.state,
            self.queue,
            self.stage,
            self.sender,
            max_inflight=self.max_inflight,
            max_batch=self.max_batch,
            trace=self.spec.config.trace,
        )

    def io_loop(self) -> IOThread:
        """The I/O thread's loop (after :meth:`open_sockets`: it owns them from then on)."""
        return IOThread(
            self.state,
            self.queue,
            waker=self.waker,
            sender=self.sender,
            arena=self.arena,
            reader=self.codec.reader,
            data_in=self.data_in,
            ctl_in=self.ctl_in,
            out=self.out,
            send_status=self.send_status,
            heartbeat_interval_s=self.spec.config.heartbeat_interval_s,
            devices=self.spec.devices,
            owner_pid=self.spec.owner_pid,
        )

    def send_status(self, msg: msgspec.Struct) -> None:
        self.status.send(encode_frame([msg]))

    def _dropped(self, msg: Any, dest: str) -> None:
        """``msg`` will never reach ``dest``: release its slots (and what an external
        writer stored for it) on that reader's behalf."""
        handles = getattr(msg, "device_handles", {}).values()
        handles = [h for h in handles if isinstance(h, ShmHandle)]
        own = [(h.offset, h.rental) for h in handles if h.segment == self.arena.name]
        if own:
            self.arena.release(own, dest)
        writer = EXTERNAL_WRITERS.get(self.name)
        if writer is not None:
            for h in handles:
                if h.segment != self.arena.name:
                    writer.cancel(h.segment, {dest: 1})

    def _unencodable(self, msg: Any, exc: Exception, dest: str) -> Error | None:
        """An output that cannot go on the wire fails its request (only): the caller gets
        an error (and cancels the request everywhere); other destinations get nothing."""
        self._dropped(msg, dest)
        if dest != CLIENT:
            return None
        self.state.stats.errors += 1
        return Error(
            request_id=msg.request_id,
            stage=self.stage_name,
            message=f"stage {self.stage_name!r}: output cannot be serialized: {exc}",
            code="bad_output",
        )

    def io_failed(self, exc: BaseException) -> None:
        """The I/O thread cannot go on: without it nothing moves, so the worker ends (the
        orchestrator sees the death, fails or replays its requests, and restarts it)."""
        log.critical(
            "stage %s: its I/O thread failed (%s: %s); the worker exits",
            self.name,
            type(exc).__name__,
            exc,
            extra={"stage": self.name},
        )
        logging.shutdown()
        os._exit(IO_FAILED_EXIT)


def _current_gpu(devices: str | None) -> None:
    """A worker given GPUs makes the first one current before its stage loads (only when
    the stage's module brought torch in: a worker never imports it for nothing)."""
    torch = sys.modules.get("torch")
    if devices and torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging()  # OMNI_LOG_LEVEL, OMNI_LOG_FORMAT (text | json)
    with open(argv[0], "rb") as f:
        spec = decode_json(f.read(), WorkerSpec)
    return serve(spec)


def name_process(name: str) -> None:
    """Show ``name`` as the process's name in ``ps``, ``top`` and ``/proc/PID/comm``
    (Linux keeps its first 15 bytes), so a stage's worker can be told from the others."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def serve(spec: WorkerSpec) -> int:
    """Load the stage, report Ready (or LoadFailed) and run until shut down; the exit code."""
    sys.setswitchinterval(0.001)  # bound how long the I/O thread waits for the GIL
    name = spec.worker or spec.stage
    name_process(f"omni:{name}")
    t0 = time.monotonic()
    zctx = zmq.Context.instance()
    status = push_socket(zctx, Addresses(spec.socket_dir).status)
    try:
        worker = Worker(spec)
        _current_gpu(spec.devices)
        worker.stage.load()
        worker.open_sockets()
    except BaseException as e:  # report any load failure, then exit non-zero
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        status.send(encode_frame([LoadFailed(stage=name, pid=os.getpid(), message=detail)]))
        status.close(linger=2000)
        return 1
    status.close(linger=2000)
    # Long-lived objects from the load step never need scanning again, and a stream of
    # short-lived events should not trigger a full collection every few hundred objects.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    # Ready goes out before the I/O thread owns the status socket
    worker.send_status(Ready(stage=name, pid=os.getpid(), load_s=time.monotonic() - t0))
    io, stage_thread = worker.io_loop(), worker.stage_loop()
    thread = threading.Thread(
        target=io.run, args=(worker.io_failed,), name=f"omni-io-{name}", daemon=True
    )
    thread.start()
    try:
        stage_thread.run()
    finally:
        try:
            worker.sender.flush()
            worker.stage.close()
        finally:
            worker.state.io_done = True
            worker.waker.idle = True
            worker.waker.wake()
            thread.join(timeout=5)
    return 0
