"""Replicas of a stage, with real workers: each request stays on the replica it was bound
to, a replica's faults touch only its own requests, and replicas come and go (autoscaling)
without losing a request or a segment."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import pytest
import zmq
from omni_core import Pipeline
from omni_core.dataplane.serial import encode_frame
from omni_core.events import Segment
from omni_testing.configs import chain
from omni_testing.faults import stopped, wait_for, wait_ready

FAST = {"heartbeat_interval_s": 0.05}


def windowed(replicas, kind="synthetic.map", **stage):
    """source -> map (windows of 4 with an overlap of 1) -> sink; map's events reach the
    caller too."""
    return chain(
        ("src", "synthetic.source", {"segment": 3, "delay_s": 0.002}),
        ("map", kind, {"scale": 2}, {"replicas": replicas, "client_stream": True, **stage}),
        ("sink", "synthetic.map", {"offset": 1}),
        edges=[
            {"from": "src", "to": "map", "window": {"size": 4, "overlap": 1}},
            {"from": "map", "to": "sink"},
        ],
        **FAST,
    )


def by_request(outs, stage):
    return [[e for e in o.events if e.stage == stage] for o in outs]


def windows_of(out):
    """The replicated stage's own stream: its windows, overlap context included."""
    return [(e.tokens, e.payload["window"], e.payload["context"]) for e in out.by_stage("map")]


def sink_tokens(out):
    return [t for e in out.by_stage("sink") for t in e.tokens]


def terminal(handle):
    return list(handle)[-1]


def test_windows_stay_on_the_bound_replica_and_outputs_equal_one_replica(no_leaked_segments):
    requests = [{"n": 10 + 3 * i, "start": 100 * i} for i in range(12)]
    with Pipeline(windowed(1)) as one:
        want = one.generate(requests)
    with Pipeline({**windowed(3), "mrs": {"enabled": False}}) as inline:  # one of each
        assert [windows_of(o) for o in inline.generate(requests)] == [windows_of(o) for o in want]
    with Pipeline(windowed(3)) as pipe:
        assert sorted(pipe.health()) == ["map#0", "map#1", "map#2", "sink", "src"]
        got = pipe.generate(requests)
        pids = {n: h["pid"] for n, h in pipe.health().items()}
    assert all(o.ok for o in got)
    for w, g in zip(want, got, strict=True):
        assert sink_tokens(g) == sink_tokens(w)
        # the replicated stage's own stream: same windows (overlap context included)
        strip = [(e.tokens, e.payload["window"], e.payload["context"]) for e in w.by_stage("map")]
        assert [
            (e.tokens, e.payload["window"], e.payload["context"]) for e in g.by_stage("map")
        ] == strip
        assert [e.sequence for e in g.events] == list(range(len(g.events)))  # strict
    served = collections.Counter()
    for events in by_request(got, "map"):
        owners = {e.payload["pid"] for e in events}
        assert len(owners) == 1  # every window of a request ran on one replica
        served[owners.pop()] += 1
    replicas = {pids["map#0"], pids["map#1"], pids["map#2"]}
    assert set(served) == replicas and min(served.values()) >= 2  # spread by load


