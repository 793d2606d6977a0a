"""The stage thread and the work queue: an item of a request that ended here (a failure
at intake, a cancel) gives its slots back to their producers at once, even when nothing
else arrives and the stage thread goes idle."""

import queue
import threading
import time

import pytest
from omni_core.config import parse_config
from omni_core.dataplane.serial import ArrayCodec
from omni_core.events import Completed, Release, Segment, SegmentRun, ShmHandle
from omni_core.stage import StageInput
from omni_core.worker.host import StageHost, WorkItem, stage_context
from omni_core.worker.stage_thread import StageThread
from omni_core.worker.state import WorkerState
from omni_core.worker.work_queue import WorkQueue
from omni_testing.configs import chain
from omni_testing.stage_thread import windowed_host
from omni_testing.stages import Count

SEGMENT = "omni-1-x-burst-0-" + "0" * 16  # a slot of the producer's arena


class Outbox:
    """Records what the worker sends (its slot releases)."""

    def __init__(self) -> None:
        self.sent: queue.Queue = queue.Queue()

    def put(self, dest, msg, **_):
        self.sent.put((dest, msg))


class Quiet:
    """A sender and a waker with nothing behind them."""

    def put(self, *_, **__):
        pass

    def flush(self):
        pass

    def kick(self):
        pass


def idle_worker():
    cfg = parse_config(chain(("burst", "synthetic.burst", {}), ("count", "synthetic.count", {})))
    stage = Count(stage_context(cfg, "count", None))
    stage.load()
    host = StageHost(cfg, "count", stage, ArrayCodec("count"))
    state = WorkerState("count", host, Outbox())
    work = WorkQueue(state, capacity=8, waker=Quiet(), stage_name="count", send_status=print)
    stage_thread = StageThread(
        state, work, stage, Quiet(), max_inflight=1, max_batch=1, trace=False
    )
    thread = threading.Thread(target=stage_thread.run, daemon=True)
    thread.start()
    return state, work, thread


def test_an_ended_requests_queued_item_gives_its_slot_back_on_an_idle_worker():
    state, work, thread = idle_worker()
    try:
        ended = threading.Event()
        ended.set()  # the request failed at intake while this item waited in the queue
        slot = ShmHandle(SEGMENT, 64, 4, "|u1", (4,), "burst", 7)
        item = WorkItem(StageInput("r", {}, {}, True, True, ended), [slot])
        with state.work:
            work.ready.append(item)
            state.work.notify()
        dest, msg = state.outbox.sent.get(timeout=5)  # not when something else arrives
        assert dest == "ctl:burst"
        assert msg == Release(slots=[(64, 7)], segment=SEGMENT, reader="count")
        assert not work.ready and state.host.releasable == []
    finally:
        with state.work:
            state.stopping = True
            state.work.notify()
        thread.join(5)
    assert not thread.is_alive()


def windowed_queue(capacity, size):
    state = WorkerState("count", windowed_host(size), Outbox())
    return state, WorkQueue(state, capacity, waker=Quiet(), stage_name="count", send_status=print)


def run_of(n):
    segs = [
        Segment(request_id="r", sequence=i, stage="burst", tokens=[i], is_last=i == n - 1)
        for i in range(n)
    ]
    return SegmentRun.of(segs, "burst", 0, {"n": n})


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_the_queue_never_holds_more_than_its_capacity_not_even_at_a_streams_end(capacity):
    # windows of 1: the last segment completes a window and ends the stream, which flushes
    # one more (empty, last) window: two items from one segment. The second waits in the
    # stash until there is room, in order, and nothing is lost.
    state, work = windowed_queue(capacity, size=1)
    work.stash.append(run_of(5))
    windows = []
    while work.stash or work.ready:
        work.intake()
        assert 1 <= len(work.ready) <= capacity
        with state.work:
            windows += [item.inp.window for item in work.take_batch(set(), max_batch=1)]
    assert [w.new_tokens for w in windows] == [[0], [1], [2], [3], [4], []]
    assert [w.is_last for w in windows] == [False] * 5 + [True]


