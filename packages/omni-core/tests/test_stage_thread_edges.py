"""The stage thread at its edges, driven directly (no process, no sockets): which request's
step runs when, at one place and at ``max_inflight``, what preemption pauses and what
resumes first, what is sent and counted for each output, failure and shutdown. The
scripted stage writes down every step (``"a1"``: request a's step 1), pause, resume,
close and ``end_request``; see :mod:`omni_testing.stage_thread`."""

import threading
import types

import pytest
from omni_core.stage import StageInput
from omni_core.worker.host import WorkItem
from omni_core.worker.stage_thread import _Active
from omni_testing.faults import wait_for
from omni_testing.stage_thread import Rig, slot

# -- one place: each request runs to its end -----------------------------------------------


def test_one_place_runs_each_request_to_its_end_in_arrival_order():
    rig = Rig()
    rig.submit("a", steps=2, slots=[slot(64)])
    rig.at("a", 1, lambda: rig.submit("c", steps=1))  # arrives while a runs: waits
    rig.submit("b", steps=2)
    assert rig.run() == ["a0", "a1", "end a", "b0", "b1", "end b", "c0"]
    assert rig.sender.events() == [
        ("a", "segment", [0]),
        ("a", "segment", [1]),
        ("a", "completed", None),
        ("b", "segment", [0]),
        ("b", "segment", [1]),
        ("b", "completed", None),
        ("c", "segment", [0]),
        ("c", "completed", None),
    ]
    stats = rig.state.stats
    assert (stats.steps, stats.completed, stats.errors, stats.dequeued) == (5, 3, 0, 3)
    assert rig.outbox.released() == [64]  # a's slot, once it ran
    assert rig.sender.log[-1] == ("flush", None)  # nothing runs: the tail goes now
    assert rig.state.inflight == 0 and rig.state.step_started == 0.0
    assert set(rig.outside) == {0.0}  # the heartbeats' step clock runs in steps only
    assert rig.state.spans == [] and rig.state.marks == []  # no trace asked


@pytest.mark.parametrize("out", ["one", "list", "turn"])
def test_every_way_of_yielding_delivers_the_same_tokens_and_counts_each_step(out):
    rig = Rig()
    rig.submit("a", steps=3, out=out)
    rig.run()
    assert rig.sender.events() == [("a", "segment", [i]) for i in range(3)] + [
        ("a", "completed", None)
    ]
    assert rig.state.stats.steps == (6 if out == "turn" else 3)  # a None turn is a step


def test_a_stop_without_drain_closes_the_running_generator_after_its_step():
    rig = Rig()
    rig.submit("a", steps=5, slots=[slot(64)])
    rig.submit("b", steps=2)
    rig.at("a", 1, rig.stop)
    rig.start()
    rig.join()
    assert rig.stage.log == ["a0", "a1", "close a"]  # b never starts
    assert rig.sender.events() == [("a", "segment", [0]), ("a", "segment", [1])]
    assert rig.outbox.released() == [64] and rig.state.stats.completed == 0


def test_at_max_inflight_a_stop_without_drain_closes_every_running_generator():
    rig = Rig(max_inflight=2)
    rig.submit("a", steps=5)
    rig.submit("b", steps=5)
    rig.at("a", 1, rig.stop)
    rig.start()
    rig.join()
    assert rig.stage.log == ["a0", "b0", "a1", "b1", "close a", "close b"]
    assert ("a", "completed", None) not in rig.sender.events()


# -- max_inflight ------------------------------------------------------------------------


def test_at_max_inflight_the_running_requests_take_turns_and_the_next_waits_for_a_place():
    rig = Rig(max_inflight=2)
    for rid, steps in (("a", 3), ("b", 2), ("c", 2)):
        rig.submit(rid, steps=steps)
    # two places: a and b take turns; a generator ends at the step after its last
    # output, and c starts in the round after b's ended
    assert rig.run() == ["a0", "b0", "a1", "b1", "a2", "end b", "c0", "end a", "c1"]
    assert rig.state.stats.completed == 3 and rig.state.inflight == 0


