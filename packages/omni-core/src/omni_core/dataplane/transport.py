"""Sockets and the outbox: how messages move between processes on one machine.

Every process has one I/O thread that owns its zmq sockets (they are not thread-safe);
other threads hand it messages through an :class:`Outbox` and wake it through an eventfd.
Messages to one destination that pile up while a socket is busy leave as one frame.
Sockets are ``ipc://`` files in a directory only the owner can open (mode 0700).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NewType

import zmq

from omni_core.dataplane.serial import encode_events_into, encode_frame
from omni_core.dataplane.shm import create_locked, lock_orphan

MAX_FRAME_MESSAGES = 256  # coalesce at most this many messages into one frame
STREAMING_S = 0.01  # a stage that emitted this recently is streaming (see Sender.streaming)
# Zero-copy sends hand the buffer to zmq's garbage-collector thread; below this size a
# plain copy is cheaper than that bookkeeping.
_ZERO_COPY_MIN = 4 << 20
_FRAME_BUFFER_KEEP = 16 << 20  # a sender's frame buffer larger than this is let go
_IPC_PATH_MAX = 100
STATUS = "orchestrator.status"  # workers -> orchestrator: ready, heartbeats, acks
RESULTS = "client.results"  # streaming stages -> the caller's collector

Dest = NewType("Dest", str)
"""An :class:`Outbox` destination that is not a stage's data edge: a worker's control or
data socket as the orchestrator (or an upstream worker) addresses it. Made only by
:func:`control_dest` and :func:`data_dest`, never spelled out."""


def control_dest(worker: str) -> Dest:
    """Where control messages to ``worker`` (releases, reader changes, shutdown) go."""
    return Dest(f"ctl:{worker}")


def data_dest(worker: str) -> Dest:
    """Where the orchestrator sends ``worker``'s submissions (a source stage's input)."""
    return Dest(f"data:{worker}")


SOCKET_DIR_PREFIX = "omni-"
OWNER_LOCK = ".owner.lock"  # in a socket directory, locked by its owner while it lives
_owned_dirs: dict[str, int] = {}  # socket directory -> the fd holding its owner lock


def make_socket_dir() -> str:
    """A fresh private directory for this pipeline's sockets (and worker spec files).

    This process holds the directory's owner lock (``.owner.lock`` in it, ``flock``) until
    :func:`remove_socket_dir`, or its death; first the directories of dead owners (a
    predecessor killed with SIGKILL) are swept (:func:`sweep_socket_dirs`).
    """
    for path in [p for p in _owned_dirs if not os.path.isdir(p)]:  # removed by its user
        os.close(_owned_dirs.pop(path))
    sweep_socket_dirs()
    for _ in range(100):
        path = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)  # mkdtemp creates it 0700
        fd = create_locked(os.path.join(path, OWNER_LOCK))
        if fd is not None:
            _owned_dirs[path] = fd
            return path
        shutil.rmtree(path, ignore_errors=True)  # another process's sweep took it meanwhile
    raise OSError(f"cannot create a socket directory in {tempfile.gettempdir()}")


def remove_socket_dir(path: str) -> None:
    """Remove a socket directory made by :func:`make_socket_dir`, then drop its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _owned_dirs.pop(path, None)
    if fd is not None:
        os.close(fd)


def sweep_socket_dirs(directory: str | None = None) -> list[str]:
    """Remove the socket directories of dead owners; returns their paths.

    Only this user's private directories named ``omni-*`` in the temp directory that hold
    an owner lock file no live process holds are removed. A directory without that file
    (another program's, or an older runtime's) or that this process may not remove is left
    alone, and a live pipeline's is locked: a sweep never fails a start.
    """
    directory = directory or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = [e.path for e in os.scandir(directory) if e.name.startswith(SOCKET_DIR_PREFIX)]
    except OSError:
        return removed
    for path in entries:
        if path in _owned_dirs:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            continue
        fd = lock_orphan(os.path.join(path, OWNER_LOCK))
        if fd is None:  # no lock file, a live owner's, or not ours
            continue
        try:
            shutil.rmtree(path)  # while the lock is held: no owner can take it meanwhile
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


