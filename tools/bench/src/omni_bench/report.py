"""Printing a benchmark's result."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable
from typing import Any


def emit(result: dict[str, Any], as_json: bool) -> None:
    result = {**result, "machine": {"cpus": _cpus(), "python": platform.python_version()}}
    if as_json:
        print(json.dumps(result))
        return
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v}", file=sys.stdout)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


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