def test_a_cancel_drops_the_requests_items_waiting_in_the_stash_and_frees_their_slots():
    state, work = windowed_queue(1, size=1)
    slot = ShmHandle(SEGMENT, 64, 4, "|u1", (4,), "burst", 7)
    ended = threading.Event()
    held = WorkItem(StageInput("r", {}, {}, False, True, ended), [slot])
    other = WorkItem(StageInput("s", {}, {}, True, True, threading.Event()), [])
    work.stash.extend([held, other])
    stash = work.stash
    with state.work:
        freed = work.drop("r")
    assert freed == [slot]
    assert list(stash) == [other] and work.stash is stash  # the I/O thread's deque, in place


def prioritized(rid, priority=None, first=True):
    request = {} if priority is None else {"priority": priority}
    return WorkItem(StageInput(rid, request, {}, first, True, threading.Event()), [])


def drain(work, state, busy=(), max_batch=1):
    with state.work:
        return [it.inp.request_id for it in work.take_batch(set(busy), max_batch)]


def test_by_priority_a_queue_drains_lowest_first_and_ties_by_arrival():
    state, work = windowed_queue(16, size=1)
    work.by_priority = True
    arrivals = [("a", 5), ("b", None), ("c", -3), ("d", 5), ("e", 0), ("f", -3), ("g", 2)]
    work.ready.extend(prioritized(rid, p) for rid, p in arrivals)
    order = []
    while work.ready:
        order += drain(work, state)
    assert order == ["c", "f", "b", "e", "g", "a", "d"]  # (priority, arrival); unset is 0


def test_first_come_first_served_ignores_priority():
    state, work = windowed_queue(16, size=1)
    work.ready.extend(prioritized(rid, p) for rid, p in [("a", 9), ("b", -9), ("c", 0)])
    assert drain(work, state, max_batch=3) == ["a", "b", "c"]


def test_by_priority_a_batch_takes_the_best_and_a_requests_items_stay_in_order():
    state, work = windowed_queue(16, size=1)
    work.by_priority = True
    work.ready.extend(
        [
            prioritized("low", 3),
            prioritized("run", -1, first=False),  # its request is running: waits
            prioritized("high", -2),
            prioritized("high", -2, first=False),  # the same request's next trigger
            prioritized("mid", 0),
        ]
    )
    assert drain(work, state, busy={"run"}, max_batch=3) == ["high", "mid", "low"]
    left = list(work.ready)
    assert [(it.inp.request_id, it.inp.first) for it in left] == [("run", False), ("high", False)]
    assert drain(work, state, busy={"high"}, max_batch=2) == ["run"]  # never two of one request
    assert drain(work, state, max_batch=2) == ["high"]


def test_by_priority_a_cancelled_item_gives_its_slots_back_and_is_never_taken():
    state, work = windowed_queue(16, size=1)
    work.by_priority = True
    slot = ShmHandle(SEGMENT, 64, 4, "|u1", (4,), "burst", 7)
    gone = threading.Event()
    gone.set()
    work.ready.extend(
        [
            prioritized("a", 1),
            WorkItem(StageInput("x", {"priority": -5}, {}, True, True, gone), [slot]),
        ]
    )
    assert drain(work, state, max_batch=4) == ["a"]
    assert state.host.releasable == [slot] and not work.ready


# -- the queue at its edges -------------------------------------------------------------------


class Kicks:
    """A waker that counts how often the I/O thread was woken."""

    def __init__(self) -> None:
        self.n = 0

    def kick(self) -> None:
        self.n += 1


def seg_of(rid, seq, stage="burst", last=False):
    return Segment(request_id=rid, sequence=seq, stage=stage, tokens=[seq], is_last=last)


def test_the_queue_has_room_below_its_capacity_and_none_once_stopping():
    state, work = windowed_queue(2, size=1)
    assert work.has_room()
    work.ready.append(prioritized("a"))
    assert work.has_room()  # one below capacity
    work.ready.append(prioritized("b"))
    assert not work.has_room()  # at capacity
    work.ready.popleft()
    state.stopping = True
    assert not work.has_room()