class Addresses:
    """ipc:// endpoints of one pipeline, derived from its socket directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def endpoint(self, name: str) -> str:
        """The ipc:// address of endpoint ``name`` (``stage.data``, ``client.results`` ...)."""
        path = os.path.join(self.directory, name)
        if len(path) > _IPC_PATH_MAX:
            path = os.path.join(self.directory, hashlib.sha1(name.encode()).hexdigest()[:16])
        return f"ipc://{path}"

    @staticmethod
    def names(stages: list[str]) -> list[str]:
        """Every endpoint of a pipeline with these stages."""
        return [f"{s}.{kind}" for s in stages for kind in ("data", "ctl")] + [STATUS, RESULTS]

    def data(self, stage: str) -> str:
        return self.endpoint(f"{stage}.data")

    def control(self, stage: str) -> str:
        return self.endpoint(f"{stage}.ctl")

    @property
    def status(self) -> str:
        return self.endpoint(STATUS)

    @property
    def results(self) -> str:
        return self.endpoint(RESULTS)


# what a socket needs before it connects or binds (the Ray backend's CURVE keys, say)
SocketSetup = Callable[[zmq.Socket], None]


def _socket(
    ctx: zmq.Context, kind: int, options: dict[int, int], setup: SocketSetup | None
) -> zmq.Socket:
    """A socket of ``kind`` with ``options`` set, then ``setup`` run: ready to connect or bind."""
    s = ctx.socket(kind)
    for option, value in options.items():
        s.setsockopt(option, value)
    if setup is not None:
        setup(s)
    return s


def push_socket(
    ctx: zmq.Context, address: str, hwm: int = 1000, setup: SocketSetup | None = None
) -> zmq.Socket:
    s = _socket(ctx, zmq.PUSH, {zmq.SNDHWM: hwm, zmq.LINGER: 2000, zmq.IMMEDIATE: 0}, setup)
    s.connect(address)
    return s


def pull_socket(
    ctx: zmq.Context, address: str, hwm: int = 1000, setup: SocketSetup | None = None
) -> zmq.Socket:
    s = _socket(ctx, zmq.PULL, {zmq.RCVHWM: hwm, zmq.LINGER: 0}, setup)
    s.bind(address)
    return s