def test_with_a_place_free_a_request_arriving_later_starts_in_the_next_round():
    rig = Rig(max_inflight=2)
    rig.submit("a", steps=4)
    rig.at("a", 1, lambda: rig.submit("b", steps=2))
    assert rig.run() == ["a0", "a1", "a2", "b0", "a3", "b1"]


def test_never_more_than_max_inflight_requests_run_at_once():
    rig = Rig(max_inflight=3)
    running = []
    for rid in "abcd":
        rig.submit(rid, steps=2)
        rig.at(rid, 1, lambda: running.append(rig.state.inflight))
    assert rig.run()[:6] == ["a0", "b0", "c0", "a1", "b1", "c1"]
    assert max(running) == 3


# -- priority: turns and preemption ------------------------------------------------------


def preempting(max_inflight=1, **kw):
    return Rig(policy="priority", preemptible=True, max_inflight=max_inflight, **kw)


def test_a_better_request_pauses_the_running_batch_after_its_step_which_then_resumes():
    rig = preempting()
    rig.submit("low", 5, steps=4, slots=[slot(64)])
    paused = []
    rig.at("low", 1, lambda: rig.submit("high", 1, steps=2))
    rig.at("high", 1, lambda: paused.append(rig.state.stats.paused))
    log = rig.run()
    assert log == ["low0", "low1", "pause low", "high0", "high1", "end high", "resume low"] + [
        "low2",
        "low3",
    ]
    tokens = [t for rid, kind, t in rig.sender.events() if rid == "low" and kind == "segment"]
    assert tokens == [[0], [1], [2], [3]]  # nothing lost
    assert rig.sender.events().index(("high", "completed", None)) < rig.sender.events().index(
        ("low", "segment", [2])
    )
    stats = rig.state.stats
    assert (stats.preemptions, paused, stats.paused, stats.completed) == (1, [1], 0, 2)
    assert rig.outbox.released() == [64]
    assert set(rig.outside) == {0.0}  # pause and resume run between steps


@pytest.mark.parametrize("priority", [5, 6])
def test_an_equal_or_worse_request_never_pauses_the_running_batch(priority):
    rig = preempting()
    rig.submit("low", 5, steps=3)
    rig.at("low", 1, lambda: rig.submit("other", priority, steps=1))
    assert rig.run() == ["low0", "low1", "low2", "end low", "other0"]
    assert rig.state.stats.preemptions == 0


def test_fcfs_never_pauses_whatever_the_priority():
    rig = Rig(policy="fcfs", preemptible=True)
    rig.submit("low", 5, steps=3)
    rig.at("low", 1, lambda: rig.submit("high", -9, steps=1))
    assert rig.run() == ["low0", "low1", "low2", "end low", "high0"]


def test_a_stage_that_is_not_preemptible_is_never_paused_and_the_better_goes_next():
    rig = Rig(policy="priority", max_inflight=2)
    rig.submit("a", 5, steps=4)
    rig.submit("b", 5, steps=2)
    rig.at("a", 1, lambda: rig.submit("c", 1, steps=3))
    # c waits for a place; then its turns go first (best first, then by start)
    assert rig.run() == ["a0", "b0", "a1", "b1", "a2", "end b", "c0", "a3", "c1", "end a", "c2"]
    assert rig.state.stats.preemptions == 0


def test_at_max_inflight_two_a_better_request_pauses_the_worst_after_one_step_not_a_round():
    rig = preempting(max_inflight=2)
    rig.submit("a", 3, steps=5)
    rig.submit("b", 5, steps=3)
    rig.at("a", 1, lambda: rig.submit("c", 1, steps=2))
    log = rig.run()
    # b (the worst) is paused right after a's step 1, never stepped while paused; the new
    # round goes best first; b resumes when c's place frees, and takes its turn after a
    assert log == ["a0", "b0", "a1", "pause b", "c0", "a2", "c1", "a3", "a4", "end c"] + [
        "resume b",
        "b1",
        "end a",
        "b2",
    ]
    assert rig.state.stats.preemptions == 1


