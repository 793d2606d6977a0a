"""Shared-memory data plane: segments the orchestrator owns, arenas producers rent from.

* :class:`SegmentOwner` (orchestrator) creates every segment file under ``/dev/shm``,
  owner-only (0600), holds an exclusive ``flock`` on each for as long as it owns it, and
  unlinks them at shutdown. A later run sweeps the segments whose lock is free: their
  owner was killed (:func:`sweep_stale`). The lock, not the pid in the name, says whether
  an owner lives: pids get reused, and another pid namespace may share ``/dev/shm``.
* :class:`Arena` (producer worker) maps its stage's segment and sub-allocates slots in it.
  A slot is rented for a set of readers and returns to the free list when the last reader
  has released it (readers send :class:`~omni_core.events.Release` messages back).
  Segments are made sparse (their pages cost memory only once used); the arena gives a
  slot its pages (``posix_fallocate``) before the slot is written, so a full ``/dev/shm``
  fails the request that needed the room (:class:`ShmSpaceExhausted`, naming the segment,
  its size and the free space), never the producer (a write to a page tmpfs cannot give
  is a SIGBUS).
* :class:`SegmentReader` (any reader) maps segments read-only on first use and hands out
  read-only views; it never copies, and a reader cannot write into a slot its fan-out
  peers share (a write through the mapping raises, a view is not writeable).

A segment name and span that arrive in a message are not trusted (:func:`map_segment`,
:meth:`SegmentReader.checked`): only a name this runtime makes (:data:`SEGMENT_NAME`: no
path separator, so never outside the directory), opened without following a link and
without blocking (a FIFO), a private regular file of this user, and a span inside it are
mapped; anything else is a :class:`BadSegment` naming the segment. Each name carries fresh
randomness, so another user cannot guess the next one, and a name found taken is retried
under another (:meth:`SegmentOwner.create`).

Plain ``open``/``mmap`` are used rather than ``multiprocessing.shared_memory`` because on
Python < 3.13 the latter registers every attach with a resource tracker that may unlink a
segment behind the owner's back.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

SHM_DIR = "/dev/shm"
PREFIX = "omni-"
ALIGN = 64
# a segment's label: a worker's name (config NAME_RE, "#i" for a replica)
LABEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.#-]*")
# omni-<owner pid>-<token>-<label>-<serial>-<16 random hex digits>: how SegmentOwner.create
# names a segment, and the only names a reader maps
SEGMENT_NAME = re.compile(r"(omni-\d+-[0-9A-Za-z]+-)(" + LABEL.pattern + r")-(\d+)-([0-9a-f]{16})")
# what a sweep takes for a segment of this runtime (earlier runtimes' names, without the
# random part, included)
STALE_NAME = re.compile(r"omni-(\d+)-([0-9A-Za-z]+)-(.+)-(\d+)(?:-[0-9a-f]{16})?")
NAME_MAX = 255
CREATE_TRIES = 100
BACK_CHUNK = 1 << 20  # an arena gives its segment pages this much at a time

log = logging.getLogger("omni.shm")

# Segments that are not files here: a name prefix -> what returns such a segment's bytes (a
# read-only buffer). A backend that carries arrays its own way registers one (omni-ray:
# objects in Ray's object store); :meth:`SegmentReader.buffer` asks it, never caching.
EXTERNAL_SEGMENTS: dict[str, Callable[[str], Any]] = {}


class ExternalWriter(Protocol):
    """A backend's cheaper way to a producer's readers for a large array than a slot
    (omni-ray: Ray's object store, when every reader is on another node)."""

    def write(self, flat: Any, readers: dict[str, int]) -> str | None:
        """Store ``flat`` (a flat uint8 array) for ``readers`` (name -> count): the name
        of the segment it now is (offset 0, found through :data:`EXTERNAL_SEGMENTS`), or
        None: the producer writes it into a slot as usual."""

    def cancel(self, segment: str, readers: dict[str, int]) -> None:
        """The message carrying ``segment`` will not reach ``readers``: let it go."""


# A producer stage's name -> its process's external writer, asked by ArrayCodec.pack for
# every array it would put in a slot.
EXTERNAL_WRITERS: dict[str, ExternalWriter] = {}


class ShmPoolExhausted(RuntimeError):
    """A payload could not get a slot before its deadline."""


class ShmSpaceExhausted(ShmPoolExhausted):
    """The filesystem of a segment (``/dev/shm``) has no room left for the pages a slot
    needs: the request fails, the producer goes on."""


def free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes an unprivileged user may still take in ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class BadSegment(ValueError):
    """A segment a message names, or a span of it, that is not mapped: not a name this
    runtime makes, not its producer's, not a private regular file of this user, or a span
    past its end. Fails only the message's request."""

    def __init__(self, segment: str, why: str) -> None:
        super().__init__(f"segment {segment!r}: {why}")
        self.segment = segment


def fresh_suffix() -> str:
    """The random part of a new segment's name (a test may replace it to force a clash)."""
    return secrets.token_hex(8)


def check_segment_name(name: str) -> re.Match[str]:
    """The match of ``name`` against :data:`SEGMENT_NAME`; :class:`BadSegment` else."""
    m = SEGMENT_NAME.fullmatch(name) if len(name) <= NAME_MAX else None
    if m is None:
        raise BadSegment(name[:NAME_MAX], "not a name this runtime gives its segments")
    return m


def owner_prefix(name: str) -> str:
    """``omni-<pid>-<token>-``: what every segment of ``name``'s owner starts with."""
    return check_segment_name(name).group(1)


def segment_label(name: str) -> str:
    """The label (the producer worker's name) of a segment this runtime named."""
    return check_segment_name(name).group(2)


def check_span(segment: str, offset: int, nbytes: int, size: int) -> None:
    """:class:`BadSegment` unless ``nbytes`` bytes at ``offset`` lie inside ``size``."""
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise BadSegment(segment, f"{nbytes} bytes at offset {offset} lie outside its {size} bytes")


def create_locked(path: str, mode: int = 0o600) -> int | None:
    """Create ``path`` (it must not exist) and take an exclusive ``flock`` on it; the fd,
    which holds the lock until it is closed.

    None when a sweeper of another process removed the file between its creation and the
    lock (it found it unlocked: taken for a dead owner's): the caller retries under a new
    name. The lock lives on the open file description, so a child process (spawned with
    ``close_fds``) does not hold it, and two owners in one process exclude each other.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, mode)
    except FileNotFoundError:  # its directory was swept away meanwhile
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a sweeper holds it only while it removes the file
        st, own = os.stat(path), os.fstat(fd)
        if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
            return fd
    except FileNotFoundError:
        pass
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def lock_orphan(path: str, kind: int = stat.S_IFREG) -> int | None:
    """An fd holding ``path``'s lock when ``path`` is a private (no group or other access)
    file of ``kind`` of this user, not a link, and no live owner holds its lock (its owner
    is gone); else None.

    Never raises for a file it may not open (another user's, EACCES, EPERM, gone). The
    caller removes the file while it holds the returned fd, then closes it.
    """
    fd = None
    try:
        st = os.lstat(path)
        if (
            stat.S_IFMT(st.st_mode) != kind
            or st.st_uid != os.geteuid()
            or st.st_mode & 0o077  # ours are created 0600 (0700 a directory)
        ):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        own = os.fstat(fd)
        if (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino):  # not replaced meanwhile
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # EWOULDBLOCK: a live owner
            return fd
    except OSError:
        pass
    if fd is not None:
        os.close(fd)
    return None


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink segments whose owner is gone (their lock is free); returns their names.

    Only files named like this runtime's segments, owned by this user, private (0600) and
    not locked by a live owner are removed. Anything else (another user's file, one this
    process may not open or unlink, a live pipeline's segment) is skipped: a sweep never
    fails a start.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not STALE_NAME.fullmatch(name):
            continue
        path = os.path.join(directory, name)
        fd = lock_orphan(path)
        if fd is None:
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except OSError as e:  # EPERM, EACCES, gone meanwhile: not ours to remove
            log.debug("stale segment %s left in place: %s", path, e)
        finally:
            os.close(fd)
    return removed


def list_segments(owner_pid: int | None = None, directory: str = SHM_DIR) -> list[str]:
    """Segment names of this runtime (of one owner when ``owner_pid`` is given)."""
    prefix = PREFIX if owner_pid is None else f"{PREFIX}{owner_pid}-"
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith(prefix))
    except FileNotFoundError:
        return []


class SegmentOwner:
    """Creates and unlinks the segments of one pipeline; lives in the orchestrator.

    Each segment is locked (``flock``) by this owner from its creation to its unlink, so
    no other pipeline's sweep removes it while the owner lives, and every sweep after the
    owner's death (SIGKILL included: the kernel drops the lock) does.
    """

    def __init__(self, directory: str = SHM_DIR, token: str | None = None) -> None:
        self.directory = directory
        self.token = token or secrets.token_hex(4)  # tells this pipeline's segments apart
        self._names: list[str] = []
        self._locks: dict[str, int] = {}  # segment -> the fd holding its owner lock
        self._serial = itertools.count()  # names are never reused, even after an unlink
        sweep_stale(directory)

    @property
    def prefix(self) -> str:
        """What every segment of this owner's starts with (:func:`owner_prefix`)."""
        return f"{PREFIX}{os.getpid()}-{self.token}-"

    def create(self, label: str, size: int) -> str:
        """Create a sparse segment of ``size`` bytes; its pages cost memory only once its
        arena gives them to a slot (:meth:`Arena.rent`). A size over the free space of the
        directory's filesystem is warned about: the requests that need more will fail.

        A name found taken (a file another process or user made under it) is logged and
        retried under a fresh name: never fatal unless every try fails."""
        if not LABEL.fullmatch(label):
            raise ValueError(f"segment label {label!r} is not a worker name")
        taken = 0
        for _ in range(CREATE_TRIES):
            name = f"{self.prefix}{label}-{next(self._serial)}-{fresh_suffix()}"
            path = os.path.join(self.directory, name)
            try:
                fd = create_locked(path)
            except FileExistsError:
                taken += 1
                log.warning("shared-memory segment name %s is taken; trying another", path)
                continue
            if fd is not None:
                break
        else:  # taken, or another process's sweep kept removing it: something is badly wrong
            raise OSError(
                f"cannot create a shared-memory segment for {label!r} in {self.directory}: "
                f"{CREATE_TRIES} names tried ({taken} taken, the others removed as made)"
            )
        try:
            os.ftruncate(fd, size)
            free = free_bytes(self.directory)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        if free < size:
            log.warning(
                "shared-memory segment %s is %d bytes, more than the %d free in %s: a "
                "request whose arrays do not fit fails (lower shm_pool_bytes or free space)",
                path,
                size,
                free,
                self.directory,
            )
        self._locks[name] = fd
        self._names.append(name)
        return name

    def unlink(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.directory, name))
        except FileNotFoundError:
            pass
        fd = self._locks.pop(name, None)
        if fd is not None:  # after the unlink: a sweep never sees it unlocked
            os.close(fd)
        if name in self._names:
            self._names.remove(name)

    def unlink_all(self) -> None:
        for name in list(self._names):
            self.unlink(name)

    @property
    def names(self) -> list[str]:
        return list(self._names)


def map_segment(name: str, directory: str = SHM_DIR, readonly: bool = False) -> mmap.mmap:
    """Map a whole segment: read-write for its producer, read-only (``PROT_READ``) for a
    reader, so a reader's write through the mapping raises instead of reaching the slot
    (checked by :func:`open_segment`)."""
    fd = open_segment(name, directory, readonly)
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE)
    finally:
        os.close(fd)