class Waker:
    """Wakes an I/O thread blocked in ``poll``; cheap when it is not blocked."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.idle = False

    def wake(self) -> None:
        if self.idle:
            os.eventfd_write(self.fd, 1)

    def kick(self) -> None:
        """Wake it even if it does not look idle (it may be about to block)."""
        os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)


class Sender:
    """The stage thread's own sockets to its data destinations: batching and backpressure.

    Batching: an event that follows the previous flush by more than ``gap_s`` goes out at
    once (a sparse stream adds no latency); faster events are coalesced into frames of up
    to ``MAX_FRAME_MESSAGES``; the I/O thread sends a tail left waiting (:meth:`flush_due`).

    Backpressure: when a destination's socket is full (its high watermark reached), frames
    wait here. Must-deliver events keep queueing until ``max_pending`` of them wait for one
    destination; then the stage thread blocks until the socket takes them (counted in
    ``blocked_s``). Droppable events (previews) never block: while a destination is
    congested, a newer preview of a request replaces the waiting one (counted in ``drops``).
    """

    def __init__(
        self,
        sockets: dict[str, zmq.Socket],
        waker: Waker,
        gap_s: float = 1e-3,
        max_pending: int = 4 * MAX_FRAME_MESSAGES,
        on_unencodable: Callable[[Any, Exception, str], Any] | None = None,
        on_drop: Callable[[Any, str], None] | None = None,
    ) -> None:
        self.sockets = sockets
        # (message, error, destination) -> a replacement (e.g. an error event) or None
        self.on_unencodable = on_unencodable
        self.on_drop = on_drop  # (message, destination): a coalesced-away preview
        self.waker = waker
        self.gap_s = gap_s
        self.max_pending = max_pending
        self.lock = threading.Lock()
        self.buffers: dict[str, list[Any]] = {d: [] for d in sockets}
        self.counts: dict[str, int] = dict.fromkeys(sockets, 0)  # events waiting (in runs too)
        self.must: dict[str, int] = dict.fromkeys(sockets, 0)  # must-deliver waiting
        self.stalled: dict[str, bytes] = {}  # a frame the socket refused, sent first
        self.previews: dict[tuple[str, str], int] = {}  # (dest, request) -> buffer index
        self.waiting = 0
        self.last_flush = 0.0
        self.last_put = 0.0
        self.blocked_s = 0.0
        self.drops = 0
        self.sent = 0
        self.stop = False
        # frames are encoded into one reused buffer: a fresh bytes object per frame costs
        # more than the copy zmq makes of it (its pages, and regrowth as it is written)
        self.frame = bytearray()

    def streaming(self) -> bool:
        """Output came within the last ``STREAMING_S``: more is likely to follow soon."""
        return time.perf_counter() - self.last_put < STREAMING_S

    def put(self, dest: str, msg: Any, droppable: bool = False) -> None:
        with self.lock:
            buf = self.buffers[dest]
            if droppable and dest in self.stalled:
                key = (dest, msg.request_id)
                old = self.previews.get(key)
                if old is not None:  # newest kept
                    if self.on_drop is not None:
                        self.on_drop(buf[old], dest)
                    buf[old] = None
                    self.drops += 1
                    self.waiting -= 1
                    self.counts[dest] -= 1
                self.previews[key] = len(buf)
            elif not droppable:
                self.must[dest] += 1
            buf.append(msg)
            self.waiting += 1
            self.counts[dest] += 1
            if self._flush_if_due(dest):
                return
        self.waker.wake()  # no-op while the I/O thread already ticks (it is streaming)

    def put_many(self, dest: str, msgs: list[Any], events: int) -> None:
        """Must-deliver messages in order, as one step; they hold ``events`` events (a
        :class:`~omni_core.events.SegmentRun` holds many)."""
        with self.lock:
            self.buffers[dest].extend(msgs)
            self.waiting += events
            self.counts[dest] += events
            self.must[dest] += events
            if self._flush_if_due(dest):
                return
        self.waker.wake()

    def _flush_if_due(self, dest: str) -> bool:
        """(Lock held.) Send now if a frame is full or the stream is sparse; then wait if
        ``dest`` is past its must-deliver watermark. False: the tail is left to the I/O
        thread's tick."""
        now = self.last_put = time.perf_counter()
        if self.waiting < MAX_FRAME_MESSAGES and now - self.last_flush <= self.gap_s:
            return False
        self._flush(now)
        if self.must[dest] >= self.max_pending:
            self._block(dest)
        return True

    def due(self) -> float | None:
        """Seconds until the I/O thread should flush, or None when nothing waits."""
        if not self.waiting and not self.stalled:
            return None
        return max(0.0, self.last_flush + self.gap_s - time.perf_counter())

    def flush_due(self) -> None:
        if (self.waiting or self.stalled) and self.lock.acquire(blocking=False):
            try:
                if time.perf_counter() - self.last_flush >= self.gap_s:
                    self._flush(time.perf_counter())
            finally:
                self.lock.release()

    def flush(self) -> None:
        if self.waiting or self.stalled:
            with self.lock:
                self._flush(time.perf_counter())

    @property
    def pending(self) -> int:
        return self.waiting + len(self.stalled)

    def _flush(self, now: float) -> None:
        """Send what each destination's socket takes without blocking."""
        for dest, buf in self.buffers.items():
            frame = self.stalled.get(dest)
            if frame is not None:
                if not self._try_send(dest, frame):
                    continue  # still full: keep buffering (previews coalesce meanwhile)
                del self.stalled[dest]
            if not buf:
                continue
            msgs = [m for m in buf if m is not None]
            frame = self.frame
            try:
                encode_events_into(msgs, frame)
            except (TypeError, ValueError, OverflowError):
                encode_events_into(self._encodable(msgs, dest), frame)
            self.sent += self.counts[dest]
            self.waiting -= self.counts[dest]
            self.counts[dest] = 0
            self.must[dest] = 0
            buf.clear()
            if not self._try_send(dest, frame):
                self.stalled[dest] = bytes(frame)  # the buffer is reused
        if len(self.frame) > _FRAME_BUFFER_KEEP:
            self.frame = bytearray()
        self.previews = {k: i for k, i in self.previews.items() if self.buffers[k[0]]}
        self.last_flush = now

    def _try_send(self, dest: str, frame: bytes | bytearray) -> bool:
        try:  # a bytearray (the reused buffer) is copied; a large stalled frame needs not be
            copy = type(frame) is bytearray or len(frame) < _ZERO_COPY_MIN
            self.sockets[dest].send(frame, zmq.NOBLOCK, copy=copy)
            return True
        except zmq.Again:
            return False

    def _block(self, dest: str) -> None:
        """Wait until ``dest`` takes what waits for it (the must-deliver high watermark)."""
        t0 = time.monotonic()
        poller = zmq.Poller()
        poller.register(self.sockets[dest], zmq.POLLOUT)
        while not self.stop and (dest in self.stalled or self.must[dest] >= self.max_pending):
            poller.poll(100)
            self._flush(time.perf_counter())
        self.blocked_s += time.monotonic() - t0

    def _encodable(self, buf: list[Any], dest: str) -> list[Any]:
        """A message in ``buf`` cannot be encoded: replace or drop it, keep the others."""
        good = []
        for msg in buf:
            try:
                encode_frame([msg])
                good.append(msg)
            except (TypeError, ValueError, OverflowError) as e:
                if self.on_unencodable is not None:
                    replacement = self.on_unencodable(msg, e, dest)
                    if replacement is not None:
                        good.append(replacement)
        return good


