"""A worker's I/O thread: control messages, upstream intake, output tail, heartbeats."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from omni_core.dataplane.poll_loop import PollLoop
from omni_core.dataplane.serial import (
    BadMessage,
    decode_control_frame,
    decode_data_frame,
    salvage_frame,
)
from omni_core.events import (
    Ack,
    Cancel,
    Heartbeat,
    ReaderLost,
    Release,
    SegmentGone,
    Shutdown,
)
from omni_core.observability.gpu_stats import GpuProbe

if TYPE_CHECKING:
    from collections.abc import Callable

    from omni_core.dataplane.shm import Arena, SegmentReader
    from omni_core.dataplane.transport import Sender, Waker
    from omni_core.worker.state import WorkerState
    from omni_core.worker.work_queue import WorkQueue

log = logging.getLogger("omni.worker")


class IOThread(PollLoop):
    def __init__(
        self,
        state: WorkerState,
        queue: WorkQueue,
        *,
        waker: Waker,
        sender: Sender,
        arena: Arena,
        reader: SegmentReader,
        data_in: zmq.Socket,
        ctl_in: zmq.Socket,
        out: dict[str, zmq.Socket],
        send_status: Callable[[msgspec.Struct], None],
        heartbeat_interval_s: float,
        devices: str | None,
        owner_pid: int,
    ) -> None:
        super().__init__(waker, state.outbox, out)
        self.state = state
        self.name = f"stage {state.name!r} I/O"
        self.queue = queue
        self.sender = sender  # the stage thread's: its tail is sent from here
        self.arena = arena  # this worker's own slots (released by their readers)
        self.reader = reader  # the segments this worker maps
        self.data_in = data_in
        self.ctl_in = ctl_in
        self.send_status = send_status
        self.interval = heartbeat_interval_s
        self.owner_pid = owner_pid  # the orchestrator (0: no check)
        self.next_beat = 0.0
        self.data_on = False
        self.gpu = GpuProbe(devices)
        self.on_message: dict[type, Callable[[Any], None]] = {
            Release: self._release,
            ReaderLost: self._reader_lost,
            SegmentGone: self._segment_gone,
            Cancel: self._cancel,
            Shutdown: self._shutdown,
        }
        """The control messages a worker takes, by type, and what each does."""
        self.watch(ctl_in, self.drain_control)

    def done(self) -> bool:
        return self.state.io_done

    def before_poll(self) -> float:
        room = self.queue.has_room()
        if room and self.queue.stash:
            self.queue.intake()
        if room != self.data_on:  # read upstream only while the work queue has room
            if room:
                self.watch(self.data_in, self.drain_data)
            else:
                self.unwatch(self.data_in)
            self.data_on = room
        timeout = max(0.0, self.next_beat - time.monotonic())
        # While the stage streams output, look every gap_s for a batched tail to send,
        # rather than being woken per frame (a wake-up costs a GIL round trip per
        # frame). While it computes without output (a model step), sleep: a tick every
        # gap_s would take the GIL from it a thousand times a second.
        if not self.may_sleep():
            timeout = min(timeout, self.sender.gap_s)
        return timeout

    def may_sleep(self) -> bool:
        sender = self.sender
        return not (sender.waiting > 0 or sender.streaming())

    def tick(self, events: dict[Any, int]) -> None:
        self.sender.flush_due()
        if time.monotonic() >= self.next_beat:
            self.next_beat = time.monotonic() + self.interval
            self.heartbeat()
            owner = self.owner_pid
            if owner and os.getppid() != owner:
                log.error("orchestrator went away; worker %s exits", self.state.name)
                os._exit(3)

    def heartbeat(self) -> None:
        w, sender = self.state, self.sender
        s = w.stats
        with w.lock:
            s.queue_depth = len(self.queue.ready)
        s.inflight = w.inflight
        s.outbox_depth = sender.pending
        s.dropped = sender.drops
        s.blocked_s = sender.blocked_s + self.arena.blocked_s
        s.window_triggers = w.host.window_triggers
        s.emitted = sender.sent
        s.shm_slots_in_use = self.arena.slots_in_use
        self.gpu.sample(s)
        started = w.step_started
        s.busy_s = time.monotonic() - started if started else 0.0
        spans, w.spans = w.spans, []
        marks, w.marks = w.marks, []
        beat = Heartbeat(
            stage=w.name, pid=os.getpid(), ts=time.time(), stats=s, spans=spans, marks=marks
        )
        self.send_status(beat)

    # -- control -------------------------------------------------------------------
    def drain_control(self) -> None:
        while True:
            try:
                frame = self.ctl_in.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msgs = decode_control_frame(frame.buffer)
            except msgspec.DecodeError:
                msgs, bad = salvage_frame(frame.buffer, "control")
                for b in bad:  # nobody to answer: say it loudly, apply the rest
                    log.error("stage %s: undecodable control message: %s", self.state.name, b.error)
            for msg in msgs:
                self.on_control(msg)

    def on_control(self, msg: Any) -> None:
        """Apply one control message through :attr:`on_message`, by its type."""
        handler = self.on_message.get(type(msg))
        if handler is None:  # decoded, so a known kind, but not one a worker takes
            log.error("stage %s: unexpected control message %r", self.state.name, msg)
            return
        handler(msg)

    def _release(self, msg: Release) -> None:
        if msg.segment == self.arena.name:  # else: meant for an earlier life
            self.arena.release(msg.slots, msg.reader)

    def _reader_lost(self, msg: ReaderLost) -> None:
        self.arena.forget_reader(msg.reader)

    def _segment_gone(self, msg: SegmentGone) -> None:
        self.reader.forget(msg.segment)

    def _cancel(self, msg: Cancel) -> None:
        w = self.state
        with w.work:
            freed = self.queue.drop(msg.request_id)
        w.release(freed)
        self.send_status(Ack(stage=w.name, kind="cancel", request_id=msg.request_id))

    def _shutdown(self, msg: Shutdown) -> None:
        w = self.state
        self.sender.stop = True  # a producer blocked on a full socket gives up
        with w.work:
            w.stopping = True
            w.drain = msg.drain
            w.deadline = msg.deadline
            w.work.notify_all()

    # -- upstream data ---------------------------------------------------------------
    def drain_data(self) -> None:
        """Take in upstream messages while the work queue has room; the rest of a frame
        waits in the stash so the queue never holds more than ``queue_capacity`` items."""
        stash = self.queue.stash
        for _ in range(64):  # bounded, so control messages are not starved
            if stash:
                self.queue.intake()
                if stash:
                    return
            try:
                frame = self.data_in.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                stash.extend(decode_data_frame(frame.buffer))
            except msgspec.DecodeError:
                msgs, bad = salvage_frame(frame.buffer, "data")
                stash.extend(msgs)  # the good messages of the frame still go on
                self.on_bad_messages(bad)

    def on_bad_messages(self, bad: list[BadMessage]) -> None:
        """Upstream messages that do not decode: each fails its own request."""
        for b in bad:
            source = f"stage {b.stage!r}" if b.stage else "upstream"
            why = f"a message from {source} cannot be decoded: {b.error}"
            log.error("stage %s: %s (request %s)", self.state.name, why, b.request_id)
            if b.request_id is not None:
                with self.state.work:
                    self.queue.fail(b.request_id, why, code="bad_message")
                    freed = self.state.take_releasable()
                self.state.release(freed)
