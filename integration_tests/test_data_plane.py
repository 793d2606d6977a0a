"""Data plane faults: a dead reader's slots, and what a SIGKILLed caller leaves behind."""

import os
import signal
import subprocess
import sys
import textwrap

from omni_core import Pipeline
from omni_core.dataplane.shm import list_segments
from omni_testing.configs import chain
from omni_testing.faults import wait_for

FAST = {"heartbeat_interval_s": 0.05}


def test_a_dead_consumers_slots_go_back_to_its_producer(no_leaked_segments):
    """The consumer dies holding every slot of its producer's pool; the orchestrator's
    ``ReaderLost`` gives them back, else no request after the restart could get a slot."""
    cfg = chain(
        # 256 KiB arrays (shared memory) into a 1 MiB pool: four slots, one request's worth
        ("p", "synthetic.array_source", {"nbytes": 256 << 10, "count": 4}),
        ("d", "synthetic.sleep", {"hold_s": 1.0}, {"restart_backoff_s": 0.1}),
        edges=[{"from": "p", "to": "d", "window": {"size": -1}}],  # d holds all four at once
        shm_pool_bytes=1 << 20,
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        stages = lambda: pipe.metrics()["stages"]  # noqa: E731
        h = pipe.submit({}, timeout_s=20)
        # d is inside its process step over the request's window: it holds the four slots
        wait_for(
            lambda: stages()["p"]["shm_slots_in_use"] == 4 and stages()["d"]["inflight"] == 1,
            5,
            "d to hold the whole pool",
        )
        old = pipe.backend.pids()["d"]
        os.kill(old, signal.SIGKILL)
        events = list(h)
        assert events[-1].event_type == "error" and events[-1].code == "stage_died"
        wait_for(lambda: pipe.health()["d"]["state"] == "ready", 10, "d to restart")
        assert pipe.backend.pids()["d"] != old
        # each request needs the whole pool: three fill it three times over
        outs = pipe.generate([{} for _ in range(3)], timeout_s=12)
        assert [o.ok for o in outs] == [True] * 3, [(o.finish_reason, o.error) for o in outs]
        wait_for(lambda: stages()["p"]["shm_slots_in_use"] == 0, 5, "every slot back")


_CALLER = textwrap.dedent(
    """
    import os, signal, sys
    from omni_core import Pipeline
    from omni_testing.configs import chain
    cfg = chain(("src", "synthetic.array_source", {"nbytes": 1 << 20, "count": 2}),
                ("sink", "synthetic.array_sink", {}))
    with Pipeline(cfg) as pipe:
        assert pipe.generate([{}])[0].ok
        keeper = os.fork()  # shares every open file, the owner locks with them
        if keeper == 0:
            while True:
                signal.pause()
        print(os.getpid(), keeper, pipe.backend.launcher.socket_dir,
              *pipe.backend.pids().values(), flush=True)
        for line in sys.stdin:  # one request per line, until stdin closes
            print(pipe.generate([{}], timeout_s=10)[0].ok, flush=True)
    """
)


def _caller():
    """A caller process with a pipeline, and its keeper: a child forked after the
    pipeline started, that holds the caller's owner locks (it shares their open files)
    until killed. While the keeper lives, what a SIGKILLed caller leaves is no orphan, so
    no pipeline started meanwhile by anything else on the machine sweeps it first."""
    p = subprocess.Popen(
        [sys.executable, "-c", _CALLER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    pid, keeper, socket_dir, *workers = p.stdout.readline().split()
    return p, int(pid), int(keeper), socket_dir, [int(w) for w in workers]


def _gone(pid: int) -> bool:
    """The process has exited (its files are closed): gone, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    wait_for(lambda: _gone(pid), 5, f"process {pid} gone")


def test_a_sigkilled_callers_leftovers_go_at_the_next_start_and_a_live_ones_stay():
    dead, dead_pid, dead_keeper, dead_dir, dead_workers = _caller()
    live, live_pid, live_keeper, live_dir, _ = _caller()
    _kill(live_keeper)  # the live caller holds its own locks
    try:
        dead.kill()
        dead.wait()
        for pid in dead_workers:  # they die with their parent
            wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 5, f"worker {pid} gone")
        assert list_segments(dead_pid) and os.path.isdir(dead_dir)  # left behind
        assert any(f.endswith(".spec.json") for f in os.listdir(dead_dir))
        _kill(dead_keeper)  # orphans now
        cfg = chain(("m", "synthetic.map", {}))
        with Pipeline(cfg) as pipe:  # the next start sweeps them
            assert list_segments(dead_pid) == []
            assert not os.path.exists(dead_dir)
            assert list_segments(live_pid) and os.path.isdir(live_dir)  # never a live one's
            assert pipe.generate([{"n": 2}])[0].ok
            mine = pipe.backend.launcher.socket_dir
        assert not os.path.exists(mine)  # close removes the socket dir and spec files
        live.stdin.write("go\n")
        live.stdin.flush()
        assert live.stdout.readline().strip() == "True"  # the live pipeline still serves
    finally:
        for pid in (dead_keeper, live_keeper):
            _kill(pid)
        for p in (dead, live):
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=15)
    assert list_segments(live_pid) == [] and not os.path.exists(live_dir)
