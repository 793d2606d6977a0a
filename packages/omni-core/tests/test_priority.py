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


def stepping(policy, fail="", **stage):
    return chain(
        (
            "loop",
            "synthetic.steps",
            {"steps": 40, "step_s": 0.02, "fail": fail},
            {"scheduler_policy": policy, **stage},
        ),
        **FAST,
    )


def tokens_and_end(handle):
    events = list(handle)
    assert events[-1].event_type == "completed", events
    return [t for e in events[:-1] for t in e.tokens], events[-2].payload


def started(pipe, n=1):
    wait_for(lambda: pipe.metrics()["stages"]["loop"]["dequeued"] >= n, 10, "started")


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_a_better_request_pauses_a_running_batch_which_then_resumes_intact(max_batch_size):
    with Pipeline(stepping("priority", max_batch_size=max_batch_size)) as pipe:
        low = pipe.submit({"priority": 5}, request_id="low")
        started(pipe)
        high = pipe.submit({"priority": -1, "steps": 3}, request_id="high")
        high_tokens, high_end = tokens_and_end(high)
        low_tokens, low_end = tokens_and_end(low)
        stats = pipe.metrics()["stages"]["loop"]
    assert high_tokens == [0, 1, 2] and low_tokens == list(range(40))  # nothing lost
    assert high_end["end"] < low_end["end"]
    assert (low_end["pauses"], low_end["resumes"]) == (1, 1)
    assert (high_end["pauses"], high_end["resumes"]) == (0, 0)
    assert stats["preemptions"] == 1 and stats["paused"] == 0


def test_an_equal_or_worse_request_never_pauses_a_batch_and_fcfs_never_does():
    for policy, priority in (("priority", 5), ("priority", 6), ("fcfs", 0)):
        with Pipeline(stepping(policy)) as pipe:
            low = pipe.submit({"priority": 5} if policy == "priority" else {})
            started(pipe)
            other = pipe.submit({"priority": priority, "steps": 3})
            _, low_end = tokens_and_end(low)
            _, other_end = tokens_and_end(other)
            assert low_end["end"] < other_end["end"], policy
            assert low_end["pauses"] == 0
            assert pipe.metrics()["stages"]["loop"]["preemptions"] == 0


def test_paused_batches_are_bounded_by_max_inflight_and_resume_best_first():
    # one place: low (9) runs; mid (5) pauses it; high (1) pauses mid; a second
    # high-ranked arrival (0) cannot pause high (one batch paused at most: max_inflight)
    with Pipeline(stepping("priority", max_inflight=1)) as pipe:
        low = pipe.submit({"priority": 9}, request_id="low")
        started(pipe, 1)
        mid = pipe.submit({"priority": 5, "steps": 20}, request_id="mid")
        wait_for(lambda: pipe.metrics()["stages"]["loop"]["preemptions"] >= 1, 10, "mid in")
        high = pipe.submit({"priority": 1, "steps": 20}, request_id="high")
        top = pipe.submit({"priority": 0, "steps": 3}, request_id="top")
        ends = {rid: tokens_and_end(h)[1] for rid, h in (("low", low), ("mid", mid))}
        ends.update({rid: tokens_and_end(h)[1] for rid, h in (("high", high), ("top", top))})
        stats = pipe.metrics()["stages"]["loop"]
    order = sorted(ends, key=lambda r: ends[r]["end"])
    assert stats["preemptions"] == 1  # low was paused once; mid then ran to its end
    assert order == ["mid", "top", "high", "low"]
    assert ends["low"]["pauses"] == 1 and ends["mid"]["pauses"] == 0


def test_a_paused_request_cancelled_ends_at_once_and_the_stage_goes_on():
    with Pipeline(stepping("priority")) as pipe:
        low = pipe.submit({"priority": 5, "steps": 400}, request_id="low")
        started(pipe)
        high = pipe.submit({"priority": 0, "steps": 100}, request_id="high")
        wait_for(lambda: pipe.metrics()["stages"]["loop"]["paused"] == 1, 10, "low paused")
        pipe.cancel("low")
        assert list(low)[-1].event_type == "cancelled"
        wait_for(lambda: pipe.metrics()["stages"]["loop"]["paused"] == 0, 10, "paused let go")
        tokens, _ = tokens_and_end(high)
        assert tokens == list(range(100)) and pipe.healthy


@pytest.mark.parametrize("fail", ["pause", "resume"])
def test_a_stage_whose_pause_or_resume_raises_fails_that_batch_only(fail):
    with Pipeline(stepping("priority", fail=fail)) as pipe:
        low = pipe.submit({"priority": 5}, request_id="low")
        started(pipe)
        high = pipe.submit({"priority": 0, "steps": 3}, request_id="high")
        tokens, _ = tokens_and_end(high)
        err = list(low)[-1]
        assert err.event_type == "error" and f"{fail} failed" in err.message
        assert tokens == [0, 1, 2]
        after = pipe.submit({"priority": 1, "steps": 2})
        assert tokens_and_end(after)[0] == [0, 1]  # the stage goes on
        assert pipe.healthy and pipe.metrics()["stages"]["loop"]["paused"] == 0
