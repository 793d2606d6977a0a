"""StageHost's intake fast path: runs of array-free segments taken in one go."""

from omni_core.config import parse_config
from omni_core.events import Segment
from omni_core.host import StageHost, stage_context
from omni_core.serial import ArrayCodec
from omni_core.testing.configs import chain
from omni_core.testing.stages import Count


def make_host(size):
    cfg = parse_config(
        chain(
            ("burst", "synthetic.burst", {}),
            ("count", "synthetic.count", {}),
            edges=[{"from": "burst", "to": "count", "window": {"size": size}}],
        )
    )
    stage = Count(stage_context(cfg, "count", None))
    stage.load()
    return StageHost(cfg, "count", stage, ArrayCodec("count"))


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
    host = make_host(size=4)
    evs = segments(203, tokens_per_event=2)
    items = host.receive(evs[0])
    rest = evs[1:]
    while rest:
        got, n = host.receive_run(rest[:50], limit=1)
        assert 1 <= n <= 50
        items += got
        rest = rest[n:]
    windows = [it.inp.window for it in items]
    assert [t for w in windows for t in w.new_tokens] == list(range(406))
    assert all(w.units == 4 for w in windows[:-1]) and windows[-1].units == 2
    assert [p.payload["i"] for w in windows for p in w.pieces] == list(range(203))
    assert items[-1].inp.last


def test_pieces_cut_across_windows_carry_their_share_of_units():
    host = make_host(size=3)
    evs = segments(5, tokens_per_event=2)  # 10 tokens in pieces of 2, windows of 3
    items = host.receive(evs[0])
    got, n = host.receive_run(evs[1:], limit=100)
    items += got
    assert n == 4
    windows = [it.inp.window for it in items]
    assert [w.new_tokens for w in windows] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [[p.units for p in w.pieces] for w in windows] == [[2, 1], [1, 2], [2, 1], [1]]
