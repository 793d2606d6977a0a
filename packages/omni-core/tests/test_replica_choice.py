"""Which replica a new request may go to, on the real supervisor and router with a fake
launcher and a fake clock: a full replica only when every other is full too, and a
replica scaled down (or killed) stays out even when its ready message comes late."""

from __future__ import annotations

import pytest
from omni_core.client.collector import Collector
from omni_core.config import parse_config
from omni_core.control.replicas import Router
from omni_core.control.supervisor import Supervisor, WorkerRecord, stage_health
from omni_core.dataplane.serial import ArrayCodec
from omni_core.events import Heartbeat, Ready, StageStats
from omni_testing.supervision import Clock, FakeLauncher

CAPACITY = 4
LATE_S = 2.0  # past the late limit (three heartbeats of 0.5 s), short of the stall timeout


class Replicas:
    """Stage ``work`` at ``replicas`` behind a source, its workers spawned and ready."""

    def __init__(self, replicas: int | dict, **top) -> None:
        self.cfg = parse_config(
            {
                "stages": [
                    {"name": "src", "kind": "synthetic.faulty"},
                    {
                        "name": "work",
                        "kind": "synthetic.faulty",
                        "replicas": replicas,
                        "queue_capacity": CAPACITY,
                    },
                ],
                "edges": [{"from": "src", "to": "work"}],
                "heartbeat_interval_s": 0.5,
                **top,
            }
        )
        self.clock = Clock()
        self.sup = Supervisor(self.cfg, FakeLauncher(), self.clock)
        self.collector = Collector(self.cfg.sinks(), self.cfg.client_streams(), ArrayCodec("c"))
        self.router = Router(self.cfg, self.sup, self.collector)
        lo, _ = self.cfg.replica_range("work")
        for name in ["src", *self.cfg.workers("work")[:lo]]:
            self.ready(self.sup.spawn(name))

    def ready(self, p: WorkerRecord) -> None:
        self.sup.on_status(Ready(stage=p.name, pid=p.worker.pid, load_s=0.1))

    def beat(self, *names: str) -> None:
        for n in names:
            self.sup.on_status(Heartbeat(stage=n, pid=1, ts=0, stats=StageStats()))

    def submit(self, routes: dict[str, int] | None) -> None:
        h = self.collector.open(f"r{len(self.collector.handles)}")
        self.collector.bind(h, routes)

    def fill(self, replica: int, n: int = CAPACITY) -> None:
        """``n`` requests bound to ``work#replica`` (``CAPACITY``: it is full)."""
        for _ in range(n):
            self.submit({"work": replica})

    def picks(self, n: int = 4) -> set[int]:
        """The replicas ``n`` new requests are bound to, one after another."""
        out = set()
        for _ in range(n):
            routes = self.router.bind()
            self.submit(routes)
            out.add(routes["work"])
        return out


def make_late(r: Replicas, late: str, serving: str) -> None:
    r.clock.t += LATE_S
    r.beat(serving)
    assert r.sup.late(r.sup.procs[late], r.clock()) and not r.sup.late(
        r.sup.procs[serving], r.clock()
    )


# -- a full replica is the last resort -------------------------------------------------


def test_a_late_replica_with_room_is_taken_before_a_full_serving_one():
    r = Replicas(2)
    make_late(r, late="work#1", serving="work#0")
    assert r.picks(CAPACITY) == {0}  # the serving one, until it is full
    assert r.picks(1) == {1}


@pytest.mark.parametrize("state", ["starting", "restarting"])
def test_a_starting_or_restarting_replica_with_room_is_taken_before_a_full_serving_one(state):
    r = Replicas(2)
    r.sup.procs["work#1"].state = state
    r.fill(0, CAPACITY - 1)
    assert r.picks(1) == {0}  # work#0 has room: the serving one
    assert r.picks(CAPACITY) == {1}  # work#0 is full: the other, until it is full too
    assert r.picks(1) == {0}


def test_when_every_replica_is_full_they_rank_by_state():
    r = Replicas(3)
    r.sup.procs["work#2"].state = "restarting"
    make_late(r, late="work#1", serving="work#0")
    for i in range(3):
        r.fill(i)
    assert r.picks() == {0}  # all full: serving before late before restarting
    r.sup.procs["work#0"].state = "hung"
    assert r.picks() == {1}


def test_a_scaled_up_replica_takes_the_backlog_while_it_loads():
    r = Replicas({"min": 1, "max": 2, "target": 1})
    r.fill(0)
    new = r.sup.spawn("work#1")  # the autoscaler's new replica, still loading
    assert r.picks(CAPACITY) == {1}
    assert r.picks(1) == {0}  # both full now: the serving one
    r.ready(new)
    assert new.state == "ready"


# -- a replica scaled down stays so when its ready comes late --------------------------


@pytest.mark.parametrize("state", ["draining", "stopping"])
def test_a_late_ready_leaves_a_retiring_replica_retiring(state):
    r = Replicas({"min": 1, "max": 2, "target": 1})
    p = r.sup.spawn("work#1")
    p.scaled = True
    p.state, p.retiring = state, True  # as the orchestrator's scale() leaves it
    r.ready(p)
    assert (p.state, p.ready) == (state, False)
    health = r.sup.health()
    assert health["work#1"]["state"] == state
    assert stage_health(health)["work"] == {"state": "ok", "replicas": 1, "serving": 1}
    r.fill(0)  # work#0 full: still never the retiring one
    assert r.picks() == {0}
    p.worker.kill()
    (ended,) = r.sup.ended({})
    r.sup.on_death(ended)
    assert p.state == "stopped"  # not restarted


def test_a_restart_killed_for_not_coming_up_stays_hung_when_its_ready_comes_late():
    r = Replicas(2, ready_timeout_s=5.0)
    old = r.sup.procs["work#1"]
    old.worker.ended = True
    (ended,) = r.sup.ended({})
    r.sup.on_death(ended)
    r.clock.t = old.restart_at
    (p,) = r.sup.due_restarts()
    r.clock.t += 6.0
    r.beat("work#0")
    assert r.sup.check_liveness() == [p]  # not ready 6 s after its restart: killed
    r.ready(p)  # its ready was on the way
    assert (p.state, p.ready) == ("hung", False)
    r.fill(0)
    assert r.picks() == {0}  # full, but the only one that can take requests
