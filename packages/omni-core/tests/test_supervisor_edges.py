"""The supervisor at its limits, as health, metrics and the I/O loop see them: a stage is
late (unresponsive) or hung only one tick past its limit, what health says of a stage
and of its replicas, the rates a heartbeat gives, and which workers end or restart."""

import pytest
from omni_core.config import parse_config
from omni_core.control.supervisor import Supervisor, stage_health
from omni_core.events import Heartbeat, Ready, StageStats
from omni_testing.supervision import Clock, FakeLauncher, FakeWorker

T0 = 1000.0


def supervisor(*names: str, ready: bool = True, **cfg) -> tuple[Supervisor, Clock]:
    """Workers ``names`` (a stage, or ``STAGE#i``) of stages of their own, spawned at
    ``T0`` (and ready then, unless not ``ready``); ``cfg``: top-level keys, or
    ``stall_timeout_s`` for every stage."""
    stall = {"stall_timeout_s": cfg.pop("stall_timeout_s")} if "stall_timeout_s" in cfg else {}
    stages = sorted({n.partition("#")[0] for n in names})
    config = parse_config(
        {"stages": [{"name": s, "kind": "synthetic.faulty", **stall} for s in stages], **cfg}
    )
    clock = Clock(T0)
    sup = Supervisor(config, FakeLauncher(), clock)
    for n in names:
        p = sup.spawn(n)
        if ready:
            sup.on_status(Ready(stage=n, pid=p.worker.pid, load_s=0.25))
    return sup, clock


def beat(sup: Supervisor, name: str, **stats) -> None:
    sup.on_status(Heartbeat(stage=name, pid=1, ts=0, stats=StageStats(**stats)))


def crash(sup: Supervisor, name: str) -> None:
    sup.procs[name].worker.ended = True
    (ended,) = sup.ended({})
    sup.on_death(ended)


# -- late: unresponsive in health, before any kill -------------------------------------


@pytest.mark.parametrize(
    ("interval_s", "limit_s"),
    [(0.5, 1.5), (0.1, 1.0)],  # three heartbeats missed; but never under a second
)
def test_a_stage_is_unresponsive_only_past_its_late_limit(interval_s, limit_s):
    sup, clock = supervisor("s", heartbeat_interval_s=interval_s)
    clock.t = T0 + limit_s  # exactly at the limit: still healthy
    h = sup.health()["s"]
    assert (h["state"], h["healthy"], h["alive"]) == ("ready", True, True)
    assert h["heartbeat_age_s"] == limit_s
    clock.t = T0 + limit_s + 0.001
    h = sup.health()["s"]
    assert (h["state"], h["healthy"], h["alive"]) == ("unresponsive", False, True)
    beat(sup, "s")  # a heartbeat again: healthy again
    assert sup.health()["s"]["state"] == "ready"


def test_a_stage_not_ready_or_ended_is_never_called_unresponsive():
    sup, clock = supervisor("a", "b", ready=False)
    sup.on_status(Ready(stage="b", pid=1, load_s=0.25))
    crash(sup, "b")
    clock.t = T0 + 100.0
    health = sup.health()
    assert health["a"]["state"] == "starting" and health["b"]["state"] == "restarting"
    assert not health["a"]["healthy"] and not health["b"]["healthy"]


# -- what health says of one worker ----------------------------------------------------


def test_health_before_ready_after_ready_and_after_a_crash():
    sup, clock = supervisor("s", ready=False)
    h = sup.health()["s"]
    assert h["heartbeat_age_s"] is None and h["load_s"] == 0.0 and h["exit"] == ""
    assert (h["state"], h["healthy"], h["alive"]) == ("starting", False, True)
    sup.on_status(Ready(stage="s", pid=1, load_s=0.25))
    clock.t = T0 + 0.25
    h = sup.health()["s"]
    assert h["heartbeat_age_s"] == 0.25 and h["load_s"] == 0.25
    sup.procs["s"].worker.ended = True  # its process ended; the loop has not reaped it yet
    h = sup.health()["s"]
    assert not h["alive"] and h["state"] == "ready"
    sup.on_death(sup.ended({})[0])
    h = sup.health()["s"]
    assert (h["alive"], h["healthy"], h["exit"]) == (False, False, "exited with code 9")


