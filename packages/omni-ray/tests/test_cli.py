"""``omni run --backend ray`` from the command line (a Ray of its own on this machine), and
what a user sees when a backend is missing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omni_core import Pipeline
from omni_core.registry import RegistryError

ROOT = Path(__file__).resolve().parents[3]


def test_omni_run_with_the_ray_backend_starts_ray_and_streams_the_demo():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_core.cli",
            "run",
            str(ROOT / "configs/demo.yaml"),
            "--backend",
            "ray",
            "--address",
            "local",
            "--input",
            '{"n": 10}',
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert events[-1]["event_type"] == "completed"
    joined = [t for e in events if e.get("stage") == "join" for t in e.get("tokens") or []]
    assert joined == [3 * t + 1000 for t in range(10)]  # double (2t) + shift (t + 1000)


def test_an_unknown_backend_is_an_error_that_names_it_and_the_known_ones():
    cfg = {"stages": [{"name": "s", "kind": "synthetic.source"}], "backend": {"kind": "nope"}}
    with pytest.raises(RegistryError, match=r"backend 'nope'.*known: ray"):
        Pipeline(cfg)
