"""Printing a benchmark's result."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], as_json: bool) -> None:
    machine = {"cpus": _cpus(), "cpu": cpu_model(), "python": platform.python_version()}
    result = {**result, "machine": machine}
    if as_json:
        print(json.dumps(result))
        return
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v}", file=sys.stdout)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def cpu_model() -> str:
    """The CPU's model name, from ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def run_arms(
    arms: str, run: dict[str, Callable[[], dict[str, Any]]], error: Callable[[str], Any]
) -> tuple[dict[str, Any], bool]:
    """Run the comma-separated ``arms`` of ``run`` in order: their results, and whether
    one failed (its result is then ``{"error": ...}``; the others still run). An unknown
    arm goes to ``error`` (argparse's ``ap.error``)."""
    names = [a for a in arms.split(",") if a]
    unknown = sorted(set(names) - set(run))
    if unknown:
        error(f"unknown arms {unknown}; known: {', '.join(run)}")
    res: dict[str, Any] = {}
    failed = False
    for arm in names:
        try:
            res[arm] = run[arm]()
        except Exception as e:  # one arm's failure is reported; the others still run
            res[arm] = {"error": f"{type(e).__name__}: {e}"}
            failed = True
    return res, failed
