"""Replicas without processes: the config, the router's choice and the autoscaler's
decisions, on a fake supervisor and a fake clock."""

from __future__ import annotations

import pytest
from omni_core.client.collector import Collector
from omni_core.config import ConfigError, parse_config, replica_name, split_worker
from omni_core.control.replicas import PLACE_RETRY_S, Autoscaler, Router
from omni_core.control.supervisor import WorkerRecord, stage_health
from omni_core.dataplane.serial import ArrayCodec
from omni_core.errors import StageDeadError


def config(replicas, **extra):
    return parse_config(
        {
            "stages": [
                {"name": "src", "kind": "x"},
                {"name": "work", "kind": "x", "replicas": replicas, **extra},
            ],
            "edges": [{"from": "src", "to": "work"}],
        },
        check_kinds=False,
    )


class FakeSupervisor:
    def __init__(self, cfg, clock):
        self.cfg = cfg
        self.clock = clock
        self.procs: dict[str, WorkerRecord] = {}
        self.late_ones: set[str] = set()

    def add(self, name, state="ready"):
        stage, i = split_worker(name)
        p = WorkerRecord(name, "x", worker=None, stage=stage, replica=i, state=state)  # type: ignore[arg-type]
        p.ready = state == "ready"
        self.procs[name] = p
        return p

    def late(self, p, now):
        return p.name in self.late_ones


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def parts():
    def make(replicas, n_up=None):
        cfg = config(replicas)
        clock = Clock()
        sup = FakeSupervisor(cfg, clock)
        sup.add("src")
        lo, hi = cfg.replica_range("work")
        for w in cfg.workers("work")[: n_up if n_up is not None else lo]:
            sup.add(w)
        collector = Collector(cfg.sinks(), cfg.client_streams(), ArrayCodec("client"))
        router = Router(cfg, sup, collector)  # type: ignore[arg-type]
        scaler = Autoscaler(cfg, sup, collector, clock)  # type: ignore[arg-type]
        return cfg, clock, sup, collector, router, scaler

    return make


def open_bound(collector, router, n):
    hs = []
    for _ in range(n):
        h = collector.open(f"r{len(collector.handles)}")
        collector.bind(h, router.bind())
        hs.append(h)
    return hs


# -- config ---------------------------------------------------------------------------


def test_worker_names_and_device_groups():
    cfg = config(3, devices=["0", 1, "cpu"])
    assert cfg.workers("work") == ["work#0", "work#1", "work#2"]
    assert cfg.workers("src") == ["src"]  # one fixed replica keeps its plain name
    assert [cfg.worker_devices("work", i) for i in range(3)] == ["0", 1, "cpu"]
    assert split_worker(replica_name("work", 2)) == ("work", 2)
    assert split_worker("src") == ("src", 0)
    shared = config(2, devices="1")
    assert shared.worker_devices("work", 1) == "1"  # one value: every replica's
    auto = config({"min": 1, "max": 4})
    assert auto.replica_range("work") == (1, 4) and len(auto.workers("work")) == 4


@pytest.mark.parametrize(
    ("replicas", "extra", "where", "what"),
    [
        (2, {"devices": ["0"]}, "stages[1].devices", "expected 2 entries (replicas is 2), got 1"),
        (2, {"devices": ["0", "1", "2"]}, "stages[1].devices", "got 3"),
        ({"min": 1, "max": 3}, {"devices": ["0", "1"]}, "stages[1].devices", "replicas.max is 3"),
        ({"min": 3, "max": 2}, {}, "stages[1].replicas.min", "min (3) is larger than max (2)"),
        (2, {"devices": ["0", "x1"]}, "stages[1].devices[1]", "got 'x1'"),
        (0, {}, "stages[1].replicas", ""),
    ],
)
def test_replica_config_errors_name_the_field(replicas, extra, where, what):
    with pytest.raises(ConfigError) as e:
        config(replicas, **extra)
    assert where in str(e.value) and what in str(e.value)


