"""The collector as a caller sees it: what a request's output says, how often a request
is replayed and what a replay delivers again, how requests are counted, the latency
figures (the percentiles at their edges), arrays out of shared memory, and a reader whose
event loop closed. No process."""

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest
from omni_core.client import collector as collector_module
from omni_core.client.collector import Collector, RequestOutput, Summary, collect
from omni_core.dataplane.serial import ArrayCodec, releases
from omni_core.dataplane.shm import Arena, SegmentOwner, SegmentReader
from omni_core.events import Cancelled, Completed, Error, ImageProgress, Segment, ShmHandle


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
    for n in range(3):  # what the caller has is skipped, and fails nothing
        assert c.on_event(seg(wire, n)) == ([], False)
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


def test_a_first_preview_does_not_count_as_delivered_for_a_replay():
    """A preview numbered 0 (the request's first event) is no must-deliver event either:
    the replay's segment 0 still arrives."""
    c = Collector(["s"], [], ArrayCodec("client"), previews=["s"])
    h = c.open("r")
    c.on_event(ImageProgress(request_id="r", sequence=0, stage="s", step=1))
    wire = c.replay(h)
    c.on_event(seg(wire, 0))
    c.on_event(Completed(request_id=wire, stage="s", sequence=1))
    assert [e.event_type for e in h] == ["image", "segment", "completed"]


def test_a_final_image_the_caller_has_is_not_delivered_again_by_a_replay():
    c = Collector(["s"], [], ArrayCodec("client"), previews=["s"])
    h = c.open("r")
    c.on_event(ImageProgress(request_id="r", sequence=0, stage="s", step=8, is_last=True))
    wire = c.replay(h)  # the stage crashed before it completed the request
    assert c.on_event(ImageProgress(request_id=wire, sequence=0, stage="s", is_last=True)) == (
        [],
        False,
    )
    c.on_event(Completed(request_id=wire, stage="s", sequence=1))
    events = list(h)
    assert [(e.event_type, getattr(e, "step", None)) for e in events] == [
        ("image", 8),
        ("completed", None),
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


# -- a handle's counts and the trace ------------------------------------------------------------


def test_a_handle_says_how_many_events_wait_and_the_next_ones_number():
    c = Collector(["s"], [], ArrayCodec("client"))
    c.trace = []
    h = c.open("r")
    assert (h.waiting, h.sequence) == (0, 0)
    c.on_event(seg("r", 0))
    c.on_event(seg("r", 1))
    assert (h.waiting, h.sequence) == (2, 2)
    assert next(iter(h)).tokens == [0]
    assert (h.waiting, h.sequence) == (1, 2)  # one read: one fewer waits
    c.on_event(Completed(request_id="r", stage="s", sequence=2))
    assert (h.waiting, h.sequence) == (3, 3)  # the end, and the end of the stream
    assert [(m.sequence, m.event_type) for m in c.trace] == [
        (0, "segment"),
        (1, "segment"),
        (2, "completed"),
    ]


# -- arrays out of shared memory ---------------------------------------------------------------


@pytest.fixture
def slots(tmp_path):
    """A producer ``s`` whose arrays go through a shared-memory slot, and the caller's
    codec that maps its segment."""
    owner = SegmentOwner(str(tmp_path))
    name = owner.create("s", 1 << 16)
    arena = Arena(name, str(tmp_path))
    producer = ArrayCodec("s", arena=arena, threshold=1)
    yield SimpleNamespace(
        owner=owner,
        name=name,
        arena=arena,
        producer=producer,
        caller=ArrayCodec("client", reader=SegmentReader(str(tmp_path))),
    )
    arena.close()
    owner.unlink_all()


def test_an_events_arrays_stay_the_callers_once_its_slot_is_reused(slots):
    c = Collector(["s"], [], slots.caller)
    h = c.open("r")
    handles = slots.producer.pack({"image": np.arange(64, dtype=np.uint8)}, {"client": 1})
    assert isinstance(handles["image"], ShmHandle)
    done, failed = c.on_event(Segment(request_id="r", stage="s", device_handles=handles))
    assert done == [handles["image"]] and not failed  # the slot goes back at once
    for _, release in releases(done, "client"):
        slots.arena.release(release.slots, release.reader)
    again = slots.producer.pack({"image": np.full(64, 255, np.uint8)}, {"client": 1})
    assert again["image"].offset == handles["image"].offset  # the same slot, rewritten
    c.on_event(Completed(request_id="r", stage="s", sequence=1))
    ev, end = list(h)
    assert ev.arrays["image"].tolist() == list(range(64)) and end.event_type == "completed"


def test_an_event_whose_segment_is_gone_fails_its_request_and_others_go_on(slots):
    c = Collector(["s"], [], slots.caller)
    lost, other = c.open("lost"), c.open("other")
    handles = slots.producer.pack({"image": np.arange(64, dtype=np.uint8)}, {"client": 1})
    slots.owner.unlink(slots.name)  # its producer died: the segment was removed
    done, failed = c.on_event(Segment(request_id="lost", stage="s", device_handles=handles))
    assert done == [handles["image"]] and failed  # the slot is still given back
    (end,) = list(lost)
    assert isinstance(end, Error) and end.message.startswith("stage 's': ")
    assert "No such file" in end.message and lost.finish_reason == "error"
    c.on_event(seg("other", 0))
    c.on_event(Completed(request_id="other", stage="s", sequence=1))
    assert [e.event_type for e in other] == ["segment", "completed"]
    assert c.counts["error"] == 1 and c.counts["completed"] == 1


# -- a reader whose event loop closed -----------------------------------------------------------


def test_a_request_whose_readers_loop_closed_is_cancelled_once_and_named_an_orphan():
    """Whether its reader never started or awaited the next event when ``asyncio.run``
    returned: the next event finds nobody, and the request ends cancelled."""
    c = Collector(["s"], [], ArrayCodec("client"))

    async def caller(request_id: str, start_reading: bool):
        h = c.open(request_id, asyncio.get_running_loop())
        if start_reading:
            asyncio.create_task(anext(aiter(h)))
            await asyncio.sleep(0)  # the reader awaits the first event
        return h

    idle = asyncio.run(caller("idle", start_reading=False))
    awaiting = asyncio.run(caller("awaiting", start_reading=True))
    assert c.on_event(seg("idle", 0)) == ([], False)
    assert c.on_event(seg("awaiting", 0)) == ([], False)
    assert c.take_orphans() == ["idle", "awaiting"]
    assert idle.finish_reason == awaiting.finish_reason == "cancelled"
    assert c.counts["cancelled"] == 2 and not c.handles
    assert c.on_event(seg("idle", 1)) == ([], False)  # a late event: ignored
    assert c.take_orphans() == []
