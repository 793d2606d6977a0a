"""Fault injection for tests: kill a stage's worker, wait for its restart, wait for a
condition, hold a stage's requests until the test lets them go, start a child process
that holds something until told, stop a process for a while."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any


def kill_stage(pipe: Any, stage: str, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to ``stage``'s worker process; returns its pid."""
    pid = pipe.backend.pids()[stage]
    os.kill(pid, sig)
    return pid


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[int]:
    """``pid`` SIGSTOPped for the block (alive, answering nothing), then SIGCONTinued if
    it still lives: the runtime may have killed it meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def wait_ready(pipe: Any, stage: str, timeout_s: float = 60.0) -> bool:
    """Wait until ``stage`` reports ready again (after a restart); False on timeout."""
    end = time.monotonic() + timeout_s
    while pipe.health()[stage]["state"] != "ready":
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)
    return True


def wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` every 20 ms until it is true; AssertionError after ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Gate:
    """A file ``synthetic.sleep`` (``until_file``) holds its requests until: they go on
    once the test calls :meth:`open`, whatever the load, never on a timer. (A pipeline
    closed with requests still held ends them at once.)"""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = os.path.join(directory, "gate")

    def open(self) -> None:
        with open(self.path, "a"):
            pass


def child_reporting(script: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    """Run ``python -c script args...``; returns it and the first line it prints (what it
    made), once printed. It lives until its stdin is closed or it is killed."""
    p = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline().strip()  # type: ignore[union-attr]
    assert line, "the child process did not start"
    return p, line