def test_cancel_and_timeout_reach_the_bound_replica(no_leaked_segments):
    cfg = chain(
        ("src", "synthetic.source", {}),
        ("hold", "synthetic.sleep", {"hold_s": 1.5}, {"replicas": 2}),
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        running = [pipe.submit({}) for _ in range(2)]
        queued = [pipe.submit({}) for _ in range(4)]
        timed = pipe.submit({}, timeout_s=0.3)
        assert sorted(h.routes["hold"] for h in running + queued) == [0, 0, 0, 1, 1, 1]
        acks = pipe.metrics()["cancel_acks"]
        for h in queued:
            assert pipe.cancel(h.request_id)
            ev = terminal(h)
            assert ev.event_type == "cancelled" and ev.reason == "cancelled"
        t = terminal(timed)
        assert t.event_type == "cancelled" and t.reason == "timeout"
        assert all(terminal(h).event_type == "completed" for h in running)
        # every worker acknowledged every cancel, and the bound replicas dropped the
        # queued requests: each ran only its first one
        wait_for(lambda: pipe.metrics()["cancel_acks"] >= acks + 3 * 5, 5, "cancel acks")
        time.sleep(0.3)
        done = [pipe.metrics()["stages"][f"hold#{i}"]["completed"] for i in (0, 1)]
        assert done == [1, 1]
        assert pipe.metrics()["replicas"]["hold"]["bound"] == 0


def kill_replica_under_load(kind, sig=signal.SIGKILL, stage_opts=None):
    cfg = chain(
        ("src", "synthetic.source", {"segment": 2, "delay_s": 0.01}),
        ("map", kind, {}, {"replicas": 2, "max_inflight": 8, **(stage_opts or {})}),
        ("sink", "synthetic.map", {}),
        **FAST,
    )
    return cfg


def test_a_killed_replica_fails_only_its_own_requests_and_the_stage_serves_on(
    no_leaked_segments,
):
    with Pipeline(kill_replica_under_load("synthetic.map")) as pipe:
        hs = [pipe.submit({"n": 60}) for _ in range(8)]
        wait_for(lambda: pipe.metrics()["stages"]["map#1"]["received"] > 8, 10, "streams")
        victim = pipe.health()["map#1"]["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: pipe.stage_health()["map"]["state"] == "degraded", 5, "degraded")
        assert pipe.healthy  # one replica still serves
        ends = {h.request_id: terminal(h) for h in hs}
        bound = {h.request_id: h.routes["map"] for h in hs}
        for rid, ev in ends.items():
            if bound[rid] == 1:
                assert ev.event_type == "error" and ev.code == "stage_died"
                assert "stage 'map' replica 1" in ev.message
            else:
                assert ev.event_type == "completed", ev
        assert sorted(bound.values()) == [0] * 4 + [1] * 4
        # while it restarts, new requests go to the other replica and succeed
        assert all(o.ok for o in pipe.generate([{"n": 4}] * 6))
        assert wait_ready(pipe, "map#1", 30)
        assert pipe.health()["map#1"]["restarts"] == 1
        assert pipe.health()["map#0"]["restarts"] == 0
        assert pipe.stage_health()["map"]["state"] == "ok"
        outs = pipe.generate([{"n": 4}] * 8)
        assert all(o.ok for o in outs)


def test_an_idempotent_replicas_requests_are_replayed_on_the_other_replica(no_leaked_segments):
    with Pipeline(kill_replica_under_load("synthetic.replayable_map")) as pipe:
        want = [list(range(40))] * 8
        hs = [pipe.submit({"n": 40}) for _ in range(8)]
        wait_for(lambda: pipe.metrics()["stages"]["map#1"]["received"] > 4, 10, "streams")
        os.kill(pipe.health()["map#1"]["pid"], signal.SIGKILL)
        outs = [list(h) for h in hs]
        assert all(o[-1].event_type == "completed" for o in outs)
        got = [
            [t for e in o if e.stage == "sink" and e.event_type == "segment" for t in e.tokens]
            for o in outs
        ]
        assert got == want
        assert pipe.metrics()["counts"]["replayed"] == 4
        assert all(h.routes["map"] == 0 for h in hs)  # the replays were bound anew


def test_a_sigstopped_replica_is_declared_hung_and_only_its_requests_fail(no_leaked_segments):
    cfg = kill_replica_under_load("synthetic.map", stage_opts={"stall_timeout_s": 2.0})
    with Pipeline(cfg) as pipe:
        with stopped(pipe.health()["map#0"]["pid"]):
            hs = [pipe.submit({"n": 20}) for _ in range(4)]
            wait_for(lambda: pipe.health()["map#0"]["state"] == "unresponsive", 3, "late")
            # a late replica gets no new request while the other serves
            more = [pipe.submit({"n": 4}) for _ in range(4)]
            assert all(h.routes["map"] == 1 for h in more)
            ends = [terminal(h) for h in hs]
            for h, ev in zip(hs, ends, strict=True):
                if h.routes["map"] == 0:
                    assert ev.event_type == "error" and ev.code == "stage_hung"
                else:
                    assert ev.event_type == "completed"
            assert all(terminal(h).event_type == "completed" for h in more)
        assert wait_ready(pipe, "map#0", 30)
        assert all(o.ok for o in pipe.generate([{"n": 4}] * 4))


def test_garbage_on_a_replicas_data_socket_fails_nothing_else():
    cfg = chain(
        ("src", "synthetic.source", {}),
        ("hold", "synthetic.sleep", {"hold_s": 1.0}, {"replicas": 2, "max_inflight": 2}),
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        hs = [pipe.submit({"n": 1}) for _ in range(4)]
        victim = next(h for h in hs if h.routes["hold"] == 1)
        ctx = zmq.Context.instance()
        push = ctx.socket(zmq.PUSH)
        push.connect(pipe.backend.addr.data("hold#1"))
        push.send(b"\x00garbage")
        bad = Segment(request_id=victim.request_id, stage="src", sequence=9, payload={0: "x"})
        push.send(encode_frame([bad]))
        push.close(linger=1000)
        assert terminal(victim).code == "bad_message"
        for h in hs:
            if h is not victim:
                assert terminal(h).event_type == "completed"
        assert all(o.ok for o in pipe.generate([{"n": 1}] * 4))
        assert all(pipe.health()[f"hold#{i}"]["restarts"] == 0 for i in (0, 1))


def test_scale_down_while_requests_are_in_flight_loses_nothing(no_leaked_segments):
    spec = {"min": 1, "max": 2, "target": 1, "upscale_delay_s": 0.2, "downscale_delay_s": 0.5}
    cfg = chain(
        ("src", "synthetic.source", {"segment": 1, "delay_s": 0.005}),
        ("map", "synthetic.map", {"delay_s": 0.02}, {"replicas": spec}),
        ("sink", "synthetic.map", {}),
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        assert sorted(pipe.health()) == ["map#0", "sink", "src"]
        results: list = []
        stop = threading.Event()

        def load():
            while not stop.is_set():
                results.extend(pipe.generate([{"n": 12}] * 3))

        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: pipe.metrics()["replicas"]["map"]["ready"] == 2, 30, "scale up")
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join()
        # a trickle keeps a request in flight while the drained replica stops
        trickle = [pipe.submit({"n": 30}) for _ in range(2)]
        wait_for(lambda: pipe.metrics()["replicas"]["map"]["live"] == 1, 30, "scale down")
        wait_for(lambda: len(pipe.health()) == 3, 30, "the drained replica to stop")
        events = [e["event"] for e in pipe.backend.autoscaler.events]
        assert events[:1] == ["start"] and "drain" in events and "stopped" in events
        assert all(terminal(h).event_type == "completed" for h in trickle)
        assert results and all(o.ok for o in results)
        assert all(o.tokens == list(range(12)) for o in results)
        assert pipe.metrics()["counts"]["error"] == 0


@pytest.mark.parametrize("first", ["map#0", "map#1"])
def test_a_stage_with_every_replica_dead_refuses_requests(first):
    cfg = chain(
        ("src", "synthetic.source", {}),
        ("map", "synthetic.map", {}, {"replicas": 2, "max_restarts": 0}),
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        second = "map#1" if first == "map#0" else "map#0"
        os.kill(pipe.health()[first]["pid"], signal.SIGKILL)
        wait_for(lambda: pipe.health()[first]["state"] == "dead", 5, "dead")
        assert pipe.stage_health()["map"]["state"] == "degraded" and pipe.healthy
        assert all(o.ok for o in pipe.generate([{"n": 2}] * 4))
        os.kill(pipe.health()[second]["pid"], signal.SIGKILL)
        wait_for(lambda: pipe.health()[second]["state"] == "dead", 5, "dead")
        assert pipe.stage_health()["map"]["state"] == "failed" and not pipe.healthy
        from omni_core.errors import StageDeadError

        with pytest.raises(StageDeadError, match="stage 'map'"):
            pipe.submit({"n": 1})


def test_an_added_replica_that_cannot_start_is_reported_not_restarted(tmp_path):
    flag = tmp_path / "no-more-replicas"
    spec = {"min": 1, "max": 2, "target": 1, "upscale_delay_s": 0, "downscale_delay_s": 60}
    cfg = chain(
        ("src", "synthetic.source", {"segment": 1, "delay_s": 0.02}),
        ("f", "synthetic.faulty", {"fail_on_load_if": str(flag)}, {"replicas": spec}),
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        flag.touch()  # from now on a new replica fails to load
        hs = [pipe.submit({"n": 20}) for _ in range(4)]
        wait_for(lambda: pipe.metrics()["replicas"]["f"]["unplaced"], 20, "the report")
        report = pipe.metrics()["replicas"]["f"]
        assert "f#1" in report["unplaced"] and "synthetic load failure" in report["unplaced"]
        assert [e["event"] for e in pipe.backend.autoscaler.events][:2] == ["start", "unplaced"]
        assert all(terminal(h).event_type == "completed" for h in hs)
        assert sorted(pipe.health()) == ["f#0", "src"]  # let go, not restarting
        assert pipe.stage_health()["f"]["state"] == "ok" and pipe.healthy


def test_a_replica_drained_while_its_output_waits_downstream_fails_nothing(no_leaked_segments):
    """The drained replica is stopped only once its requests' output has arrived at the
    (slow, backlogged) next stage, not merely once it sent it."""
    spec = {"min": 1, "max": 2, "target": 1, "upscale_delay_s": 0, "downscale_delay_s": 0.2}
    cfg = chain(
        ("src", "synthetic.source", {"segment": 4}),
        ("map", "synthetic.map", {"delay_s": 0.03}, {"replicas": spec}),
        ("sink", "synthetic.sleep", {"hold_s": 0.05}, {"queue_capacity": 2}),
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        hs = [pipe.submit({"n": 8}) for _ in range(8)]  # map is fast, sink backs up
        wait_for(lambda: pipe.metrics()["replicas"]["map"]["ready"] == 2, 20, "scale up")
        hs += [pipe.submit({"n": 8}) for _ in range(16)]
        assert {h.routes["map"] for h in hs[8:]} == {0, 1}
        events = pipe.backend.autoscaler.events
        wait_for(lambda: any(e["event"] == "drain" for e in events), 20, "a drain")
        ends = [terminal(h) for h in hs]
        assert [e.event_type for e in ends] == ["completed"] * 24, [
            getattr(e, "message", "") for e in ends if e.event_type != "completed"
        ]
        wait_for(lambda: len(pipe.health()) == 3, 20, "the drained replica to stop")
        assert pipe.metrics()["counts"]["error"] == 0
