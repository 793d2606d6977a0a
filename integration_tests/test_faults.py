"""Flow control and faults: backpressure, cancel and timeout, crashes, restarts, shutdown."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from omni_core import Pipeline
from omni_core.dataplane.shm import list_segments
from omni_core.errors import StageDeadError
from omni_testing.configs import chain
from omni_testing.faults import wait_for

FAST = {"heartbeat_interval_s": 0.05}


def test_slow_sink_depth_stays_bounded_and_every_event_arrives(no_leaked_segments):
    # 4 KB events (inline), so what zmq and the kernel buffer is a few frames, not thousands
    cfg = chain(
        ("src", "synthetic.source", {"segment": 1, "array_bytes": 4096}),
        ("slow", "synthetic.sleep", {"hold_s": 0.0005}, {"queue_capacity": 4}),
        edges=[{"from": "src", "to": "slow", "window": {"size": 1}, "capacity": 1}],
        **FAST,
    )
    depths = []
    with Pipeline(cfg) as pipe:
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                depths.append(pipe.metrics()["stages"]["slow"]["queue_depth"])
                time.sleep(0.01)

        t = threading.Thread(target=sample)
        t.start()
        # far more events than every buffer on the way holds (frames of up to 256 in
        # the sockets, one decoded frame at the sink) plus the 1,024-event watermark
        out = pipe.generate([{"n": 8000}])[0]
        stop.set()
        t.join()
        # past the must-deliver watermark the producer was held back, and it was measured
        wait_for(lambda: pipe.metrics()["stages"]["src"]["blocked_s"] > 0, 3, "blocked time")
    assert out.ok
    assert out.tokens == list(range(8000))  # every must-deliver event arrived, in order
    assert len(depths) > 10 and max(depths) <= 4


def test_previews_coalesce_under_backpressure_and_the_final_image_arrives():
    cfg = chain(
        ("gen", "synthetic.previews", {"steps": 300, "size": 64}),
        ("slow", "synthetic.sleep", {"hold_s": 0.01}, {"queue_capacity": 1}),
        edges=[{"from": "gen", "to": "slow", "window": {"size": 1}, "capacity": 1}],
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        out = pipe.generate([{}])[0]
        wait_for(lambda: pipe.metrics()["stages"]["gen"]["dropped"] > 0, 3, "drop count")
        time.sleep(0.2)  # a heartbeat sent after the request ended carries the final count
        dropped = pipe.metrics()["stages"]["gen"]["dropped"]
    assert out.ok, out.error
    steps = [s for e in out.events for s in e.payload.get("steps", [])]
    assert steps[-1] == 300  # the final (must-deliver) image
    assert steps == sorted(steps)  # newest kept, order intact
    assert len(steps) + dropped == 301


@pytest.mark.parametrize("where", ["queued", "in_stage"])
def test_cancel_reaches_the_stage_and_frees_everything(where, no_leaked_segments):
    cfg = chain(
        ("src", "synthetic.array_source", {"nbytes": 256 << 10, "count": 50}),
        ("slow", "synthetic.sleep", {"hold_s": 0.05}),
        edges=[{"from": "src", "to": "slow", "window": {"size": 1}}],
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        blocker = pipe.submit({})  # occupies the slow stage
        target = pipe.submit({}) if where == "queued" else blocker
        time.sleep(0.3)
        assert pipe.cancel(target.request_id)
        events = list(target)
        assert [e.event_type for e in events if e.terminal] == ["cancelled"]
        if where == "queued":
            assert list(blocker)[-1].event_type == "completed"
        assert pipe.generate([{"count": 1}])[0].ok
        wait_for(
            lambda: all(s["shm_slots_in_use"] == 0 for s in pipe.metrics()["stages"].values()),
            5,
            "slots to return",
        )
        wait_for(lambda: pipe.metrics()["cancel_acks"] >= 2, 5, "cancel acks")


def test_timeout_while_queued_and_in_stage():
    cfg = chain(("slow", "synthetic.sleep", {"hold_s": 0.5}))
    with Pipeline(cfg) as pipe:
        a = pipe.submit({}, timeout_s=0.2)  # times out inside the stage
        b = pipe.submit({}, timeout_s=0.3)  # times out while queued behind a
        for h in (a, b):
            ev = list(h)
            assert [e.event_type for e in ev] == ["cancelled"] and ev[0].reason == "timeout"
        assert pipe.metrics()["counts"]["timeout"] == 2


def test_sigkill_mid_request_errors_restarts_and_serves_again(no_leaked_segments):
    cfg = chain(
        ("src", "synthetic.source", {"segment": 1, "delay_s": 0.02}),
        ("f", "synthetic.faulty", {}, {"restart_backoff_s": 0.1}),
        edges=[{"from": "src", "to": "f", "window": {"size": 1}}],
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        done = pipe.generate([{"n": 3}])[0]
        assert done.ok
        h = pipe.submit({"n": 500})
        next(iter(h))
        old_pid = pipe.backend.pids()["f"]
        t0 = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        events = list(h)
        assert time.monotonic() - t0 < 2.0
        assert events[-1].event_type == "error" and events[-1].code == "stage_died"
        assert "'f'" in events[-1].message and "SIGKILL" in events[-1].message
        assert not pipe.healthy
        wait_for(lambda: pipe.health()["f"]["state"] == "ready", 10, "restart")
        assert pipe.backend.pids()["f"] != old_pid
        outs = pipe.generate([{"n": 4} for _ in range(3)])
        assert all(o.ok for o in outs) and outs[0].tokens == [0, 1, 2, 3]
        assert pipe.metrics()["stages"]["f"]["restarts"] == 1
        assert pipe.healthy


def test_idempotent_stage_is_replayed_after_a_crash(no_leaked_segments):
    cfg = chain(
        ("src", "synthetic.source", {"segment": 2, "delay_s": 0.01}),
        ("m", "synthetic.replayable_map", {"scale": 3}, {"restart_backoff_s": 0.1}),
        edges=[{"from": "src", "to": "m", "window": {"size": 2}}],
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        h = pipe.submit({"n": 200})
        it = iter(h)
        first = [next(it) for _ in range(5)]
        os.kill(pipe.backend.pids()["m"], signal.SIGKILL)
        rest = list(it)
        counts = pipe.metrics()["counts"]
    events = first + rest
    assert events[-1].event_type == "completed", events[-1]
    tokens = [t for e in events if e.event_type == "segment" for t in e.tokens]
    assert tokens == [3 * t for t in range(200)]  # nothing lost, nothing twice
    assert [e.sequence for e in events] == list(range(len(events)))
    assert counts["replayed"] == 1


def test_stage_dead_after_max_restarts_fails_fast():
    cfg = chain(("f", "synthetic.faulty", {}, {"max_restarts": 1, "restart_backoff_s": 0.05}))
    with Pipeline(cfg) as pipe:
        for _ in range(2):
            wait_for(lambda: pipe.health()["f"]["state"] == "ready", 10, "ready")
            out = pipe.generate([{"crash": True}])[0]
            assert out.finish_reason == "error" and "exited with code 9" in out.error
        wait_for(lambda: pipe.health()["f"]["state"] == "dead", 5, "dead")
        t0 = time.monotonic()
        with pytest.raises(StageDeadError, match="stage 'f' is dead.*after 1 restarts"):
            pipe.submit({})
        assert time.monotonic() - t0 < 0.5
        assert not pipe.healthy


def test_shutdown_while_busy_ends_every_request(no_leaked_segments):
    cfg = chain(
        ("src", "synthetic.source", {"segment": 1, "delay_s": 0.05}), ("m", "synthetic.map", {})
    )
    pipe = Pipeline(cfg).start()
    pids = pipe.backend.pids()
    handles = [pipe.submit({"n": 100}) for _ in range(5)]
    time.sleep(0.3)
    t0 = time.monotonic()
    pipe.close(timeout_s=2)
    assert time.monotonic() - t0 < 5
    for h in handles:
        assert sum(e.terminal for e in h) == 1
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_drain_lets_open_requests_finish():
    cfg = chain(("src", "synthetic.source", {"segment": 1, "delay_s": 0.01}))
    pipe = Pipeline(cfg).start()
    h = pipe.submit({"n": 20})
    pipe.close(drain=True, timeout_s=10)
    assert list(h)[-1].event_type == "completed"


def test_thousand_random_cancels_each_get_one_terminal_and_memory_stays_flat():
    psutil = pytest.importorskip("psutil")
    rng = random.Random(7)
    cfg = chain(
        ("src", "synthetic.source", {"segment": 2, "delay_s": 0.001}),
        ("m", "synthetic.map", {}),
        edges=[{"from": "src", "to": "m", "window": {"size": 4}}],
    )
    proc = psutil.Process()
    with Pipeline(cfg) as pipe:

        def batch(n):
            handles = [pipe.submit({"n": rng.randint(1, 40)}) for _ in range(n)]
            for h in handles:
                if rng.random() < 0.8:
                    time.sleep(rng.random() * 0.002)
                    pipe.cancel(h.request_id)
            terminals = [[e.event_type for e in h if e.terminal] for h in handles]
            assert all(len(t) == 1 for t in terminals)
            return terminals

        batch(200)  # warm up
        import gc

        gc.collect()
        rss0 = proc.memory_info().rss
        kinds = [t[0] for _ in range(4) for t in batch(250)]
        gc.collect()
        rss1 = proc.memory_info().rss
        assert len(kinds) == 1000 and set(kinds) <= {"cancelled", "completed"}
        assert kinds.count("cancelled") > 500
        assert pipe.backend.collector.handles == {} and pipe.backend.collector.wire == {}
    assert (rss1 - rss0) / rss0 < 0.05, (rss0, rss1)


def test_sigterm_of_the_caller_leaves_nothing_behind(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            from omni_core import Pipeline
            from omni_testing.configs import chain
            cfg = chain(("src", "synthetic.array_source", {"nbytes": 1 << 20, "count": 1000}),
                        ("sink", "synthetic.array_sink", {}))
            with Pipeline(cfg) as pipe:
                print(os.getpid(), *pipe.backend.pids().values(), flush=True)
                pipe.submit({})
                time.sleep(60)
            """
        )
    )
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=15) != 0
    for pid in pids[1:]:
        wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 5, f"worker {pid} gone")
    assert list_segments(pids[0]) == []