def open_segment(name: str, directory: str = SHM_DIR, readonly: bool = False) -> int:
    """An fd of a segment (the caller closes it). Only a name this runtime makes, opened
    without following a link or blocking, that is a private non-empty regular file of this
    user: else :class:`BadSegment` (a segment that is gone stays a ``FileNotFoundError``:
    its producer died)."""
    check_segment_name(name)
    path = os.path.join(directory, name)
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | (os.O_RDONLY if readonly else os.O_RDWR))
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a link; EACCES: another user's; ENXIO: a socket
        raise BadSegment(name, f"cannot be opened: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadSegment(name, "not a regular file")
        if st.st_uid != os.geteuid():
            raise BadSegment(name, f"owned by uid {st.st_uid}, not this user")
        if st.st_mode & 0o077:
            raise BadSegment(name, f"mode {stat.S_IMODE(st.st_mode):o} is not private (0600)")
        if st.st_size == 0:
            raise BadSegment(name, "empty")
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class _Slot:
    nbytes: int
    rental: int  # which rental of this offset; a stale release names an older one
    readers: dict[str, int] = field(default_factory=dict)  # reader -> outstanding refs


class Arena:
    """First-fit allocator over one segment, with per-reader reference counts.

    Thread-safe: the stage thread rents while the I/O thread applies releases.
    """

    def __init__(self, name: str, directory: str = SHM_DIR) -> None:
        self.name = name
        self.directory = directory
        self._fd = open_segment(name, directory)  # kept: slots are given pages through it
        try:
            self.buf = mmap.mmap(self._fd, 0, access=mmap.ACCESS_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        self.size = len(self.buf)
        self._backed = 0  # [0, _backed) has its pages: a write there is never a SIGBUS
        self._free: list[tuple[int, int]] = [(0, self.size)]  # sorted (offset, length)
        self._slots: dict[int, _Slot] = {}
        self._cond = threading.Condition()
        self.blocked_s = 0.0
        self.unknown_releases = 0

    # -- allocation ---------------------------------------------------------------
    def _take(self, length: int) -> int | None:
        for i, (off, size) in enumerate(self._free):
            if size >= length:
                if size == length:
                    del self._free[i]
                else:
                    self._free[i] = (off + length, size - length)
                return off
        return None

    def _give(self, off: int, length: int) -> None:
        free = self._free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, (off, length))
        # coalesce with the right then the left neighbour
        if lo + 1 < len(free) and off + length == free[lo + 1][0]:
            free[lo] = (off, length + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0]:
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]

    def rent(
        self, nbytes: int, readers: dict[str, int], timeout: float | None = 30.0
    ) -> tuple[int, int]:
        """Reserve a slot read by ``readers`` (name -> count); blocks while the arena is full.

        Returns (offset, rental id); a release must name both, so a late release of an
        earlier rental of the same offset cannot free the current one. Rental ids are
        random (63 bits), so a release cannot be forged by counting.
        """
        length = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        if length > self.size:
            raise ShmPoolExhausted(
                f"payload of {nbytes} bytes is larger than the shared-memory pool "
                f"({self.size} bytes); raise shm_pool_bytes"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            off = self._take(length)
            if off is None:
                t0 = time.monotonic()
                while off is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self.blocked_s += time.monotonic() - t0
                        raise ShmPoolExhausted(
                            f"no shared-memory slot of {nbytes} bytes freed within {timeout}s "
                            f"({len(self._slots)} slots held by readers)"
                        )
                    self._cond.wait(left)
                    off = self._take(length)
                self.blocked_s += time.monotonic() - t0
            try:
                self._back(off + length)
            except ShmSpaceExhausted:
                self._give(off, length)
                raise
            # unguessable (not a counter): a forged release cannot name the current rental
            rental = secrets.randbits(63) or 1
            self._slots[off] = _Slot(length, rental, {r: n for r, n in readers.items() if n > 0})
            if not self._slots[off].readers:  # nobody will read it: free at once
                self._drop(off)
            return off, rental

    def _back(self, end: int) -> None:
        """Give the segment its pages up to ``end`` (by :data:`BACK_CHUNK`):
        :class:`ShmSpaceExhausted` when its filesystem has no room for them."""
        if end <= self._backed:
            return
        new = min(self.size, -(-end // BACK_CHUNK) * BACK_CHUNK)
        try:
            os.posix_fallocate(self._fd, self._backed, new - self._backed)
        except OSError as e:
            try:
                free = f"{free_bytes(self.directory)} bytes free"
            except OSError:
                free = "free space unknown"
            raise ShmSpaceExhausted(
                f"shared-memory segment {self.name!r} ({self.size} bytes) cannot have "
                f"{new - self._backed} more bytes at offset {self._backed}: "
                f"{e.strerror or errno.errorcode.get(e.errno or 0, e)} ({free} in "
                f"{self.directory})"
            ) from None
        self._backed = new

    def _drop(self, off: int) -> None:
        slot = self._slots.pop(off)
        self._give(off, slot.nbytes)
        self._cond.notify_all()

    def release(self, slots: list[tuple[int, int]], reader: str) -> None:
        """``reader`` is done with these (offset, rental) slots."""
        with self._cond:
            for off, rental in slots:
                slot = self._slots.get(off)
                if slot is None or slot.rental != rental or reader not in slot.readers:
                    self.unknown_releases += 1
                    continue
                slot.readers[reader] -= 1
                if slot.readers[reader] <= 0:
                    del slot.readers[reader]
                if not slot.readers:
                    self._drop(off)

    def cancel(self, slot: tuple[int, int]) -> None:
        """Free a slot whatever its readers (its message was never sent)."""
        with self._cond:
            s = self._slots.get(slot[0])
            if s is not None and s.rental == slot[1]:
                self._drop(slot[0])

    def forget_reader(self, reader: str) -> int:
        """Drop every reference ``reader`` holds (it died); returns how many slots freed."""
        freed = 0
        with self._cond:
            for off in list(self._slots):
                slot = self._slots[off]
                if slot.readers.pop(reader, None) is not None and not slot.readers:
                    self._drop(off)
                    freed += 1
        return freed

    @property
    def slots_in_use(self) -> int:
        return len(self._slots)

    @property
    def bytes_free(self) -> int:
        with self._cond:
            return sum(size for _, size in self._free)

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:  # views still alive; the mapping goes with the process
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SegmentReader:
    """Maps segments read-only on first use; the mappings live as long as the reader.

    A view of a slot stays valid as long as its slot is not released: once the reader's
    release reaches the producer, the producer may write another payload there.
    """

    def __init__(self, directory: str = SHM_DIR, scope: str | None = None) -> None:
        """``scope``: the prefix (:func:`owner_prefix`) of the only segments (besides
        :data:`EXTERNAL_SEGMENTS`) this reader maps: its pipeline's on this node."""
        self.directory = directory
        self.scope = scope
        self._maps: dict[str, mmap.mmap] = {}

    def buffer(self, name: str) -> Any:
        buf = self._maps.get(name)
        if buf is None:
            for prefix, resolve in EXTERNAL_SEGMENTS.items():
                if name.startswith(prefix):
                    return resolve(name)  # read once (not cached): its reader lends it
            if self.scope is not None and not name.startswith(self.scope):
                raise BadSegment(name[:NAME_MAX], "not a segment of this pipeline")
            buf = self._maps[name] = map_segment(name, self.directory, readonly=True)
        return buf

    def checked(self, name: str, offset: int, nbytes: int, producer: str | None = None) -> Any:
        """:meth:`buffer` of a segment a message names, once the message's claims are
        checked: a segment here is ``producer``'s own (its label), and the span lies
        inside it."""
        external = any(name.startswith(p) for p in EXTERNAL_SEGMENTS)
        if producer is not None and not external and segment_label(name) != producer:
            raise BadSegment(name, f"not a segment of its producer {producer!r}")
        buf = self.buffer(name)
        check_span(name, offset, nbytes, len(buf))
        return buf

    def forget(self, name: str) -> None:
        """Drop a mapping (its segment was replaced); live views keep the pages."""
        self._maps.pop(name, None)
