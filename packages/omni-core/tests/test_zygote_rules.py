"""The zygote's rules without a pipeline: which extra_env keys force a spawn, when a fork
is refused, and its wire messages."""

from __future__ import annotations

import subprocess
import sys

from omni_core.control.worker_env import inherited_env
from omni_core.control.zygote import (
    Fork,
    Forked,
    _decoder,
    _encoder,
    import_time_keys,
)


def test_only_changed_import_time_variables_force_a_spawn():
    base = {"HF_HUB_OFFLINE": "1", "PATH": "/bin"}
    assert import_time_keys({"OMNI_X": "1", "CUDA_VISIBLE_DEVICES": "0"}, base) == []
    # thread counts are applied after the fork, the same value changes nothing
    assert import_time_keys({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, base) == []
    keys = import_time_keys(
        {"HF_HUB_OFFLINE": "0", "LD_PRELOAD": "x.so", "OMP_PROC_BIND": "1"}, base
    )
    assert keys == ["HF_HUB_OFFLINE", "LD_PRELOAD", "OMP_PROC_BIND"]


def test_a_zygote_with_a_thread_refuses_to_fork():
    code = (
        "import threading, time; from omni_core.control.zygote import fork_unsafe; "
        "print(repr(fork_unsafe())); "
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start(); "
        "print(repr(fork_unsafe()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    before, after = out.stdout.splitlines()
    assert before == "''"
    assert "2 threads" in after


def test_wire_messages_round_trip():
    msg = Fork(worker="w#1", spec_path="/tmp/x.spec.json", env={"A": "b"})
    assert _decoder.decode(_encoder.encode(msg)) == msg
    assert _decoder.decode(_encoder.encode(Forked(12))) == Forked(12)


def test_no_worker_environment_carries_the_api_key(monkeypatch):
    """Every worker's environment (spawned, the zygote's, a Ray actor's ``OMNI_``
    variables) is made by ``inherited_env``: never with the server's key."""
    monkeypatch.setenv("OMNI_API_KEY", "sekrit")
    monkeypatch.setenv("OMNI_SOME_SETTING", "1")
    monkeypatch.setenv("UNRELATED", "2")
    everything, forwarded = inherited_env(), inherited_env("OMNI_")
    assert "OMNI_API_KEY" not in everything and "OMNI_API_KEY" not in forwarded
    assert everything["UNRELATED"] == "2" and "UNRELATED" not in forwarded
    assert forwarded["OMNI_SOME_SETTING"] == "1"
