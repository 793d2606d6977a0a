"""Shared-memory data plane: segments the orchestrator owns, arenas producers rent from.

* :class:`SegmentOwner` (orchestrator) creates every segment file under ``/dev/shm``,
  owner-only (0600), and unlinks them at shutdown. Segment names carry the owner's pid, so
  a later run can sweep segments whose owner was killed (:func:`sweep_stale`).
* :class:`Arena` (producer worker) maps its stage's segment and sub-allocates slots in it.
  A slot is rented for a set of readers and returns to the free list when the last reader
  has released it (readers send :class:`~omni_core.events.Release` messages back).
* :class:`SegmentReader` (any reader) maps segments on first use and hands out read-only
  views; it never copies.

Plain ``open``/``mmap`` are used rather than ``multiprocessing.shared_memory`` because on
Python < 3.13 the latter registers every attach with a resource tracker that may unlink a
segment behind the owner's back.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

SHM_DIR = "/dev/shm"
PREFIX = "omni-"
ALIGN = 64


class ShmPoolExhausted(RuntimeError):
    """A payload could not get a slot before its deadline."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink segments left by an owner process that no longer exists."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def list_segments(owner_pid: int | None = None, directory: str = SHM_DIR) -> list[str]:
    """Segment names of this runtime (of one owner when ``owner_pid`` is given)."""
    prefix = PREFIX if owner_pid is None else f"{PREFIX}{owner_pid}-"
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith(prefix))
    except FileNotFoundError:
        return []


class SegmentOwner:
    """Creates and unlinks the segments of one pipeline; lives in the orchestrator."""

    def __init__(self, directory: str = SHM_DIR, token: str | None = None) -> None:
        self.directory = directory
        self.token = token or secrets.token_hex(4)  # tells this pipeline's segments apart
        self._names: list[str] = []
        self._serial = itertools.count()  # names are never reused, even after an unlink
        sweep_stale(directory)

    def create(self, label: str, size: int) -> str:
        """Create a sparse segment of ``size`` bytes; pages cost memory only once written."""
        name = f"{PREFIX}{os.getpid()}-{self.token}-{label}-{next(self._serial)}"
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self._names.append(name)
        return name

    def unlink(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.directory, name))
        except FileNotFoundError:
            pass
        if name in self._names:
            self._names.remove(name)

    def unlink_all(self) -> None:
        for name in list(self._names):
            self.unlink(name)

    @property
    def names(self) -> list[str]:
        return list(self._names)


def map_segment(name: str, directory: str = SHM_DIR) -> mmap.mmap:
    fd = os.open(os.path.join(directory, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


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
        self.buf = map_segment(name, directory)
        self.size = len(self.buf)
        self._free: list[tuple[int, int]] = [(0, self.size)]  # sorted (offset, length)
        self._slots: dict[int, _Slot] = {}
        self._cond = threading.Condition()
        self.blocked_s = 0.0
        self.unknown_releases = 0
        self._rentals = itertools.count(1)

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
        earlier rental of the same offset cannot free the current one.
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
            rental = next(self._rentals)
            self._slots[off] = _Slot(length, rental, {r: n for r, n in readers.items() if n > 0})
            if not self._slots[off].readers:  # nobody will read it: free at once
                self._drop(off)
            return off, rental

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


class SegmentReader:
    """Maps segments on first use; the mappings live as long as the reader."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        self.directory = directory
        self._maps: dict[str, mmap.mmap] = {}

    def buffer(self, name: str) -> mmap.mmap:
        buf = self._maps.get(name)
        if buf is None:
            buf = self._maps[name] = map_segment(name, self.directory)
        return buf

    def forget(self, name: str) -> None:
        """Drop a mapping (its segment was replaced); live views keep the pages."""
        self._maps.pop(name, None)