def test_with_a_place_free_a_better_request_runs_beside_and_goes_first():
    rig = preempting(max_inflight=2)
    rig.submit("low", 5, steps=4)
    rig.at("low", 1, lambda: rig.submit("high", 1, steps=2))
    assert rig.run() == ["low0", "low1", "high0", "low2", "high1", "low3"]
    assert rig.state.stats.preemptions == 0


def test_equal_requests_of_a_preemptible_stage_take_turns():
    rig = preempting(max_inflight=2)
    rig.submit("a", 0, steps=3)
    rig.submit("b", 0, steps=3)
    assert rig.run() == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_paused_batches_are_bounded_by_max_inflight_and_a_better_waiting_goes_first():
    rig = preempting()
    rig.submit("low", 9, steps=3)
    rig.at("low", 1, lambda: rig.submit("mid", 5, steps=3))
    rig.at("mid", 1, lambda: rig.submit("high", 1, steps=1))
    log = rig.run()
    # one place: one batch paused at most, so mid runs on; high (waiting, better than
    # the paused low) goes before low resumes
    assert log == ["low0", "low1", "pause low", "mid0", "mid1", "mid2", "end mid", "high0"] + [
        "end high",
        "resume low",
        "low2",
    ]
    assert rig.state.stats.preemptions == 1


def test_a_paused_batch_resumes_before_an_equal_request_that_arrived_later():
    rig = preempting()
    rig.submit("low", 5, steps=3)
    rig.at("low", 1, lambda: rig.submit("high", 1, steps=2))
    rig.at("high", 1, lambda: rig.submit("same", 5, steps=1))
    log = rig.run()
    assert log[log.index("end high") :] == ["end high", "resume low", "low2", "end low", "same0"]


def test_two_paused_batches_resume_best_first_both_in_one_round():
    rig = preempting(max_inflight=2)
    rig.submit("a", 7, steps=3)
    rig.submit("b", 8, steps=3)
    rig.at("a", 1, lambda: (rig.submit("c", 1, steps=2), rig.submit("d", 2, steps=2)))
    log = rig.run()
    # the worst is paused first; when both places free, both resume at once, best first
    assert log == ["a0", "b0", "a1", "pause b", "pause a", "c0", "d0", "c1", "d1", "end c"] + [
        "end d",
        "resume a",
        "resume b",
        "a2",
        "b1",
        "b2",
        "end a",
    ]
    assert rig.state.stats.preemptions == 2


def test_with_a_place_free_an_arrival_waits_for_the_round_to_end():
    rig = preempting(max_inflight=3)
    rig.submit("a", 0, steps=3)
    rig.submit("b", 0, steps=3)
    rig.at("a", 1, lambda: rig.submit("c", 0, steps=2))
    # nothing to pause: b still takes its turn, c starts in the next round
    assert rig.run() == ["a0", "b0", "a1", "b1", "a2", "b2", "c0", "c1", "end a", "end b"]


def test_a_cancelled_running_batch_is_not_paused_its_place_frees_at_its_next_step():
    rig = preempting()
    rig.submit("low", 5, steps=4)

    def cancel_and_better():
        rig.cancel("low")
        rig.submit("high", 1, steps=1)

    rig.at("low", 1, cancel_and_better)
    assert rig.run() == ["low0", "low1", "end low", "close low", "high0"]
    assert rig.state.stats.preemptions == 0