def test_a_device_list_of_exactly_one_group_per_replica_loads():
    assert config(2, devices=["0", "1"]).worker_devices("work", 1) == "1"
    assert config({"min": 1, "max": 2}, devices=["0", "1"]).worker_devices("work", 0) == "0"


# -- routing --------------------------------------------------------------------------


def test_the_least_loaded_replica_is_chosen_and_ties_take_turns(parts):
    cfg, clock, sup, collector, router, _ = parts(3)
    picks = [r["work"] for r in (router.bind() for _ in range(6))]
    assert sorted(picks[:3]) == [0, 1, 2]  # nothing outstanding: in turn
    hs = open_bound(collector, router, 3)
    assert sorted(h.routes["work"] for h in hs) == [0, 1, 2]
    collector.unbind(hs[1], "work")  # work#1's request went past it
    assert router.bind() == {"work": hs[1].routes["work"]}
    assert "src" not in router.bind()  # only replicated stages are bound


def test_never_a_dead_hung_restarting_or_draining_replica_while_one_serves(parts):
    cfg, clock, sup, collector, router, _ = parts(4)
    sup.procs["work#0"].state = "dead"
    sup.procs["work#1"].state = "hung"
    sup.procs["work#2"].state = "draining"
    assert {router.bind()["work"] for _ in range(8)} == {3}
    sup.procs["work#3"].state = "restarting"  # nothing serves: wait for the restart
    assert router.bind() == {"work": 3}
    sup.procs["work#3"].state = "stopping"
    with pytest.raises(StageDeadError, match="stage 'work' has no replica"):
        router.bind()


def test_a_late_or_full_replica_is_only_a_last_resort(parts):
    cfg, clock, sup, collector, router, _ = parts(2)
    sup.late_ones.add("work#0")
    assert {router.bind()["work"] for _ in range(4)} == {1}
    sup.late_ones.clear()
    capacity = cfg.setting(cfg.stage("work"), "queue_capacity")
    # work#1 holds exactly its queue capacity (full), work#0 one less than that plus
    # nothing else: the one with room wins even though it is listed first
    open_bound(collector, router, 2 * capacity - 1)
    loads = {i: collector.outstanding.get(("work", i), 0) for i in (0, 1)}
    assert sorted(loads.values()) == [capacity - 1, capacity]
    roomy = min(loads, key=loads.get)
    assert router.bind() == {"work": roomy}


def test_outstanding_counts_follow_completion_end_and_replay(parts):
    cfg, clock, sup, collector, router, _ = parts(2)
    a, b = open_bound(collector, router, 2)
    assert sum(collector.outstanding.values()) == 2
    collector.unbind(a, "work")
    collector.unbind(a, "work")  # twice: counted once
    assert sum(collector.outstanding.values()) == 1
    collector.bind(b, {"work": 1 - b.routes["work"]})  # a new attempt, bound anew
    assert collector.outstanding[("work", b.routes["work"])] == 1
    assert sum(collector.outstanding.values()) == 1
    collector.fail_all("closed")
    assert sum(collector.outstanding.values()) == 0


def test_stage_health_is_degraded_while_one_replica_serves():
    def w(stage, healthy, state="ready"):
        return {"stage": stage, "healthy": healthy, "state": state}

    health = {"a": w("a", True), "b#0": w("b", True), "b#1": w("b", False, "restarting")}
    assert stage_health(health) == {
        "a": {"state": "ok", "replicas": 1, "serving": 1},
        "b": {"state": "degraded", "replicas": 2, "serving": 1},
    }
    health["b#0"] = w("b", False, "hung")
    assert stage_health(health)["b"]["state"] == "failed"
    health = {"b#0": w("b", True), "b#1": w("b", True, "draining")}  # scaling down
    assert stage_health(health)["b"] == {"state": "ok", "replicas": 1, "serving": 1}


# -- autoscaling ----------------------------------------------------------------------


