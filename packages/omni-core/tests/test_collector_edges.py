"""The collector as a caller sees it: what a request's output says, how often a request
is replayed and what a replay delivers again, how requests are counted, and the latency
figures (the percentiles at their edges). No process."""

import time
from types import SimpleNamespace

import pytest
from omni_core.client import collector as collector_module
from omni_core.client.collector import Collector, RequestOutput, Summary, collect
from omni_core.dataplane.serial import ArrayCodec
from omni_core.events import Cancelled, Completed, Error, ImageProgress, Segment


def seg(rid, seq, stage="s", tokens=None):
    return Segment(
        request_id=rid, sequence=seq, stage=stage, tokens=[seq] if tokens is None else tokens
    )


def tokens_of(events):
    return [t for e in events if isinstance(e, Segment) for t in e.tokens]


# -- a summary's figures -------------------------------------------------------------------


def test_a_summary_reports_count_mean_percentiles_and_max():
    s = Summary()
    assert s.report() == {"count": 0}
    for x in (37, 100, 1, *range(2, 37), *range(38, 100)):  # 1..100, not in order
        s.add(float(x))
    assert s.report() == {"count": 100, "mean": 50.5, "p50": 51.0, "p95": 96.0, "max": 100.0}


def test_a_summary_of_two_samples_takes_the_larger_as_p95():
    s = Summary()
    s.add(2.0)
    s.add(1.0)
    assert s.report() == {"count": 2, "mean": 1.5, "p50": 2.0, "p95": 2.0, "max": 2.0}


def test_a_summary_keeps_exactly_its_last_4096_samples():
    """The count and mean cover every sample; the percentiles and max the last 4096."""
    s = Summary()
    s.add(1e9)  # the 4,097th from the end: dropped
    s.add(1e6)  # the 4,096th: kept
    for _ in range(4095):
        s.add(0.0)
    r = s.report()
    assert r["count"] == 4097 and r["mean"] == pytest.approx((1e9 + 1e6) / 4097)
    assert r["max"] == 1e6 and r["p50"] == 0.0


# -- a request's output ----------------------------------------------------------------------


def test_a_request_output_reads_its_events():
    preview = ImageProgress(request_id="r", sequence=1, stage="img")
    events = [seg("r", 0, tokens=[5, 6]), preview, seg("r", 1, "t", tokens=[]), seg("r", 2)]
    out = RequestOutput("r", "completed", events)
    assert out.ok and out.tokens == [5, 6, 2] and out.final is events[-1]
    assert out.by_stage("s") == [events[0], events[3]] and out.by_stage("img") == [preview]
    empty = RequestOutput("r", "error", [], "boom")
    assert not empty.ok and empty.final is None and empty.tokens == []


# -- replays ---------------------------------------------------------------------------------


def test_a_request_is_replayed_twice_at_most_under_fresh_wire_ids():
    c = Collector(["s"], ["s"], ArrayCodec("client"))
    h = c.open("r")
    assert c.replay(h) == "r~1" and c.replay(h) == "r~2"
    assert c.replay(h) is None  # a third crash: the request fails instead
    assert c.counts["replayed"] == 2 and h.attempt == 2
    # the old attempts' late events are ignored; the last attempt's arrive
    assert c.on_event(seg("r~1", 0)) == ([], False)
    c.on_event(seg("r~2", 0))
    c.on_event(Completed(request_id="r~2", stage="s", sequence=1))
    *segments, end = list(h)
    assert tokens_of(segments) == [0] and end.event_type == "completed"


def test_a_replay_delivers_only_what_the_caller_does_not_have():
    c = Collector(["s"], ["s"], ArrayCodec("client"))
    h = c.open("r")
    c.on_event(seg("r", 0))
    c.on_event(seg("r", 1))
    wire = c.replay(h)  # the stage crashed: the new attempt makes 0, 1 again, then 2
    for n in range(3):
        c.on_event(seg(wire, n))
    c.on_event(Completed(request_id=wire, stage="s", sequence=3))
    *segments, end = list(h)
    assert tokens_of(segments) == [0, 1, 2] and end.event_type == "completed"


def test_previews_do_not_count_as_delivered_for_a_replay():
    """A preview may be dropped, so a replay's segment with its number still arrives."""
    c = Collector(["s"], [], ArrayCodec("client"), previews=["s"])
    h = c.open("r")
    c.on_event(seg("r", 0))
    c.on_event(ImageProgress(request_id="r", sequence=1, stage="s"))  # a preview
    wire = c.replay(h)
    c.on_event(seg(wire, 0))  # the caller has it
    c.on_event(seg(wire, 1))  # the caller had only a preview numbered 1: delivered
    c.on_event(Completed(request_id=wire, stage="s", sequence=2))
    events = list(h)
    assert tokens_of(events) == [0, 1] and events[-1].event_type == "completed"
    assert [type(e).__name__ for e in events] == [
        "Segment",
        "ImageProgress",
        "Segment",
        "Completed",
    ]