def test_requests_past_a_killed_producer_still_complete(no_leaked_segments):
    """Once the consumer holds a request's whole stream, the producer's death does not
    touch it: the consumer still reads the dead producer's slots, and the segment goes
    after the request ends. Before that point the request fails instead (its data may
    have died in the producer's buffers)."""
    cfg = chain(
        ("p", "synthetic.array_source", {"nbytes": 256 << 10, "count": 30}),
        ("d", "synthetic.sleep", {"hold_s": 0.05}),
        edges=[{"from": "p", "to": "d", "window": {"size": 1}}],
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        h = pipe.submit({}, timeout_s=20)
        wait_for(lambda: pipe.backend.acks.get("edge_end", 0) == 1, 5, "d has the stream")
        os.kill(pipe.backend.pids()["p"], signal.SIGKILL)
        events = list(h)
        assert events[-1].event_type == "completed", events[-1]
        assert sum(e.event_type == "segment" for e in events) == 31  # + the empty last window
        wait_for(lambda: pipe.health()["p"]["state"] == "ready", 10, "restart")
        wait_for(lambda: not pipe.backend.retired, 5, "old segment unlinked")
        assert pipe.generate([{"count": 2}], timeout_s=10)[0].ok


def test_coalesced_previews_give_their_slots_back():
    cfg = chain(
        ("gen", "synthetic.previews", {"steps": 200, "size": 160}),  # 75 KB: shared memory
        ("slow", "synthetic.sleep", {"hold_s": 0.01}, {"queue_capacity": 1}),
        edges=[{"from": "gen", "to": "slow", "window": {"size": 1}, "capacity": 1}],
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        assert pipe.generate([{}])[0].ok
        wait_for(lambda: pipe.metrics()["stages"]["gen"]["dropped"] > 0, 3, "drops")
        wait_for(lambda: pipe.metrics()["stages"]["gen"]["shm_slots_in_use"] == 0, 5, "slots back")