def test_health_says_why_a_hung_stage_was_killed():
    sup, clock = supervisor("s", stall_timeout_s=5.0)
    clock.t = T0 + 5.001
    (hung,) = sup.check_liveness()
    assert (
        sup.health()["s"]["exit"] == hung.hung == "sent no heartbeat for 5.0 s (stall_timeout_s=5)"
    )
    assert sup.check_liveness() == []  # killed once, not again before its end is seen


# -- hung: killed one tick past the stall timeout --------------------------------------


def test_a_silent_stage_is_killed_one_tick_past_its_stall_timeout():
    sup, clock = supervisor("s", stall_timeout_s=5.0)
    clock.t = T0 + 5.0
    assert sup.check_liveness() == []
    clock.t = T0 + 5.001
    (hung,) = sup.check_liveness()
    assert hung.worker.killed and sup.health()["s"]["state"] == "hung"


def test_a_step_is_hung_one_tick_past_the_stall_timeout_counting_since_its_heartbeat():
    sup, clock = supervisor("s", stall_timeout_s=5.0)
    clock.t = T0 + 1.0
    beat(sup, "s", busy_s=4.5)
    clock.t = T0 + 1.5  # 4.5 s busy at the heartbeat + 0.5 s since: 5.0 s, the limit
    assert sup.check_liveness() == []
    clock.t = T0 + 1.501
    (hung,) = sup.check_liveness()
    assert "busy on one step for 5.0 s" in hung.hung


def test_an_idle_stage_is_not_busy_under_a_short_stall_timeout():
    sup, clock = supervisor("s", stall_timeout_s=0.5)
    clock.t = T0 + 0.25
    beat(sup, "s", busy_s=0.0)
    clock.t = T0 + 0.75  # silent 0.5 s, the limit; not inside a step
    assert sup.check_liveness() == []


def test_a_first_start_may_take_longer_than_ready_timeout_a_restart_may_not():
    sup, clock = supervisor("s", ready=False, ready_timeout_s=10.0)
    clock.t = T0 + 1e4  # the first start: no ready timeout (a model may load for long)
    assert sup.check_liveness() == []
    sup.on_status(Ready(stage="s", pid=1, load_s=0.25))
    crash(sup, "s")
    clock.t = sup.procs["s"].restart_at
    (new,) = sup.due_restarts()
    restarted = clock.t
    clock.t = restarted + 10.0  # exactly ready_timeout_s: not yet
    assert sup.check_liveness() == []
    clock.t = restarted + 10.001
    (hung,) = sup.check_liveness()
    assert hung is new and hung.hung == "was not ready 10.0 s after its restart (ready_timeout_s)"


# -- rates from heartbeats -------------------------------------------------------------


def test_heartbeats_give_enqueue_and_dequeue_rates_over_the_time_between_them():
    sup, clock = supervisor("s")
    clock.t = T0 + 0.5
    beat(sup, "s", received=10, dequeued=4)
    assert sup.procs["s"].rates == {"enqueue_per_s": 20.0, "dequeue_per_s": 8.0}
    clock.t = T0 + 2.5
    beat(sup, "s", received=30, dequeued=5)
    assert sup.procs["s"].rates == {"enqueue_per_s": 10.0, "dequeue_per_s": 0.5}
    beat(sup, "s", received=40, dequeued=9)  # the same instant: no rate, no division by 0
    assert sup.procs["s"].rates == {"enqueue_per_s": 10.0, "dequeue_per_s": 0.5}


def test_a_heartbeat_before_ready_gives_no_rate():
    sup, clock = supervisor("s", ready=False)
    clock.t = T0 + 0.5
    beat(sup, "s", received=10, dequeued=4)
    assert sup.procs["s"].rates == {}


# -- which workers end, which restart --------------------------------------------------


class FdWorker(FakeWorker):
    """A worker with an exit fd (a local process's)."""

    def fileno(self) -> int | None:
        return 100 + self.pid


