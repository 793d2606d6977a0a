import msgspec
import pytest
from omni_core.dataplane.serial import (
    decode_control_frame,
    decode_data_frame,
    decode_event_frame,
    decode_status_frame,
    encode_events_into,
    encode_frame,
    pack_runs,
)
from omni_core.events import (
    Ack,
    Cancel,
    Cancelled,
    Completed,
    Error,
    Heartbeat,
    ImageProgress,
    InlineArray,
    LoadFailed,
    Ready,
    Release,
    Segment,
    SegmentRun,
    ShmHandle,
    Shutdown,
    StageStats,
    Submit,
)

EVENTS = [
    Segment(request_id="r", sequence=0, tokens=[1, 2], logprobs=[-0.5, -1.0], request={"p": 1}),
    Segment(
        request_id="r",
        sequence=1,
        is_last=True,
        device_handles={
            "h": ShmHandle("omni-1-x", 128, 4096, "<f4", (32, 32), "prefill"),
            "k": InlineArray(b"\x00" * 8, "<i4", (2,)),
        },
    ),
    ImageProgress(request_id="r", sequence=2, step=5, payload={"w": 64}),
    Completed(request_id="r", sequence=3, stage="s"),
    Error(request_id="q", message="boom", code="stage_error"),
    Cancelled(request_id="c", reason="timeout"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.event_type)
def test_event_round_trip(event):
    (back,) = decode_event_frame(encode_frame([event]))
    assert type(back) is type(event)
    assert back == event
    assert back.event_type == event.event_type


def test_event_kinds_and_terminal_flags():
    assert [e.event_type for e in EVENTS] == [
        "segment",
        "segment",
        "image",
        "completed",
        "error",
        "cancelled",
    ]
    assert [e.terminal for e in EVENTS] == [False, False, False, True, True, True]


def test_frame_keeps_order():
    events = [Segment(request_id="r", sequence=i, tokens=[i]) for i in range(100)]
    back = decode_event_frame(encode_frame(events))
    assert [e.sequence for e in back] == list(range(100))


def test_control_and_status_round_trip():
    ctl = [
        Cancel(request_id="r"),
        Release(slots=[(0, 1), (64, 2)], segment="omni-1-x", reader="b"),
        Shutdown(drain=True),
    ]
    assert decode_control_frame(encode_frame(ctl)) == ctl
    data = [Submit(request_id="r", request={"prompt": "x"}), EVENTS[0]]
    assert decode_data_frame(encode_frame(data)) == data
    status = [
        Ready(stage="a", pid=1, load_s=0.1),
        LoadFailed(stage="a", pid=1, message="x"),
        Heartbeat(stage="a", pid=1, ts=0.0, stats=StageStats(received=3)),
        Ack(stage="a", kind="cancel", request_id="r"),
    ]
    assert decode_status_frame(encode_frame(status)) == status


def test_nothing_is_unpickled():
    """A frame that is not one of our Structs is rejected, never executed."""
    import pickle

    with pytest.raises(msgspec.DecodeError):
        decode_event_frame(pickle.dumps([1]))
    with pytest.raises(msgspec.ValidationError):
        decode_event_frame(encode_frame([{"event_type": "os.system", "request_id": "x"}]))


def test_caller_side_arrays_attribute_is_not_serialized():
    e = Segment(request_id="r", tokens=[1])
    e.arrays = {"x": object()}
    (back,) = decode_event_frame(encode_frame([e]))
    assert not hasattr(back, "arrays")


def seg(rid, seq, **kw):
    return Segment(request_id=rid, sequence=seq, stage="a", tokens=[seq], payload={"i": seq}, **kw)


def test_runs_of_array_free_segments_travel_in_columns_and_come_back_equal():
    arrays = {"h": InlineArray(b"\x00" * 4, "<i4", (1,))}
    msgs = [
        seg("r", 0, request={"p": 1}),
        seg("r", 1, logprobs=[-0.5]),
        seg("r", 2),
        seg("q", 0),  # another request: a new run
        seg("q", 1),
        seg("q", 2, device_handles=arrays),  # arrays: alone
        seg("q", 3),
        seg("q", 5),  # a gap in the sequence: not one run
        Completed(request_id="q", sequence=6, stage="a"),
        seg("p", 0),
        seg("p", 1, is_last=True),  # the end of a stream ends its run ...
        seg("p", 2),  # ... even if (wrongly) more follows
    ]
    packed = pack_runs(msgs)
    kinds = [(type(m).__name__, len(m) if type(m) is SegmentRun else 1) for m in packed]
    assert kinds == [
        ("SegmentRun", 3),
        ("SegmentRun", 2),
        ("Segment", 1),
        ("Segment", 1),
        ("Segment", 1),
        ("Completed", 1),
        ("SegmentRun", 2),
        ("Segment", 1),
    ]
    run = packed[0]
    assert run.logprobs == [None, [-0.5], None] and run.request == {"p": 1}
    assert packed[1].logprobs is None and packed[6].is_last
    frame = bytearray(b"stale bytes of an earlier, longer frame" * 100)
    encode_events_into(msgs, frame)
    assert decode_event_frame(frame) == msgs  # the caller's side: expanded, equal
    assert decode_data_frame(frame) == packed  # a worker's side: still in columns


def test_a_run_split_for_a_full_queue_keeps_its_numbering_and_end():
    run = SegmentRun.of([seg("r", i) for i in range(5)] + [seg("r", 5, is_last=True)], "a", 0)
    tail = run.tail(4)
    assert [s.sequence for s in tail.segments()] == [4, 5]
    assert tail.segments()[-1].is_last and tail.request is None
    assert [s.payload for s in tail.segments()] == [{"i": 4}, {"i": 5}]


def test_a_run_whose_columns_disagree_is_rejected_when_decoded():
    run = SegmentRun.of([seg("r", 0), seg("r", 1)], "a", 0)
    raw = msgspec.msgpack.encode([msgspec.structs.asdict(run) | {"event_type": "segment_run"}])
    assert decode_data_frame(raw)[0] == run
    bad = msgspec.structs.asdict(run) | {"event_type": "segment_run", "tokens": [[0]]}
    with pytest.raises(msgspec.ValidationError, match="one entry per segment"):
        decode_data_frame(msgspec.msgpack.encode([bad]))
