"""Request priority end to end on real workers (synthetic stages): the order a busy stage
serves waiting requests in, and what a pipeline accepts as a priority."""

import random

import pytest
from omni_core import Pipeline
from omni_core.errors import UserInputError
from omni_testing.configs import chain
from omni_testing.faults import wait_for

FAST = {"heartbeat_interval_s": 0.05}


def held(policy, hold_s=0.2, **stage):
    return chain(
        ("hold", "synthetic.sleep", {"hold_s": hold_s}, {"scheduler_policy": policy, **stage}),
        **FAST,
    )


def served_order(pipe, requests):
    """Submit ``requests`` (id -> priority) while the stage holds a blocker; the ids in
    the order the stage started them."""
    blocker = pipe.submit({}, request_id="blocker")
    wait_for(lambda: pipe.metrics()["stages"]["hold"]["dequeued"] >= 1, 10, "blocker held")
    handles = {rid: pipe.submit({"priority": p}, request_id=rid) for rid, p in requests.items()}
    assert list(blocker)[-1].event_type == "completed"
    started = {}
    for rid, h in handles.items():
        events = list(h)
        assert events[-1].event_type == "completed", events
        started[rid] = events[0].payload["start"]
    return sorted(started, key=started.get)


def test_a_busy_stage_serves_the_waiting_requests_by_priority_then_arrival():
    rng = random.Random(7)
    requests = {f"r{i}": rng.choice([-2, 0, 0, 3]) for i in range(8)}
    with Pipeline(held("priority", hold_s=0.4)) as pipe:
        order = served_order(pipe, requests)
    arrival = list(requests)
    assert order == sorted(arrival, key=lambda r: (requests[r], arrival.index(r)))


def test_first_come_first_served_keeps_arrival_order_whatever_the_priority():
    requests = {"a": 0, "b": 0, "c": 0}
    with Pipeline(held("fcfs", hold_s=0.3)) as pipe:
        assert served_order(pipe, requests) == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("priority", "why"),
    [
        (1, "schedules first come, first served"),
        (-1, "schedules first come, first served"),
        (True, "expected an integer, got bool"),
        ("1", "expected an integer, got str"),
        (1.0, "expected an integer, got float"),
    ],
)
def test_a_fcfs_pipeline_refuses_a_priority_it_would_not_honour(priority, why):
    with Pipeline(held("fcfs", hold_s=0.0)) as pipe:
        with pytest.raises(UserInputError, match=f"field 'priority': .*{why}"):
            pipe.submit({"priority": priority})
        assert list(pipe.submit({"priority": 0}))[-1].event_type == "completed"
        assert pipe.healthy and pipe.backend.open_requests() == 0


def test_a_priority_is_a_64_bit_integer_the_bounds_pass_one_past_fails():
    with Pipeline(held("priority", hold_s=0.0)) as pipe:
        for ok in (-(2**63), 2**63 - 1):
            assert list(pipe.submit({"priority": ok}))[-1].event_type == "completed"
        for bad in (-(2**63) - 1, 2**63):
            with pytest.raises(UserInputError, match="field 'priority': .* out of range"):
                pipe.submit({"priority": bad})