def test_a_paused_request_cancelled_ends_at_once_not_when_it_would_resume():
    rig = preempting()
    rig.submit("low", 5, steps=4, slots=[slot(64)])
    rig.at("low", 1, lambda: rig.submit("high", 1, steps=3))
    rig.at("high", 1, lambda: rig.cancel("low"))
    log = rig.run()
    assert log == ["low0", "low1", "pause low", "high0", "high1", "end low", "close low"] + [
        "high2"
    ]
    assert rig.outbox.released() == [64] and rig.state.stats.paused == 0
    assert ("low", "segment", [2]) not in rig.sender.events()


@pytest.mark.parametrize("call", ["pause", "resume"])
def test_a_stage_whose_pause_or_resume_raises_fails_that_batch_only(call):
    rig = preempting()
    setattr(rig.stage, f"fail_{call}", True)
    rig.submit("low", 5, steps=4, slots=[slot(64)])
    rig.at("low", 1, lambda: rig.submit("high", 1, steps=2))
    log = rig.run()
    assert "close low" in log and "low2" not in log
    assert log.count("high0") == log.count("high1") == 1
    errors = [e for e in rig.sender.events() if e[1] == "error"]
    assert errors == [("low", "error", f"stage 'loop': {call} failed: RuntimeError: cannot {call}")]
    assert ("high", "completed", None) in rig.sender.events()
    assert rig.outbox.released() == [64]
    stats = rig.state.stats
    assert (stats.paused, stats.errors, stats.completed) == (0, 1, 1)


def _raise_deep(depth: int) -> None:
    """Raise ``depth`` frames below the caller: a traceback longer than the log keeps
    (two functions in turn, so that Python does not fold the repeated frames)."""
    if depth == 0:
        raise RuntimeError("deep down")
    _raise_deeper(depth - 1)


def _raise_deeper(depth: int) -> None:
    _raise_deep(depth)


@pytest.mark.parametrize("where", ["step", "pause", "resume"])
def test_a_stage_failure_is_logged_with_its_traceback_cut_at_eight_frames(where, caplog):
    """The log keeps the outermost 8 frames of a deep failure: where the runtime called
    the stage and the first of the stage's own, not a page of recursion."""
    rig = preempting()
    if where == "step":
        rig.submit("a", steps=2)
        rig.at("a", 1, lambda: _raise_deep(20))
    else:
        setattr(rig.stage, where, lambda rids: _raise_deep(20))
        if where == "resume":
            rig.stage.pause = lambda rids: None
        rig.submit("low", 5, steps=4)
        rig.at("low", 1, lambda: rig.submit("high", 1, steps=2))
    with caplog.at_level("ERROR", logger="omni.worker"):
        rig.run()
    (record,) = [r for r in caplog.records if "deep down" in r.getMessage()]
    frames = [ln for ln in record.getMessage().splitlines() if ln.startswith('  File "')]
    assert len(frames) == 8
    assert record.getMessage().rstrip().endswith("RuntimeError: deep down")


def test_a_stop_without_drain_closes_a_paused_batch_and_gives_its_slots_back():
    rig = preempting()
    rig.submit("low", 5, steps=4, slots=[slot(64)])
    rig.at("low", 1, lambda: rig.submit("high", 1, steps=3))
    rig.at("high", 1, rig.stop)
    rig.start()
    rig.join()
    assert rig.stage.log[-2:] == ["close high", "close low"]
    assert rig.outbox.released() == [64]
    assert rig.state.stats.paused == 0 and rig.state.stats.completed == 0
    assert [e for e in rig.sender.events() if e[1] == "completed"] == []


