"""Workers forked from the zygote (the default start): they serve as spawned ones do, their
parent is the caller's process, per-stage environments hold, a failed import names its
stage, a killed zygote takes no worker with it and comes back, and nothing outlives the
caller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import psutil
import pytest
from omni_core import Pipeline
from omni_core.config import parse_config
from omni_core.errors import StageStartError
from omni_testing.configs import chain
from omni_testing.faults import stopped


def config(start: str = "zygote", **top):
    cfg = chain(
        ("source", "synthetic.source", {"segment": 4}),
        ("double", "synthetic.map", {"scale": 2}),
        **top,
    )
    cfg["backend"] = {"start": start}
    return cfg


def tokens(pipe: Pipeline, n: int = 4) -> list[list[int]]:
    outs = pipe.generate([{"n": 12} for _ in range(n)])
    assert all(o.finish_reason == "completed" for o in outs), [o.error for o in outs]
    return [[t for e in o.events for t in e.tokens] for o in outs]


def wait_for(what, timeout_s: float = 60.0, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_forked_workers_serve_like_spawned_ones_and_are_the_callers_children():
    with Pipeline(config("spawn")) as pipe:
        assert {h["started"] for h in pipe.health().values()} == {"spawned"}
        assert pipe.zygote()["state"] == "off"
        spawned = tokens(pipe)
    with Pipeline(config()) as pipe:
        z = pipe.zygote()
        assert z["state"] == "ready" and z["start"] == "zygote"
        assert "omni_testing.stages" in z["preloaded"]
        assert {h["started"] for h in pipe.health().values()} == {"forked"}
        for pid in pipe.pids().values():  # CLONE_PARENT: ours, not the zygote's
            assert psutil.Process(pid).ppid() == os.getpid()
        assert tokens(pipe) == spawned
        ours = [z["pid"], *pipe.pids().values()]
    # closed: the zygote and every worker ended and were reaped (no zombie either)
    assert [p for p in ours if psutil.pid_exists(p)] == []


def test_extra_env_reaches_a_forked_worker_and_an_import_time_variable_spawns(monkeypatch):
    # HF_* is read when huggingface_hub loads: a stage changing one is spawned; one
    # setting it to the caller's own value is forked
    monkeypatch.setenv("HF_OMNI_ZYGOTE_SAME", "1")
    monkeypatch.delenv("HF_OMNI_ZYGOTE_NEW", raising=False)
    env = {"OMNI_ZYGOTE_T": "a", "OMP_NUM_THREADS": "1", "HF_OMNI_ZYGOTE_SAME": "1"}
    cfg = chain(
        ("env", "synthetic.env", {}, {"extra_env": env, "client_stream": True}),
        (
            "hub",
            "synthetic.env",
            {},
            {"extra_env": {"HF_OMNI_ZYGOTE_NEW": "b"}, "client_stream": True},
        ),
    )
    with Pipeline(cfg) as pipe:
        h = pipe.health()
        assert h["env"]["started"] == "forked" and h["hub"]["started"] == "spawned"
        assert "HF_OMNI_ZYGOTE_NEW" in pipe.zygote()["spawned_stages"]["hub"]
        names = ["OMNI_ZYGOTE_T", "OMP_NUM_THREADS", "HF_OMNI_ZYGOTE_NEW", "HF_OMNI_ZYGOTE_SAME"]
        out = pipe.generate([{"env": names}])[0]
        seen = {e.stage: e.payload["env"] for e in out.events}
        assert seen["env"]["OMNI_ZYGOTE_T"] == "a" and seen["env"]["OMP_NUM_THREADS"] == "1"
        assert (
            seen["env"]["HF_OMNI_ZYGOTE_SAME"] == "1" and seen["env"]["HF_OMNI_ZYGOTE_NEW"] is None
        )
        assert seen["hub"]["HF_OMNI_ZYGOTE_NEW"] == "b"


def test_a_stage_whose_import_fails_names_itself_and_leaves_no_process():
    cfg = config()
    cfg["stages"].append(
        {"name": "broken", "kind": "synthetic.faulty", "options": {"imports": ["omni_no_such_mod"]}}
    )
    cfg["edges"].append({"from": "double", "to": "broken"})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(StageStartError, match=r"'broken'.*No module named 'omni_no_such_mod'"):
        Pipeline(cfg).start()
    left = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE
    ]
    assert left == []


def test_a_killed_zygote_takes_no_worker_and_comes_back():
    cfg = parse_config(config())
    stages = [msgspec.structs.replace(s, restart_backoff_s=0.0) for s in cfg.stages]
    with Pipeline(msgspec.structs.replace(cfg, stages=stages)) as pipe:
        first = pipe.zygote()["pid"]
        workers = pipe.pids()
        os.kill(first, signal.SIGKILL)
        assert len(tokens(pipe)) == 4  # the workers serve on
        assert pipe.pids() == workers
        # a stage that dies while the zygote is down or preloading is spawned
        os.kill(workers["double"], signal.SIGKILL)
        wait_for(lambda: pipe.health()["double"]["state"] == "ready")
        assert pipe.health()["double"]["started"] in ("spawned", "forked")
        z = wait_for(lambda: (z := pipe.zygote())["state"] == "ready" and z)
        assert z["pid"] != first and z["restarts"] == 1
        assert "killed by SIGKILL" in z["note"]
        # and once it is back, restarts fork again
        os.kill(pipe.pids()["double"], signal.SIGKILL)
        wait_for(lambda: (h := pipe.health()["double"])["state"] == "ready" and h["restarts"] == 2)
        assert pipe.health()["double"]["started"] == "forked"
        assert len(tokens(pipe)) == 4


def test_nothing_outlives_a_sigkilled_caller(tmp_path):
    script = textwrap.dedent(
        """
        import json, sys, time
        from omni_core import Pipeline
        from omni_testing.configs import chain
        cfg = chain(("source", "synthetic.source", {}), ("double", "synthetic.map", {}))
        pipe = Pipeline(cfg).start()
        pids = list(pipe.pids().values()) + [pipe.zygote()["pid"]]
        print(json.dumps(pids), flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()

    def gone():
        alive = []
        for p in pids:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return not alive

    wait_for(gone, timeout_s=10)


def test_a_pipeline_left_open_serves_until_the_interpreter_exits():
    """No ``with``, no close: the workers live until the pipelines' own close at exit
    (the thread their death signal is tied to is not ended before it)."""
    script = textwrap.dedent(
        """
        import atexit, json, sys
        from omni_core import Pipeline
        from omni_testing.configs import chain
        pipe = Pipeline(chain(("source", "synthetic.source", {}), ("m", "synthetic.map", {})))
        pipe.start()
        pids = list(pipe.pids().values())
        def last_request():  # runs before the pipelines are closed (atexit is LIFO)
            out = pipe.generate([{"n": 3}])[0]
            print(json.dumps([out.finish_reason, pids]), flush=True)
        atexit.register(last_request)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    reason, pids = json.loads(out.stdout.strip().splitlines()[-1])
    assert reason == "completed", out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert not any(psutil.pid_exists(p) for p in pids)


def test_a_stopped_zygote_is_replaced_and_the_restart_spawned():
    """SIGSTOP: the zygote is alive but does not answer. The next restart's fork times
    out (2 s), the stopped zygote is killed and started again, the worker is spawned, and
    requests go on meanwhile; /health's view (Pipeline.zygote) says what happened."""
    cfg = parse_config(config())
    stages = [msgspec.structs.replace(s, restart_backoff_s=0.0) for s in cfg.stages]
    with Pipeline(msgspec.structs.replace(cfg, stages=stages)) as pipe:
        zygote = pipe.zygote()["pid"]
        with stopped(zygote):
            old = pipe.pids()["double"]
            os.kill(old, signal.SIGKILL)
            t0 = time.monotonic()
            wait_for(
                lambda: (h := pipe.health()["double"])["pid"] != old and h["state"] == "ready",
                timeout_s=30,
            )
            assert time.monotonic() - t0 < 15  # one fork timeout, not a hung control loop
            assert pipe.health()["double"]["started"] == "spawned"
            assert len(tokens(pipe)) == 4
            z = wait_for(lambda: (z := pipe.zygote())["state"] == "ready" and z)
            assert z["pid"] != zygote and z["restarts"] == 1
            assert "did not answer a fork" in z["note"]
        assert not psutil.pid_exists(zygote)  # killed and reaped, not left stopped
