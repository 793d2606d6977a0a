"""The request table at its edges, as a caller and a stage see them: which timeouts are
accepted, the wall-clock deadline sent to the stages, the admission cap at its exact
limit, and which requests a replica's death takes down. No process."""

import math
from types import SimpleNamespace

import pytest
from omni_core.client.collector import Collector
from omni_core.config import parse_config
from omni_core.control import request_table as request_table_module
from omni_core.control.request_table import RequestTable
from omni_core.dataplane.serial import ArrayCodec
from omni_core.errors import OverloadedError
from omni_core.events import Completed, Error


def table(**cfg) -> RequestTable:
    """A table for the chain ``s -> d`` (``d`` the sink): a request stays open after
    ``s`` completes it."""
    config = parse_config({"stages": [{"name": "s", "kind": "synthetic.faulty"}], **cfg})
    return RequestTable(config, Collector(["d"], ["d"], ArrayCodec("client")))


# -- timeouts and deadlines ------------------------------------------------------------


@pytest.mark.parametrize("timeout_s", [0.0, -0.5, -1.0, math.inf, math.nan])
def test_a_timeout_that_is_not_positive_and_finite_is_refused(timeout_s):
    t = table()
    with pytest.raises(ValueError, match="timeout_s must be a positive finite number"):
        t.open("r", {}, timeout_s, None)
    assert t.collector.handles == {}  # nothing was opened


@pytest.mark.parametrize("timeout_s", [1e-9, 1e9])
def test_the_smallest_and_a_huge_finite_timeout_are_accepted(timeout_s):
    h = table().open("r", {}, timeout_s, None)
    assert h.deadline == h.submitted + timeout_s


def test_the_stages_get_a_wall_clock_deadline_timeout_s_ahead(monkeypatch):
    monkeypatch.setattr(request_table_module, "time", SimpleNamespace(time=lambda: 500.0))
    t = table()
    assert t.open("a", {}, 2.5, None).deadline_wall == 502.5
    assert t.open("b", {}, None, None).deadline_wall is None


# -- admission control -----------------------------------------------------------------


def test_the_cap_admits_exactly_max_queued_requests_and_refuses_one_more():
    t = table(max_queued_requests=2)
    a = t.open("a", {}, None, None)
    t.open("b", {}, None, None)  # the cap itself: admitted
    with pytest.raises(
        OverloadedError, match=r"2 requests are open \(max_queued_requests=2\)"
    ) as e:
        t.open("c", {}, None, None)
    assert e.value.retry_after_s == 1.0 and e.value.code == "overloaded"
    assert set(t.collector.handles) == {"a", "b"}
    t.cancel(a.request_id)  # one ends: room for exactly one more
    t.open("c", {}, None, None)
    with pytest.raises(OverloadedError):
        t.open("d", {}, None, None)


def test_no_cap_admits_any_number():
    t = table()
    for i in range(50):
        t.open(str(i), {}, None, None)
    assert len(t.collector.handles) == 50


# -- a stage's death -------------------------------------------------------------------


def opened(t: RequestTable, rid: str, routes: dict[str, int] | None):
    h = t.open(rid, {}, None, None)
    t.collector.bind(h, routes)
    return h


def test_a_replicas_death_fails_only_the_requests_bound_to_it():
    t = table()
    # the requests of other replicas (and an unbound one) come first: the scan goes on
    other = opened(t, "other", {"s": 1})
    unbound = opened(t, "unbound", None)
    mine = opened(t, "mine", {"s": 0})
    also = opened(t, "also", {"s": 0})
    cancel, replay = t.on_stage_death("s", 0, ["d"], False, "it died", "stage_died")
    assert sorted(cancel) == ["also", "mine"] and replay == []
    assert not other.done and not unbound.done
    for h in (mine, also):
        (err,) = list(h)
        assert isinstance(err, Error) and err.code == "stage_died" and err.message == "it died"
    assert set(t.collector.handles) == {"other", "unbound"}


def test_a_whole_stages_death_fails_every_request_that_needs_it():
    t = table()
    a = opened(t, "a", {"s": 1})
    b = opened(t, "b", None)
    cancel, _ = t.on_stage_death("s", None, ["d"], False, "it died", "stage_died")
    assert sorted(cancel) == ["a", "b"] and a.done and b.done


def past_s(t: RequestTable, h, *, edge: bool, downstream_done: bool = False) -> None:
    """``s`` completed ``h``; its stream to ``d`` arrived (``edge``), or ``d`` is done."""
    t.collector.on_event(Completed(request_id=h.wire_id, stage="s"))
    if edge:
        h.edges_done.add(("s", "d"))
    if downstream_done:
        h.stages_done.add("d")


def test_a_death_spares_a_request_whose_output_already_arrived_downstream():
    t = table()
    gone = opened(t, "gone", {"s": 0})  # past s first: the scan goes on after it
    past_s(t, gone, edge=True)
    done_d = opened(t, "done_d", {"s": 0})  # d finished it (no stream recorded)
    past_s(t, done_d, edge=False, downstream_done=True)
    waiting = opened(t, "waiting", {"s": 0})  # s completed, its stream not arrived yet
    past_s(t, waiting, edge=False)
    held = opened(t, "held", {"s": 0})
    cancel, _ = t.on_stage_death("s", 0, ["d"], False, "it died", "stage_died")
    assert sorted(cancel) == ["held", "waiting"]
    assert not gone.done and not done_d.done and waiting.done and held.done


def test_a_replica_holds_only_its_own_requests_until_they_are_past_it():
    t = table()
    assert not t.holds("s", 0, ["d"])
    opened(t, "unbound", None)
    other = opened(t, "other", {"s": 1})
    assert not t.holds("s", 0, ["d"]) and t.holds("s", 1, ["d"])
    mine = opened(t, "mine", {"s": 0})
    assert t.holds("s", 0, ["d"])
    past_s(t, mine, edge=False)  # completed, its output not downstream yet: still held
    assert t.holds("s", 0, ["d"])
    mine.edges_done.add(("s", "d"))
    assert not t.holds("s", 0, ["d"]) and t.holds("s", 1, ["d"])
    past_s(t, other, edge=True)
    assert not t.holds("s", 1, ["d"])