# -- failures ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "message", "code"),
    [
        ("user", "stage 'loop': a asked too much", "invalid_request"),
        ("error", "stage 'loop': RuntimeError: a broke", "stage_error"),
    ],
)
def test_a_stage_that_raises_fails_the_batchs_live_requests_once(kind, message, code):
    rig = Rig(max_batch=2)
    rig.submit("a", steps=3, raise_at=1, slots=[slot(64)], **{"raise": kind})
    rig.submit("b", steps=3, slots=[slot(128)])
    rig.at("a", 0, lambda: rig.cancel("b"))  # cancelled: gets no error from here
    rig.submit("c", steps=1)
    log = rig.run()
    assert log == ["a+b0", "end b", "a+b1", "end a", "c0"]
    errors = [
        (e.request_id, e.message, e.code)
        for _, e in rig.sender.log
        if e and e.event_type == "error"
    ]
    assert errors == [("a", message, code)]
    assert rig.state.stats.errors == 1
    assert sorted(rig.outbox.released()) == [64, 128]  # each once
    assert set(rig.outside) == {0.0}


def test_a_request_the_stage_fails_ends_there_and_the_others_of_the_batch_go_on():
    rig = Rig(max_batch=2)
    rig.submit("a", steps=3, out="list")
    rig.submit("b", steps=3, fail_at=1)
    rig.run()
    assert rig.sender.events() == [
        ("a", "segment", [0]),
        ("b", "segment", [0]),
        ("a", "segment", [1]),  # sent before b's error, which came after it in the list
        ("b", "error", "stage 'loop': b gave up"),
        ("a", "segment", [2]),
        ("a", "completed", None),
    ]
    assert rig.state.stats.errors == 1 and rig.state.stats.completed == 1


def test_a_cancelled_request_of_a_running_batch_gets_nothing_more_the_other_goes_on():
    rig = Rig(max_batch=2)
    rig.submit("a", steps=3)
    rig.submit("b", steps=3)
    rig.at("a", 1, lambda: rig.cancel("a"))  # the batch's first request
    assert rig.run() == ["a+b0", "a+b1", "end a", "a+b2"]
    assert rig.sender.events() == [
        ("a", "segment", [0]),
        ("b", "segment", [0]),
        ("b", "segment", [1]),
        ("b", "segment", [2]),
        ("b", "completed", None),
    ]


def test_an_output_that_cannot_be_sent_fails_its_request():
    rig = Rig()
    rig.submit("a", steps=2, arrays=object())
    rig.submit("b", steps=1, arrays=b"abc")
    assert rig.run() == ["a0", "end a", "close a", "b0"]
    err, segment, done = [e for d, e in rig.sender.log if d == "client"]
    assert (err.request_id, err.event_type) == ("a", "error")
    assert err.message.startswith("stage 'loop': cannot send output: TypeError: cannot send")
    assert segment.request_id == "b" and list(segment.device_handles) == ["x"]  # packed
    assert (done.request_id, done.event_type) == ("b", "completed")
    assert rig.state.stats.errors == 1


# -- what is sent and traced ---------------------------------------------------------------


def test_a_list_of_several_requests_outputs_says_how_many_events_it_sends():
    rig = Rig(max_batch=2)
    rig.submit("a", steps=1, out="list")
    rig.submit("b", steps=1, chunks=3)
    rig.run()
    assert rig.sender.counts == [("client", 4)]  # a's segment, b's run of three


def test_to_replicas_each_destination_is_told_its_own_count():
    rig = Rig(max_batch=2, sink_replicas=2)
    rig.submit("a", steps=1, out="list", routes={"sink": 0})
    rig.submit("b", steps=1, chunks=3, routes={"sink": 1})
    rig.run()
    assert sorted(rig.sender.counts) == [("client", 4), ("sink#0", 1), ("sink#1", 3)]


def test_traced_steps_leave_a_span_per_batch_and_a_mark_per_output():
    rig = Rig(trace=True)
    rig.submit("a", steps=2, out="list", chunks=2)
    rig.submit("b", steps=2)
    rig.run()
    spans = [(s.requests, s.outputs, s.window) for s in rig.state.spans]
    assert spans == [(["a"], 4, 0), (["b"], 2, 0)]
    marks = [(m.request_id, m.sequence, m.event_type) for m in rig.state.marks]
    assert marks == [("a", i, "segment") for i in range(4)] + [
        ("b", 0, "segment"),
        ("b", 1, "segment"),
    ]