def test_in_order_a_batch_is_max_batch_items_skipping_cancelled_and_running_requests():
    state, work = windowed_queue(16, size=1)
    gone = threading.Event()
    gone.set()
    slot = ShmHandle(SEGMENT, 64, 4, "|u1", (4,), "burst", 7)
    cancelled = WorkItem(StageInput("x", {}, {}, True, True, gone), [slot])
    work.ready.extend(
        [
            cancelled,
            prioritized("run", first=False),  # its request is running: waits, in place
            prioritized("a"),
            prioritized("a", first=False),  # a's next trigger: not in the same batch
            prioritized("b"),
            prioritized("c"),
        ]
    )
    assert drain(work, state, busy={"run"}, max_batch=2) == ["a", "b"]
    assert state.host.releasable == [slot]  # the cancelled item's slot, given back
    assert [(it.inp.request_id, it.inp.first) for it in work.ready] == [
        ("run", False),
        ("a", False),
        ("c", True),
    ]
    assert drain(work, state, busy={"run"}, max_batch=3) == ["a", "c"]


def test_taking_a_batch_records_how_long_its_items_waited():
    state, work = windowed_queue(16, size=1)
    now = time.monotonic()
    for rid, waited in (("a", 2.0), ("b", 5.0), ("c", 1.0)):
        item = prioritized(rid)
        item.queued_at = now - waited
        work.ready.append(item)
    drain(work, state, max_batch=2)
    stats = state.stats
    assert stats.dequeued == 2
    assert stats.queued_s == pytest.approx(7.0, abs=0.5)
    assert stats.queued_max_s == pytest.approx(5.0, abs=0.5)
    drain(work, state, max_batch=1)  # a shorter wait leaves the longest as it was
    assert stats.dequeued == 3 and stats.queued_max_s == pytest.approx(5.0, abs=0.5)


@pytest.mark.parametrize(
    ("ready", "stashed", "kicked"),
    [
        (1, False, False),  # room all along: the I/O thread was never held back
        (3, False, True),  # the queue was full (3 of 3): room again
        (2, False, False),  # one below full before the take
        (1, True, True),  # messages wait in the stash: take them in now
    ],
)
def test_a_take_wakes_the_io_thread_only_when_it_was_held_back(ready, stashed, kicked):
    state, work = windowed_queue(3, size=1)
    work.waker = Kicks()
    work.ready.extend(prioritized(f"r{i}") for i in range(ready))
    if stashed:
        work.stash.append(seg_of("s", 0))
    drain(work, state, max_batch=1)
    assert work.waker.n == (1 if kicked else 0)
    drain(work, state, busy={f"r{i}" for i in range(ready)}, max_batch=1)  # nothing taken
    assert work.waker.n == (1 if kicked else 0)


def test_intake_counts_what_arrives_and_acks_an_edge_end():
    state, work = windowed_queue(8, size=1)
    sent = []
    work.send_status = sent.append
    work.stash.extend([seg_of("p", 0), run_of(3), Completed(request_id="q", stage="burst")])
    work.intake()
    assert state.stats.received == 5  # a segment, a run of three, an end
    assert [(a.kind, a.request_id, a.source) for a in sent] == [("edge_end", "q", "burst")]


def test_a_message_that_fails_ends_its_request_and_intake_goes_on():
    state, work = windowed_queue(8, size=1)
    work.stash.extend([seg_of("bad", 0, stage="nowhere"), seg_of("r", 0)])
    work.intake()
    ((dest, error),) = list(state.outbox.sent.queue)
    assert error.request_id == "bad" and error.code == "stage_error"
    assert error.message == (  # the stage's plain message, not the exception's type
        "stage 'count': stage 'count' got an event from 'nowhere', which has no edge to it"
    )
    assert [it.inp.request_id for it in work.ready] == ["r"]  # the next message went on
