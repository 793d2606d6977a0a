"""The ``bench_json`` fixture: a benchmark run as its users run it, ``omni bench NAME ...
--json`` in a process of its own, its JSON result parsed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

# dtype auto runs text models in float32 here, as the tests' references are, whatever the
# CPU (its workers inherit this); OMNI_CPU_BF16=1 runs them as a BF16 CPU would
os.environ.setdefault("OMNI_CPU_BF16", "0")

OMNI = [sys.executable, "-c", "import sys; from omni_core.cli import main; sys.exit(main())"]


def run_bench(name: str, args: list[str], timeout_s: float = 120) -> dict[str, Any]:
    """The result of ``omni bench NAME ARGS --json``; its stderr on a non-zero exit."""
    out = subprocess.run(
        [*OMNI, "bench", name, *args, "--json"], capture_output=True, text=True, timeout=timeout_s
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def bench_json() -> Callable[..., dict[str, Any]]:
    return run_bench