# -- a live worker: idle, woken, ended -------------------------------------------------------


def test_an_idle_stage_thread_is_woken_by_an_arrival_and_ends_a_cancelled_request_at_once():
    rig = Rig()
    rig.submit("x", steps=1)
    rig.cancel("x")  # known here, nothing queued: its end_request is due
    seen = []
    rig.start()
    try:
        wait_for(lambda: "end x" in rig.stage.log, 5, "end_request on an idle worker")
        wait_for(lambda: rig.queue.idle_stage, 5, "the stage thread waiting")
        woken = rig.state.work.n
        rig.at("y", 0, lambda: seen.append(rig.queue.idle_stage))
        rig.submit("y", steps=2)
        assert rig.state.work.n == woken + 1  # notified, not left to its poll
        wait_for(lambda: "y1" in rig.stage.log, 5, "y ran")
        assert seen == [False]  # not idle while it works
    finally:
        rig.stop()
        rig.join()
    assert rig.stage.log[:3] == ["end x", "y0", "y1"]


def test_an_idle_stage_thread_stays_until_its_deadline_passed():
    rig = Rig()
    rig.start()
    wait_for(lambda: rig.queue.idle_stage, 5, "the stage thread waiting")
    with rig.state.work:
        rig.state.deadline = 4e9  # far ahead
        rig.state.work.notify()
    rig.submit("a", steps=1)
    wait_for(lambda: "a0" in rig.stage.log, 5, "a ran")
    wait_for(lambda: rig.queue.idle_stage, 5, "the stage thread waiting again")
    with rig.state.work:
        rig.state.deadline = 1.0  # passed
        rig.state.work.notify()
    rig.join()


def test_an_idle_stage_thread_waits_on_its_condition_polling_every_200_ms():
    """Idle, it sleeps on ``work`` (an arrival or a stop notifies it), waking every 0.2 s
    to look at its deadline: it neither spins nor sleeps longer."""
    rig = Rig()
    waits: list[float | None] = []
    real = rig.state.work.wait

    def wait(timeout=None):
        waits.append(timeout)
        return real(timeout)

    rig.state.work.wait = wait  # type: ignore[method-assign]
    rig.start()
    try:
        wait_for(lambda: rig.queue.idle_stage, 5, "the stage thread waiting")
    finally:
        rig.stop()
        rig.join()
    assert waits and set(waits) == {0.2}


@pytest.mark.parametrize(("windows", "index"), [((3, 5), 3), ((0, 5), 0), ((None, 5), 0)])
def test_a_traced_batchs_span_names_the_window_of_its_first_request(windows, index):
    rig = Rig(trace=True)
    items = [
        WorkItem(
            StageInput(
                rid, {}, {} if i is None else {"e": types.SimpleNamespace(index=i)}, True, True
            ),
            [],
        )
        for rid, i in zip("ab", windows, strict=True)
    ]
    a = _Active(iter(()), items, {"a", "b"}, [], started=1.0, outputs=2)
    rig.stage_thread._finish(a, failed=True)
    (span,) = rig.state.spans
    assert (span.requests, span.start, span.outputs, span.window) == (["a", "b"], 1.0, 2, index)


def test_end_request_runs_between_the_steps_of_a_long_request_not_after_it():
    rig = Rig()
    rig.submit("x", steps=1)
    rig.submit("a", steps=3)
    rig.at("a", 1, lambda: rig.cancel("x2"))  # unknown here: nothing to end
    done = threading.Event()
    rig.at("a", 0, lambda: (rig.submit("late", steps=1), rig.cancel("late"), done.set()))
    log = rig.run()
    assert done.is_set()
    assert log == ["x0", "end x", "a0", "end late", "a1", "a2"]