class Outbox:
    """Bounded per-destination message queues drained by the I/O thread.

    ``put`` from the stage thread blocks while more than ``capacity`` messages wait (the
    time is counted in ``blocked_s``): backpressure reaches the producer instead of memory
    growing. The I/O thread's own messages (acks, releases, errors) never block.
    """

    def __init__(self, waker: Waker, capacity: int = 1024) -> None:
        self.waker = waker
        self.capacity = capacity
        self.queues: dict[str, deque[Any]] = {}
        self.stalled: dict[str, bytes] = {}  # an encoded frame the socket refused
        self.count = 0
        self.cond = threading.Condition()
        self.blocked_s = 0.0
        self.sent = 0

    def put(self, dest: str, msg: Any, block: bool = True) -> None:
        with self.cond:
            q = self.queues.get(dest)
            if q is None:
                q = self.queues[dest] = deque()
            q.append(msg)
            self.count += 1
            self.waker.wake()
            if block and self.count > self.capacity:
                t0 = time.monotonic()
                while self.count > self.capacity:
                    self.cond.wait(0.5)
                self.blocked_s += time.monotonic() - t0

    def pending(self) -> bool:
        return self.count > 0 or bool(self.stalled)

    def flush(self, sockets: dict[str, zmq.Socket]) -> list[str]:
        """Send what waits; returns the destinations whose socket is full (poll POLLOUT)."""
        stalled = []
        for dest in list(self.stalled):
            try:
                sockets[dest].send(self.stalled[dest], zmq.NOBLOCK, copy=False)
                del self.stalled[dest]
            except zmq.Again:
                stalled.append(dest)
        for dest, q in list(self.queues.items()):
            if dest in self.stalled or not q:
                continue
            with self.cond:
                n = min(len(q), MAX_FRAME_MESSAGES)
                batch = [q.popleft() for _ in range(n)]
            frame = encode_frame(batch)
            with self.cond:
                self.count -= n
                self.cond.notify_all()
            self.sent += n
            sock = sockets.get(dest)
            if sock is None:  # destination unknown (already closed): drop
                continue
            try:
                sock.send(frame, zmq.NOBLOCK, copy=len(frame) < _ZERO_COPY_MIN)
            except zmq.Again:
                self.stalled[dest] = frame
                stalled.append(dest)
        return stalled
