"""Printing a benchmark's result."""

from __future__ import annotations

import json
import platform
import sys
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
