"""The work queue at its edges: how much of a message it takes in at exactly its room and
one past, what it counts, when it wakes the stage thread, what it never blocks on, and
which waiting request a priority queue hands out (or counts as the best) at the bound."""

import threading
import time

import pytest
from omni_core.dataplane.transport import Outbox
from omni_core.events import Completed, SegmentRun
from omni_testing.stage_thread import Kicks, Rig, item, run_of, segment, windowed_queue


def take(state, work, busy=(), max_batch=1, better_than=None):
    with state.work:
        return [it.inp.request_id for it in work.take_batch(set(busy), max_batch, better_than)]


# -- taking in ----------------------------------------------------------------------------


@pytest.mark.parametrize(("queued", "taken"), [(0, 3), (1, 2), (2, 1), (3, 0)])
def test_a_run_of_segments_is_taken_in_up_to_the_queues_room_the_rest_waits_undecoded(
    queued, taken
):
    state, work = windowed_queue(3, size=1)
    work.ready.extend(item(f"q{i}") for i in range(queued))
    work.stash.append(run_of("r", 5))
    work.intake()
    assert len(work.ready) == 3
    assert state.stats.received == taken  # segments taken in: one window each
    (rest,) = work.stash  # the segments past the room, still one run
    assert type(rest) is SegmentRun and (rest.sequence, len(rest)) == (taken, 5 - taken)


def test_work_made_past_the_capacity_earlier_goes_in_with_the_messages_behind_it():
    state, work = windowed_queue(4, size=1)
    work.stash.extend([item("early"), segment("r", 0), segment("r", 1)])
    work.intake()  # one intake takes all three
    assert [it.inp.request_id for it in work.ready] == ["early", "r", "r"]
    assert not work.stash and state.stats.received == 2


@pytest.mark.parametrize("room", [2, 1])
def test_a_segment_that_makes_more_items_than_there_is_room_leaves_the_rest_first_in_line(room):
    # the stream's last segment makes its window and the stream's end window: two items
    state, work = windowed_queue(4, size=1)
    work.ready.extend(item(f"q{i}") for i in range(4 - room))
    work.stash.extend([segment("r", 0, last=True), segment("s", 0)])
    work.intake()
    assert [it.inp.request_id for it in work.ready][4 - room :] == ["r", "r"][:room]
    if room == 2:  # exactly room: both in, the next message waits as it came
        assert [type(m).__name__ for m in work.stash] == ["Segment"]
    else:  # one past: the end window waits ahead of the next message
        assert [type(m).__name__ for m in work.stash] == ["WorkItem", "Segment"]
        assert work.stash[0].inp.last


def test_each_submit_is_counted_once_and_the_one_past_the_capacity_waits():
    rig = Rig(capacity=2)
    for rid in "abc":
        rig.submit(rid)
    assert [it.inp.request_id for it in rig.queue.ready] == ["a", "b"]
    assert rig.state.stats.received == 2 and len(rig.queue.stash) == 1
    assert take(rig.state, rig.queue) == ["a"]
    rig.queue.intake()
    assert rig.state.stats.received == 3
    assert [it.inp.request_id for it in rig.queue.ready] == ["b", "c"]


def test_the_wait_recorded_runs_from_when_the_item_was_taken_in():
    state, work = windowed_queue(4, size=1)
    before = time.monotonic()
    work.stash.append(segment("r", 0))
    work.intake()
    take(state, work)
    assert state.stats.dequeued == 1
    assert 0 <= state.stats.queued_max_s <= time.monotonic() - before


# -- waking the stage thread -------------------------------------------------------------


@pytest.mark.parametrize(
    ("idle", "size", "woken"),
    [
        (True, 1, 1),  # the stage thread waits and work arrived
        (False, 1, 0),  # it is busy: it takes the work when its step ends
        (True, 2, 0),  # half a window: nothing to do yet
    ],
)
def test_intake_wakes_the_stage_thread_only_when_it_waits_and_work_arrived(idle, size, woken):
    state, work = windowed_queue(4, size=size)
    if idle:  # (a new queue's stage thread has not said it waits)
        work.idle_stage = True
    work.stash.append(segment("r", 0))
    work.intake()
    assert state.work.n == woken


@pytest.mark.parametrize(("idle", "woken"), [(True, 1), (False, 0)])
def test_a_cancel_wakes_an_idle_stage_thread_to_end_the_request(idle, woken):
    state, work = windowed_queue(4, size=2)
    work.stash.append(segment("r", 0))
    work.intake()  # r is known here, half a window waits
    work.idle_stage = idle
    with state.work:
        work.drop("r")
    assert state.work.n == woken
    assert state.host.to_end == ["r"]


def test_a_message_that_fails_never_blocks_on_a_full_outbox():
    state, work = windowed_queue(4, size=1)
    state.outbox = outbox = Outbox(Kicks(), capacity=1)
    outbox.put("client", "earlier")  # full: a blocking put would wait for the I/O thread
    work.stash.extend([segment("bad", 0, stage="nowhere"), segment("r", 0)])
    intake = threading.Thread(target=work.intake, daemon=True)
    intake.start()
    intake.join(5)
    assert not intake.is_alive()  # the I/O thread itself: it never waits on its own outbox
    (_, error) = outbox.queues["client"]
    assert error.request_id == "bad" and error.event_type == "error"
    assert [it.inp.request_id for it in work.ready] == ["r"]


def test_intake_acks_an_edge_end_with_the_stage_and_source():
    state, work = windowed_queue(4, size=2)
    sent = []
    work.send_status = sent.append
    work.stash.extend([segment("r", 0), Completed(request_id="r", stage="burst", sequence=1)])
    work.intake()
    assert [(a.stage, a.kind, a.request_id, a.source) for a in sent] == [
        ("count", "edge_end", "r", "burst")
    ]
    (last,) = work.ready  # the end flushed the half window, last
    assert last.inp.last and last.inp.window.new_tokens == [0]


# -- priority: the best waiting, and the bound ----------------------------------------------


def priority_queue(*items):
    state, work = windowed_queue(16, size=1)
    work.by_priority = True
    work.ready.extend(items)
    return state, work


def test_the_best_waiting_priority_leaves_out_running_and_cancelled_requests():
    state, work = priority_queue(
        item("gone", -5, cancelled=True), item("run", -3), item("a", 2), item("b", 4)
    )
    assert work.best_waiting({"run"}) == 2
    assert work.best_waiting({"run", "a", "b"}) is None
    assert work.best_waiting(set()) == -3


def test_of_two_waiting_the_better_goes_first():
    state, work = priority_queue(item("worse", 5), item("better", 1))
    assert take(state, work) == ["better"]
    assert take(state, work) == ["worse"]


@pytest.mark.parametrize(("bound", "taken"), [(3, []), (4, ["a"])])
def test_with_a_bound_only_a_strictly_better_request_is_taken_even_alone(bound, taken):
    state, work = priority_queue(item("a", 3))
    assert take(state, work, better_than=bound) == taken
    assert [it.inp.request_id for it in work.ready] == (["a"] if not taken else [])


def test_with_a_bound_the_better_are_taken_and_the_rest_keep_their_place():
    state, work = priority_queue(item("x", 3), item("y", 2), item("z", 1))
    assert take(state, work, max_batch=4, better_than=3) == ["z", "y"]
    assert [it.inp.request_id for it in work.ready] == ["x"]
