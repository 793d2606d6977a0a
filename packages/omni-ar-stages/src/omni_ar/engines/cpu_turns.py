"""Engines on the same CPU cores compute in turns (``cpu_turns:`` of a vLLM stage).

OpenMP compute does not share cores well: a forward pass is a chain of parallel regions,
each ending at a barrier, so one thread descheduled by another process's work stalls all
of its engine's threads. Two engines on one machine (the prefill and decode workers of a
split pipeline) therefore either split the cores (each runs on half of them) or
oversubscribe them (both slow down more than twice). Turns are the third way, what a GPU
does with two processes' kernels: each engine step holds the turn and runs on every core
it was given; the other engine's step waits for it. A waiting engine sleeps in the kernel
(``flock``), so it takes no core while it waits.

The turn is a lock file named after the turn in the machine's shared-memory directory:
engines that name the same turn on one machine take turns, whatever pipeline they are in.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def turn_path(name: str) -> Path:
    """The lock file of turn ``name`` (``/dev/shm`` where there is one, else the temp dir)."""
    if not _NAME.match(name):
        raise ValueError(f"cpu_turns {name!r}: expected 1-64 of A-Z a-z 0-9 _ . -")
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"omni-cpu-turn-{name}"


class CpuTurn:
    """A turn on the cores, held around each engine step (``with turn: engine.step()``).

    ``waited_s`` and ``held_s`` add up the time spent waiting for and holding the turn."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.path = turn_path(name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.waited_s = 0.0
        self.held_s = 0.0
        self._since = 0.0

    def __enter__(self) -> CpuTurn:
        t0 = time.perf_counter()
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self._since = time.perf_counter()
        self.waited_s += self._since - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.held_s += time.perf_counter() - self._since
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Release the file (the lock goes with it if held; the file stays for others)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def cpu_turn(name: str | None, device: str) -> AbstractContextManager:
    """What an engine holds around each forward: turn ``name`` on the CPU, else nothing
    (no turn asked for, or a GPU: it interleaves processes' kernels itself)."""
    return CpuTurn(name) if name and device == "cpu" else nullcontext()
