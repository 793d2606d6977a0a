"""StageHost's hot paths: runs of array-free segments taken in one go, and a step's
list of segments stamped into runs."""

import pytest
from omni_core.config import parse_config
from omni_core.dataplane.serial import ArrayCodec
from omni_core.events import Segment, SegmentRun, Submit
from omni_core.worker.host import RequestFailed, StageHost, stage_context
from omni_testing.configs import chain
from omni_testing.stage_thread import windowed_host
from omni_testing.stages import Count


def segments(n, tokens_per_event=1):
    return [
        Segment(
            request_id="r",
            sequence=i,
            stage="burst",
            tokens=list(range(i * tokens_per_event, (i + 1) * tokens_per_event)),
            payload={"i": i},
            is_last=i == n - 1,
            request={"n": n} if i == 0 else None,
        )
        for i in range(n)
    ]


def test_a_run_taken_in_parts_consumes_exactly_what_it_reports():
    # the worker takes a run until its queue is full (limit), puts the rest back, and
    # comes back for it: the count it is told must be the events the windows took
    host = windowed_host(size=4)
    evs = segments(203, tokens_per_event=2)
    items = host.receive(evs[0])
    rest = evs[1:]
    while rest:
        part = rest[:50]
        got, n = host.receive_run(SegmentRun.of(part, "burst", part[0].sequence), limit=1)
        assert 1 <= n <= 50
        if n < len(part):  # stopped at the segment that completed the one window it had room for
            (item,) = got
            assert item.inp.window.tokens[-1] == part[n - 1].tokens[-1]
        else:
            assert len(got) <= (2 if part[-1].is_last else 1)  # (+ the end's remainder)
        items += got
        rest = rest[n:]
    windows = [it.inp.window for it in items]
    assert [t for w in windows for t in w.new_tokens] == list(range(406))
    assert all(w.units == 4 for w in windows[:-1]) and windows[-1].units == 2
    assert [p.payload["i"] for w in windows for p in w.pieces] == list(range(203))
    assert items[-1].inp.last


def test_pieces_cut_across_windows_carry_their_share_of_units():
    host = windowed_host(size=3)
    evs = segments(5, tokens_per_event=2)  # 10 tokens in pieces of 2, windows of 3
    items = host.receive(evs[0])
    got, n = host.receive_run(SegmentRun.of(evs[1:], "burst", 1), limit=100)
    items += got
    assert n == 4
    windows = [it.inp.window for it in items]
    assert [w.new_tokens for w in windows] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [[p.units for p in w.pieces] for w in windows] == [[2, 1], [1, 2], [2, 1], [1]]


def test_a_run_sets_its_request_up_checks_its_numbering_and_is_dropped_once_ended():
    host = windowed_host(size=4)
    evs = segments(6)
    items, n = host.receive_run(SegmentRun.of(evs[:3], "burst", 0, evs[0].request), 10)
    assert n == 3 and items == []
    assert host.requests["r"].request == {"n": 6}
    with pytest.raises(RequestFailed, match="sequence 4 where 3 was expected"):
        host.receive_run(SegmentRun.of(evs[4:], "burst", 4), 10)
    host.forget("r")  # cancelled: what still comes is dropped, counted
    assert host.receive_run(SegmentRun.of(evs[3:], "burst", 3), 10) == ([], 3)
    assert host.dropped_late == 3


def test_a_steps_list_becomes_one_run_per_request_in_order():
    cfg = parse_config(chain(("src", "synthetic.burst", {}), ("sink", "synthetic.count", {})))
    host = StageHost(cfg, "src", Count(stage_context(cfg, "src", None)), ArrayCodec("src"))
    for rid in ("a", "b", "c"):
        host.submit(Submit(request_id=rid, request={"id": rid}))
    host.forget("c")  # ended here: its events are left out

    def ev(rid, t, last=False):
        return Segment(request_id=rid, tokens=[t], is_last=last)

    step = [ev("a", 0), ev("a", 1), ev("b", 0), ev("c", 0), ev("a", 2, last=True), ev("a", 3)]
    out = host.emit_plain(step)
    assert [(type(m).__name__, m.request_id, m.sequence) for m in out] == [
        ("SegmentRun", "a", 0),
        ("Segment", "b", 0),
        ("Segment", "a", 2),  # the end of a stream ends its run
        ("Segment", "a", 3),
    ]
    assert out[0].request == {"id": "a"} and out[1].request == {"id": "b"}
    assert out[0].tokens == [[0], [1]] and out[2].is_last
    assert out[0].stage == out[1].stage == "src"


@pytest.mark.parametrize("size", [-1, 1, 3])
def test_a_run_with_unitless_segments_gives_the_windows_of_its_events_one_by_one(size):
    def stream():
        evs = segments(12)
        for i in (0, 4, 5, 11):  # end markers with a payload and no tokens
            evs[i].tokens = []
        return evs

    one = windowed_host(size)
    expected = [w for ev in stream() for w in one.receive(ev)]
    cols = windowed_host(size)
    evs = stream()
    got = cols.receive(evs[0])
    for lo, hi in ((1, 7), (7, 12)):
        got += cols.receive_run(SegmentRun.of(evs[lo:hi], "burst", lo), 100)[0]

    def key(items):
        return [
            (w.tokens, w.payloads, w.units, [(p.sequence, p.units) for p in w.pieces], w.is_last)
            for w in (it.inp.window for it in items)
        ]

    assert key(got) == key(expected) and len(got) >= (1 if size < 0 else 2)