# -- counts and latencies --------------------------------------------------------------------


def test_each_ending_is_counted_once_under_its_reason():
    c = Collector(["s"], [], ArrayCodec("client"))
    handles = {rid: c.open(rid) for rid in ("ok", "bad", "cancel", "late")}
    c.on_event(Completed(request_id="ok", stage="s"))
    c.on_event(Error(request_id="bad", stage="s", message="boom"))
    c.finish(handles["cancel"], Cancelled(request_id="cancel"))
    c.finish(handles["late"], Cancelled(request_id="late", reason="timeout"))
    c.finish(handles["ok"], Error(request_id="ok", stage="s", message="after the end"))
    assert c.counts == {"completed": 1, "error": 1, "cancelled": 1, "timeout": 1, "replayed": 0}
    assert [h.finish_reason for h in handles.values()] == [
        "completed",
        "error",
        "cancelled",
        "timeout",
    ]
    assert not c.handles and not c.wire


def test_latencies_are_measured_from_submission(monkeypatch):
    clock = SimpleNamespace(t=1000.0)
    fake_time = SimpleNamespace(monotonic=lambda: clock.t, time=time.time)
    monkeypatch.setattr(collector_module, "time", fake_time)
    c = Collector(["s"], [], ArrayCodec("client"))
    h = c.open("r")  # submitted at 1000
    clock.t = 1001.0
    c.on_event(seg("r", 0))
    clock.t = 1003.0
    c.on_event(seg("r", 1))
    clock.t = 1006.0
    c.on_event(Completed(request_id="r", stage="s", sequence=2))
    out = collect(h)
    assert out.metrics == {"time_to_first_event_s": 1.0, "latency_s": 6.0}
    report = c.metrics.report()
    assert report["time_to_first_event_s"] == {
        "count": 1,
        "mean": 1.0,
        "p50": 1.0,
        "p95": 1.0,
        "max": 1.0,
    }
    # between the two segments only: the end is no event of the answer
    assert report["time_between_events_s"] == {
        "count": 1,
        "mean": 2.0,
        "p50": 2.0,
        "p95": 2.0,
        "max": 2.0,
    }
    assert report["completion_latency_s"]["mean"] == 6.0
    failed = c.open("f")
    clock.t = 1010.0
    c.on_event(Error(request_id="f", stage="s", message="boom"))
    assert collect(failed).metrics == {"time_to_first_event_s": 4.0, "latency_s": 4.0}
    assert c.metrics.report()["completion_latency_s"]["count"] == 1  # completions only


def test_a_summary_of_three_samples_takes_the_middle_as_p50():
    s = Summary()
    for x in (3.0, 1.0, 2.0):
        s.add(x)
    assert s.report()["p50"] == 2.0 and s.report()["p95"] == 3.0


# -- what an event does to its request ---------------------------------------------------------


def test_on_event_says_whether_the_request_just_failed():
    c = Collector(["s"], ["s"], ArrayCodec("client"))
    for rid in ("ok", "err", "gap"):
        c.open(rid)
    assert c.on_event(seg("ok", 0)) == ([], False)
    assert c.on_event(Completed(request_id="ok", stage="s", sequence=1)) == ([], False)
    assert c.on_event(Error(request_id="err", stage="s", message="boom")) == ([], True)
    assert c.on_event(seg("gap", 1)) == ([], True)  # 0 was lost
    assert c.counts["error"] == 2 and c.counts["completed"] == 1


def test_a_preview_between_segments_does_not_take_a_sequence_number():
    """A preview carries the number of the next must-deliver event, so dropping it (under
    backpressure) leaves no gap; the segment after it keeps that number."""
    c = Collector(["s"], ["s"], ArrayCodec("client"))
    h = c.open("r")
    c.on_event(seg("r", 0))
    c.on_event(ImageProgress(request_id="r", sequence=1, stage="s"))
    c.on_event(seg("r", 1))
    c.on_event(Completed(request_id="r", stage="s", sequence=2))
    *events, end = list(h)
    assert end.event_type == "completed" and tokens_of(events) == [0, 1]
    assert end.arrays == {} and all(e.arrays == {} for e in events)  # every event has arrays
