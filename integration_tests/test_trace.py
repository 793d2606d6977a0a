"""Traces: every trigger and emitted event recorded, written as Chrome trace JSON."""

import json
import subprocess
import sys
import time

import pytest
from omni_core import Pipeline
from omni_testing.configs import chain


def test_trace_records_every_trigger_and_shows_stage_overlap():
    cfg = chain(
        *[(f"s{i}", "synthetic.sleep", {"hold_s": 0.05}) for i in range(3)],
        trace=True,
        heartbeat_interval_s=0.05,
    )
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([{} for _ in range(4)])
        time.sleep(0.2)
        trace = pipe.trace()
    assert all(o.ok for o in outs)
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    by_stage = {f"s{i}": [e for e in spans if e["cat"] == f"s{i}"] for i in range(3)}
    assert {s: len(v) for s, v in by_stage.items()} == {"s0": 4, "s1": 4, "s2": 4}
    ids = {o.request_id for o in outs}
    assert {r for e in spans for r in e["args"]["requests"]} == ids
    marks = [e for e in events if e["ph"] == "i"]
    assert {e["cat"] for e in marks} == {"s0", "s1", "s2", "client"}
    # two stages busy at the same time on different requests
    overlaps = [
        (a, b)
        for a in by_stage["s0"]
        for b in by_stage["s1"]
        if a["args"]["requests"] != b["args"]["requests"]
        and min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"]) > 10_000
    ]
    assert overlaps
    rows = {e["args"]["name"].split()[0] for e in events if e["name"] == "thread_name"}
    assert rows == {"s0", "s1", "s2", "client"}


def test_trace_needs_tracing_on():
    pipe = Pipeline(chain(("s", "synthetic.sleep", {"hold_s": 0.0})))
    with pipe, pytest.raises(RuntimeError, match="trace: true"):
        pipe.trace()


def test_omni_trace_writes_a_chrome_trace(tmp_path):
    out = tmp_path / "t.json"
    cmd = "import sys; from omni_core.cli import main; sys.exit(main())"
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            cmd,
            "trace",
            "configs/demo.yaml",
            "--requests",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    stages = {e["cat"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert stages == {"source", "double", "shift", "join"}