def test_a_worker_with_an_exit_fd_has_ended_once_that_fd_is_readable():
    sup, _ = supervisor("s", ready=False)
    sup.launcher.spawn = lambda name: FdWorker(7)  # type: ignore[method-assign]
    p = sup.spawn("s")
    assert sup.ended({}) == []
    assert sup.ended({100 + p.worker.pid: 1}) == [p]


def test_an_ended_worker_is_seen_once_and_the_next_ones_still_are():
    sup, _ = supervisor("a", "b")
    crash(sup, "a")
    assert sup.ended({}) == []  # reaped: not ended again
    sup.procs["b"].worker.ended = True
    assert sup.ended({}) == [sup.procs["b"]]


def test_only_the_stage_whose_backoff_is_over_restarts():
    sup, clock = supervisor("a", "b")  # a stays ready, b crashes
    crash(sup, "b")
    restart_at = sup.procs["b"].restart_at
    clock.t = restart_at - 0.001
    assert sup.due_restarts() == []
    clock.t = restart_at
    (new,) = sup.due_restarts()
    assert new is sup.procs["b"] and new.restarts == 1
    assert sup.procs["a"].restarts == 0 and sup.health()["a"]["state"] == "ready"


def test_a_restart_that_cannot_start_a_process_leaves_the_stage_dead():
    sup, clock = supervisor("s")
    crash(sup, "s")

    def refuse(name: str) -> FakeWorker:
        raise OSError("no memory")

    sup.launcher.spawn = refuse  # type: ignore[method-assign]
    clock.t = sup.procs["s"].restart_at
    assert sup.due_restarts() == []
    h = sup.health()["s"]
    assert (h["state"], h["exit"]) == ("dead", "restart failed: no memory")


def test_a_hung_stage_is_killed_even_after_a_dead_one():
    sup, clock = supervisor("a", "b", stall_timeout_s=5.0)
    crash(sup, "a")
    clock.t = T0 + 5.001
    (hung,) = sup.check_liveness()
    assert hung is sup.procs["b"]


@pytest.mark.parametrize(
    ("worker", "where"),
    [("s", "stage 's' worker (pid "), ("s#1", "stage 's' replica 1 worker (pid ")],
)
def test_why_names_the_replica_only_of_a_replicated_stage(worker, where):
    sup, _ = supervisor(worker)
    crash(sup, worker)
    message, code = sup.why(sup.procs[worker])
    assert message.startswith(where) and message.endswith(") exited with code 9")
    assert code == "stage_died"


# -- a stage's health from its replicas' -----------------------------------------------


def w(stage: str, state: str = "ready", healthy: bool = True) -> dict:
    return {"stage": stage, "state": state, "healthy": healthy}


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        ({}, {}),
        ({"s": w("s")}, {"s": ("ok", 1, 1)}),
        ({"s#0": w("s"), "s#1": w("s")}, {"s": ("ok", 2, 2)}),
        ({"s#0": w("s"), "s#1": w("s", "hung", False)}, {"s": ("degraded", 2, 1)}),
        ({"s": w("s", "restarting", False)}, {"s": ("failed", 1, 0)}),
        # replicas being scaled down count as neither, wherever they come
        ({"s#1": w("s", "draining"), "s#0": w("s")}, {"s": ("ok", 1, 1)}),
        ({"s#0": w("s", "stopping"), "s#1": w("s", "stopped")}, {"s": ("failed", 0, 0)}),
        # a worker without a stage is its own stage
        ({"a": {"state": "ready", "healthy": True}}, {"a": ("ok", 1, 1)}),
    ],
)
def test_a_stage_is_ok_degraded_or_failed_from_its_replicas(workers, expected):
    got = {s: (h["state"], h["replicas"], h["serving"]) for s, h in stage_health(workers).items()}
    assert got == expected


def test_stage_health_from_a_supervisors_health():
    sup, clock = supervisor("s#0", "s#1", "t", stall_timeout_s=5.0)
    crash(sup, "t")
    clock.t = T0 + 1.0
    beat(sup, "s#0")
    clock.t = T0 + 1.501  # s#1 missed three heartbeats: unresponsive
    got = {
        s: (h["state"], h["replicas"], h["serving"]) for s, h in stage_health(sup.health()).items()
    }
    assert got == {"s": ("degraded", 2, 1), "t": ("failed", 1, 0)}
