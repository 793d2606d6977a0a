"""Fault injection for tests: kill a stage's worker, wait for its restart."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def kill_stage(pipe: Any, stage: str, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to ``stage``'s worker process; returns its pid."""
    pid = pipe.backend.pids()[stage]
    os.kill(pid, sig)
    return pid


def wait_ready(pipe: Any, stage: str, timeout_s: float = 60.0) -> bool:
    """Wait until ``stage`` reports ready again (after a restart); False on timeout."""
    end = time.monotonic() + timeout_s
    while pipe.health()[stage]["state"] != "ready":
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)
    return True
