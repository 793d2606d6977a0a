"""The fault paths at their edges, as a caller sees them: a frame salvaged around a bad
message, a slow reader's merged inbox, a request's deadline, a stage's sequence numbers.
No process, except where the stage itself has to see the fault."""

from types import SimpleNamespace

import msgspec
import pytest
from omni_core import Pipeline
from omni_core.client import collector as collector_module
from omni_core.client.collector import Collector
from omni_core.client.delivery import DONE, Inbox
from omni_core.config import parse_config
from omni_core.control import request_table as request_table_module
from omni_core.control.request_table import RequestTable
from omni_core.dataplane.serial import (
    ArrayCodec,
    decode_event_frame,
    encode_events_into,
    salvage_frame,
)
from omni_core.events import Cancelled, Completed, Error, ImageProgress, Segment
from omni_testing.configs import chain
from omni_testing.faults import wait_for

FAST = {"heartbeat_interval_s": 0.05}


def seg(rid, seq, stage="s", **kw):
    return Segment(request_id=rid, sequence=seq, stage=stage, tokens=[seq], **kw)


# -- a frame with one bad message ------------------------------------------------------


def test_a_packed_run_beside_a_bad_message_comes_back_as_its_segments():
    run = [seg("good", i, payload={"text": f"t{i}"}) for i in range(3)]
    bad = Segment(request_id="bad", stage="s", sequence=0, payload={0: "x"})  # int key
    msgs = [*run, bad, seg("other", 0), Completed(request_id="good", stage="s", sequence=3)]
    frame = bytearray()
    encode_events_into(msgs, frame)  # the three of "good" travel as one packed run
    with pytest.raises(msgspec.DecodeError):
        decode_event_frame(frame)
    good, errors = salvage_frame(frame, "event")
    assert good == [*run, msgs[4], msgs[5]]  # every segment of the run, in order
    assert [(e.request_id, e.stage) for e in errors] == [("bad", "s")]


# -- a slow reader ---------------------------------------------------------------------


def drained(inbox: Inbox) -> list:
    inbox.put(DONE)
    return list(inbox)


def preview(step, stage="vae", **kw):
    return ImageProgress(request_id="r", stage=stage, step=step, **kw)


def test_previews_merge_only_once_coalesce_after_events_wait_and_the_newest_is_kept():
    inbox = Inbox(None, coalesce_after=3)
    for step in (1, 2, 3):  # up to the limit: every one waits as it is
        inbox.put(preview(step))
    assert len(inbox) == 3
    inbox.put(preview(4))  # one past: it takes the place of the newest waiting one
    inbox.put(preview(5))
    inbox.put(preview(2, stage="other"))  # another stage's has nothing to replace
    inbox.put(preview(6, is_last=True))  # the final image is never merged away
    events = drained(inbox)
    assert [(e.stage, e.step) for e in events] == [
        ("vae", 1),
        ("vae", 2),
        ("vae", 5),
        ("other", 2),
        ("vae", 6),
    ]
    assert [e.sequence for e in events] == list(range(5))  # dense for the caller


def test_merged_segments_keep_every_token_logprob_and_character():
    inbox = Inbox(None, coalesce_after=2)
    pieces = ["Hel", "lo", ", ", "wor", "ld"]
    for i, text in enumerate(pieces):
        inbox.put(
            Segment(
                request_id="r",
                stage="decode",
                tokens=[i],
                logprobs=[-float(i)],
                payload={"text": text, "ids": [i], "step": i},
                is_last=i == len(pieces) - 1,
            )
        )
    inbox.put(Completed(request_id="r", stage="decode"))
    first, *merged, end = drained(inbox)
    assert first.payload["text"] == "Hel"  # under the limit: as they came
    (rest,) = merged  # at it: the rest merged into the newest waiting one
    assert rest.payload == {"text": "lo, world", "ids": [1, 2, 3, 4], "step": 4}
    assert (rest.tokens, rest.logprobs, rest.is_last) == (
        [1, 2, 3, 4],
        [-1.0, -2.0, -3.0, -4.0],
        True,
    )
    assert end.event_type == "completed"
    assert [e.sequence for e in (first, rest, end)] == [0, 1, 2]


# -- a stage's sequence numbers --------------------------------------------------------


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        ([0, 1, 2], None),
        ([0, 1, 1], "event sequence 1 where 2 was expected (repeated event)"),  # a duplicate
        ([0, 1, 0], "event sequence 0 where 2 was expected (repeated event)"),  # an older one
        ([0, 1, 3], "event sequence 3 where 2 was expected (lost event)"),  # a lost one
    ],
)
def test_a_streaming_stage_must_number_its_events_exactly_one_apart(sequences, message):
    collector = Collector(["s"], ["s"], ArrayCodec("client"))
    h = collector.open("r")
    for n in sequences:
        collector.on_event(seg("r", n))
    collector.on_event(Completed(request_id="r", stage="s", sequence=len(sequences)))
    *segments, end = list(h)
    if message is None:
        assert end.event_type == "completed"
        assert [t for e in segments for t in e.tokens] == sequences
    else:
        assert isinstance(end, Error) and end.code == "sequence_gap" and message in end.message
        assert [t for e in segments for t in e.tokens] == [0, 1]  # nothing after the fault
        assert h.finish_reason == "error"


# -- a request's deadline --------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_deadline_expires_at_its_exact_time_and_its_cancel_is_sent(monkeypatch):
    clock = Clock()
    fake = SimpleNamespace(monotonic=clock, time=lambda: 0.0)
    monkeypatch.setattr(request_table_module, "time", fake)
    monkeypatch.setattr(collector_module, "time", fake)
    cfg = parse_config({"stages": [{"name": "s", "kind": "synthetic.faulty"}]})
    table = RequestTable(cfg, Collector(["s"], ["s"], ArrayCodec("client")))
    a = table.open("a", {}, 1.0, None)
    b = table.open("b", {}, 2.0, None)
    table.open("c", {}, None, None)
    clock.t += 0.999
    assert table.expire() == []
    clock.t = 1001.0  # a's deadline, exactly: a ends, and its cancel goes to the stages
    assert table.expire() == ["a"]
    assert [(type(e), e.reason) for e in a] == [(Cancelled, "timeout")]
    assert not b.done and table.expire() == []
    clock.t = 1002.0
    assert table.expire() == ["b"] and b.finish_reason == "timeout"
    assert set(table.collector.handles) == {"c"}


def test_a_request_that_times_out_is_cancelled_in_the_stage_holding_it():
    cfg = chain(("probe", "synthetic.end_probe", {}, {"max_inflight": 1}), **FAST)
    with Pipeline(cfg) as pipe:
        acks = pipe.metrics()["cancel_acks"]
        # 2,000 steps of 5 ms: it would hold the stage for 10 s
        timed = pipe.submit({"n": 2000}, timeout_s=0.3)
        end = list(timed)[-1]
        assert end.event_type == "cancelled" and end.reason == "timeout"
        wait_for(lambda: pipe.metrics()["cancel_acks"] > acks, 5, "the stage's cancel ack")
        # the stage let go of it: the next request is served, and the stage ended it
        (after,) = pipe.generate([{"n": 1}], timeout_s=5)
        assert after.ok, after.error
        assert after.events[0].payload["ends"] >= 1