def test_scale_up_only_after_the_load_stayed_above_target_for_the_delay(parts):
    spec = {"min": 1, "max": 3, "target": 2, "upscale_delay_s": 1.0, "downscale_delay_s": 5.0}
    cfg, clock, sup, collector, router, scaler = parts(spec)
    open_bound(collector, router, 2)  # exactly at target: nothing to do
    assert scaler.tick() == ([], [])
    open_bound(collector, router, 1)  # one past it: 2 replicas wanted
    assert scaler.tick() == ([], [])
    clock.t += 0.99
    assert scaler.tick() == ([], [])
    clock.t += 0.02
    assert scaler.tick() == (["work#1"], [])
    sup.add("work#1", "starting")
    clock.t += 5
    assert scaler.tick() == ([], [])  # 3 outstanding, 2 replicas: enough
    open_bound(collector, router, 10)
    scaler.tick()
    clock.t += 1.0
    assert scaler.tick() == (["work#2"], [])  # never past max
    sup.add("work#2")
    clock.t += 10
    assert scaler.tick() == ([], [])


def test_scale_down_drains_the_least_loaded_after_the_delay_never_the_last(parts):
    spec = {"min": 1, "max": 2, "target": 2, "upscale_delay_s": 0, "downscale_delay_s": 2.0}
    cfg, clock, sup, collector, router, scaler = parts(spec, n_up=2)
    hs = open_bound(collector, router, 2)
    assert scaler.tick() == ([], [])  # 2 outstanding: 1 replica would do, after 2 s
    clock.t += 1.9
    assert scaler.tick() == ([], [])
    clock.t += 0.2
    busy = {h.routes["work"] for h in hs}
    assert busy == {0, 1}
    collector.unbind(hs[0], "work")
    _, drain = scaler.tick()
    assert [p.replica for p in drain] == [hs[0].routes["work"]]
    drain[0].state = "draining"
    clock.t += 10
    assert scaler.tick() == ([], [])  # one serving replica is never drained


def test_a_replica_that_cannot_be_placed_is_not_retried_at_once(parts):
    spec = {"min": 1, "max": 2, "target": 1, "upscale_delay_s": 0}
    cfg, clock, sup, collector, router, scaler = parts(spec)
    open_bound(collector, router, 4)
    assert scaler.tick() == (["work#1"], [])
    scaler.cannot_place("work", "no GPU left")
    assert scaler.report()["work"]["unplaced"] == "no GPU left"
    clock.t += PLACE_RETRY_S - 0.1
    assert scaler.tick() == ([], [])
    clock.t += 0.2
    assert scaler.tick() == (["work#1"], [])


# -- limits of the router's choice and the autoscaler's decisions -----------------------


