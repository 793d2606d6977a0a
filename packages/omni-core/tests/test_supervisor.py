"""The supervisor's rules with a fake launcher and a fake clock: no process, no socket."""

import pytest
from omni_core.config import parse_config
from omni_core.control.supervisor import Supervisor
from omni_core.events import Heartbeat, Ready, StageStats
from omni_testing.supervision import Clock, FakeLauncher


def make(**stage):
    cfg = parse_config(
        {
            "stages": [{"name": "s", "kind": "synthetic.faulty", **stage}],
            "heartbeat_interval_s": 0.5,
        }
    )
    clock = Clock()
    sup = Supervisor(cfg, FakeLauncher(), clock)
    p = sup.spawn("s")
    sup.on_status(Ready(stage="s", pid=p.worker.pid, load_s=0.1))
    return sup, clock


def crash_and_restart(sup, clock):
    """The current worker dies; the back-off passes; returns the stage's state after."""
    p = sup.procs["s"]
    p.worker.ended = True
    (ended,) = sup.ended({})
    sup.on_death(ended)
    if p.state == "dead":
        return "dead"
    clock.t = p.restart_at
    (new,) = sup.due_restarts()
    sup.on_status(Ready(stage="s", pid=new.worker.pid, load_s=0.1))
    return new.state


def test_restarts_spread_wider_than_the_window_never_exhaust_the_budget():
    sup, clock = make(max_restarts=2, restart_window_s=60)
    for _ in range(10):  # one crash every two minutes: always restarted
        assert crash_and_restart(sup, clock) == "ready"
        clock.t += 120
    assert sup.procs["s"].restarts == 10


def test_too_many_restarts_within_the_window_leave_the_stage_dead():
    sup, clock = make(max_restarts=2, restart_window_s=60)
    assert crash_and_restart(sup, clock) == "ready"
    assert crash_and_restart(sup, clock) == "ready"
    assert crash_and_restart(sup, clock) == "dead"
    assert sup.health()["s"]["state"] == "dead" and not sup.health()["s"]["healthy"]


def test_backoff_doubles_with_recent_restarts_and_is_capped():
    sup, clock = make(max_restarts=10, restart_window_s=1e6, restart_backoff_s=1.0)
    waits = []
    for _ in range(6):
        p = sup.procs["s"]
        p.worker.ended = True
        sup.on_death(sup.ended({})[0])
        waits.append(p.restart_at - clock.t)
        clock.t = p.restart_at
        sup.due_restarts()
    assert waits == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_silent_stage_is_unresponsive_then_hung_and_killed():
    sup, clock = make(stall_timeout_s=5.0)
    clock.t += 1.6  # past three missed heartbeats: health says so, nothing killed yet
    h = sup.health()["s"]
    assert h["state"] == "unresponsive" and not h["healthy"]
    assert sup.check_liveness() == []
    clock.t += 3.6
    (hung,) = sup.check_liveness()
    assert hung.worker.killed and hung.state == "hung"
    message, code = sup.why(hung)
    assert code == "stage_hung" and "no heartbeat for 5.2 s" in message
    sup.on_death(sup.ended({})[0])
    assert hung.state == "restarting"


def test_a_stage_busy_on_one_step_past_its_stall_timeout_is_hung():
    sup, clock = make(stall_timeout_s=5.0)
    for busy in (1.0, 3.0, 4.9):  # heartbeats keep coming; the step does not end
        clock.t += 0.5
        sup.on_status(Heartbeat(stage="s", pid=1, ts=0, stats=StageStats(busy_s=busy)))
        assert sup.check_liveness() == []
    clock.t += 0.2
    (hung,) = sup.check_liveness()
    assert "busy on one step for 5.1 s" in sup.why(hung)[0]


def test_no_stall_timeout_means_no_hang_detection():
    sup, clock = make(stall_timeout_s=None)
    clock.t += 1e6
    assert sup.check_liveness() == []


def test_a_restart_that_never_becomes_ready_is_killed_after_ready_timeout():
    sup, clock = make()
    p = sup.procs["s"]
    p.worker.ended = True
    sup.on_death(sup.ended({})[0])
    clock.t = p.restart_at
    (new,) = sup.due_restarts()
    clock.t += sup.cfg.ready_timeout_s + 1
    (hung,) = sup.check_liveness()
    assert hung is new and "not ready" in hung.hung


def crash(sup, clock):
    """The current worker dies now; returns the stage's state and its back-off (s)."""
    p = sup.procs["s"]
    p.worker.ended = True
    sup.on_death(sup.ended({})[0])
    return p.state, p.restart_at - clock.t


def restart(sup, clock):
    """The back-off passes; the new worker comes up."""
    clock.t = sup.procs["s"].restart_at
    (new,) = sup.due_restarts()
    sup.on_status(Ready(stage="s", pid=new.worker.pid, load_s=0.1))


@pytest.mark.parametrize(("quiet_s", "after"), [(60.0, "dead"), (60.001, "restarting")])
def test_a_restart_leaves_the_window_one_tick_past_restart_window_s(quiet_s, after):
    sup, clock = make(max_restarts=2, restart_window_s=60, restart_backoff_s=1.0)
    crash(sup, clock)
    restart(sup, clock)  # the first restart, at t1
    t1 = clock.t
    crash(sup, clock)
    restart(sup, clock)  # the second: the budget is spent while t1 is in the window
    clock.t = t1 + quiet_s
    assert crash(sup, clock)[0] == after
    assert sup.health()["s"]["state"] == after


def test_the_backoff_starts_over_after_a_quiet_window():
    sup, clock = make(max_restarts=4, restart_window_s=60, restart_backoff_s=1.0)
    waits = []
    for _ in range(3):  # a burst of crashes: the back-off doubles
        waits.append(crash(sup, clock)[1])
        restart(sup, clock)
    assert waits == [1.0, 2.0, 4.0]
    clock.t += 60.001  # every restart of the burst is now older than the window
    assert crash(sup, clock) == ("restarting", 1.0)
    restart(sup, clock)
    for _ in range(3):  # and the whole budget is back: three more in a row survive
        assert crash(sup, clock)[0] == "restarting"
        restart(sup, clock)
    assert crash(sup, clock)[0] == "dead"