def test_with_nothing_outstanding_the_replicas_take_turns_from_the_first(parts):
    cfg, clock, sup, collector, router, _ = parts(3)
    assert [router.bind()["work"] for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("past", [0, 1])
def test_a_replica_whose_requests_went_past_it_ties_with_one_never_bound(parts, past):
    """Its count is back at 0 (the entry stays): as idle as a replica never bound to."""
    cfg, clock, sup, collector, router, _ = parts(2)
    h = collector.open("r")
    collector.bind(h, {"work": past})
    collector.unbind(h, "work")
    assert collector.outstanding == {("work", past): 0}
    assert router.bind() == {"work": 0}  # the tie goes to the turn, which starts at 0


def test_no_replica_to_take_a_request_names_each_and_why(parts):
    cfg, clock, sup, collector, router, _ = parts(3)
    sup.procs["work#0"].state, sup.procs["work#0"].exit_reason = "dead", "exited with code 9"
    sup.procs["work#1"].state, sup.procs["work#1"].hung = "hung", "no heartbeat for 9 s"
    sup.procs["work#2"].state = "stopping"
    sup.procs["src"].state = "dead"
    with pytest.raises(StageDeadError) as err:
        router.bind()
    assert str(err.value) == (
        "stage 'work' has no replica that can take requests (work#0: dead (exited with code "
        "9); work#1: hung (no heartbeat for 9 s); work#2: stopping (no reason)); the pipeline "
        "cannot serve requests"
    )


def test_an_unplaced_replica_is_retried_after_10_s_at_the_earliest(parts):
    """failure-model.md: "retried after 10 s"; at exactly that, it is."""
    assert PLACE_RETRY_S == 10.0
    spec = {"min": 1, "max": 2, "target": 1, "upscale_delay_s": 0}
    cfg, clock, sup, collector, router, scaler = parts(spec)
    open_bound(collector, router, 4)
    scaler.cannot_place("work", "no GPU left")
    clock.t += PLACE_RETRY_S
    assert scaler.tick() == (["work#1"], [])


def test_no_change_when_the_replicas_are_what_the_load_wants(parts):
    """At exactly ``target`` per replica, with no delays: neither up nor down."""
    spec = {"min": 1, "max": 3, "target": 2, "upscale_delay_s": 0, "downscale_delay_s": 0}
    cfg, clock, sup, collector, router, scaler = parts(spec, n_up=2)
    open_bound(collector, router, 4)
    assert scaler.tick() == ([], [])
    assert scaler.above["work"] is None and scaler.below["work"] is None
    open_bound(collector, router, 1)
    assert scaler.tick() == (["work#2"], [])


def test_scale_down_at_exactly_the_delay(parts):
    spec = {"min": 1, "max": 2, "target": 2, "upscale_delay_s": 0, "downscale_delay_s": 2.0}
    cfg, clock, sup, collector, router, scaler = parts(spec, n_up=2)
    assert scaler.tick() == ([], [])
    clock.t += 2.0
    _, drain = scaler.tick()
    assert [p.name for p in drain] == ["work#1"]  # equally idle: the highest index


def test_the_only_serving_replica_is_never_drained_beside_a_starting_one(parts):
    spec = {"min": 1, "max": 2, "target": 2, "upscale_delay_s": 0, "downscale_delay_s": 0}
    cfg, clock, sup, collector, router, scaler = parts(spec)
    sup.add("work#1", "starting")
    assert len(scaler.live("work")) == 2 and scaler.desired("work") == 1
    assert scaler.tick() == ([], [])


@pytest.mark.parametrize("past", [0, 1])
def test_the_victim_is_the_least_loaded_then_the_highest_index(parts, past):
    """Equally idle replicas: the highest index goes, whether its count is back at 0 (a
    request went past it) or it was never bound to."""
    spec = {"min": 1, "max": 3, "target": 8, "upscale_delay_s": 0, "downscale_delay_s": 0}
    cfg, clock, sup, collector, router, scaler = parts(spec, n_up=3)
    assert [p.name for p in scaler.tick()[1]] == ["work#2"]  # none has any entry yet
    h = collector.open("r")
    collector.bind(h, {"work": past})
    collector.unbind(h, "work")
    collector.bind(collector.open("busy"), {"work": 2})
    assert [p.name for p in scaler.tick()[1]] == ["work#1"]


def test_the_events_kept_are_the_last_256(parts):
    *_, scaler = parts({"min": 1, "max": 2})
    for i in range(300):
        scaler.record("up", "work", n=i)
    assert [e["n"] for e in scaler.events] == list(range(44, 300))


def test_report_counts_each_stages_own_replicas(parts):
    spec = {"min": 1, "max": 4, "target": 3}
    cfg, clock, sup, collector, router, scaler = parts(spec, n_up=2)
    sup.add("work#2", "starting")
    sup.add("work#3", "draining").retiring = True
    open_bound(collector, router, 2)
    assert scaler.report() == {
        "src": {
            "live": 1,
            "ready": 1,
            "draining": 0,
            "bound": 0,
            "min": 1,
            "max": 1,
            "target": None,
            "unplaced": None,
        },
        "work": {
            "live": 3,
            "ready": 2,
            "draining": 1,
            "bound": 2,
            "min": 1,
            "max": 4,
            "target": 3,
            "unplaced": None,
        },
    }
