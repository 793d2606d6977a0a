"""Never hang, never lie: the control plane's own faults, hung stages, admission.

Each test breaks one part on purpose (an undecodable message, a frozen or stuck stage, a
dead control loop, a closed caller loop, a flood) and checks what callers and health see.
"""

import asyncio
import time

import pytest
import zmq
from omni_core import Pipeline
from omni_core.dataplane.serial import encode_frame
from omni_core.errors import OverloadedError, RuntimeFailedError
from omni_core.events import Completed, Segment, SegmentRun, Submit
from omni_testing.configs import chain
from omni_testing.faults import Gate, stopped, wait_for, wait_ready

FAST = {"heartbeat_interval_s": 0.05}


def terminal(handle):
    return list(handle)[-1]


def test_an_undecodable_payload_fails_its_request_only(no_leaked_segments):
    cfg = chain(("src", "synthetic.source", {}), ("f", "synthetic.faulty", {}), **FAST)
    with Pipeline(cfg) as pipe:
        bad = terminal(pipe.submit({"n": 4, "undecodable": True}))
        assert bad.event_type == "error" and bad.code == "bad_message"
        assert "stage 'f'" in bad.message and "cannot be decoded" in bad.message
        # the control loop survived: results, health and new requests all still work
        outs = pipe.generate([{"n": 4}] * 5)
        assert all(o.ok for o in outs)
        assert pipe.healthy and pipe.failure is None


def test_a_frame_with_one_bad_message_delivers_the_others(tmp_path):
    # the stage holds all four at a gate, so nothing real of theirs can come before the
    # injected frame, however loaded the machine; "other" is let go afterwards
    gate = Gate(tmp_path)
    held = {"hold_s": 0, "until_file": gate.path}
    cfg = chain(("hold", "synthetic.sleep", held, {"max_inflight": 4}), **FAST)
    with Pipeline(cfg) as pipe:
        ids = ("other", "bad", "run", "good")
        other, bad, run, good = (pipe.submit({}, request_id=r) for r in ids)
        wait_for(lambda: pipe.metrics()["stages"]["hold"]["dequeued"] >= 4, 10, "all held")
        ctx = zmq.Context.instance()
        push = ctx.socket(zmq.PUSH)
        push.connect(pipe.backend.addr.results)
        packed = [
            Segment(request_id="good", stage="hold", sequence=i, tokens=[t])
            for i, t in enumerate((7, 8))
        ]
        frame = encode_frame(
            [
                SegmentRun.of(packed, "hold", 0),  # two segments packed in columns
                Segment(request_id="bad", stage="hold", sequence=0, payload={0: "x"}),
                {  # a malformed run: two token entries for one segment
                    "event_type": "segment_run",
                    "request_id": "run",
                    "stage": "hold",
                    "sequence": 0,
                    "ts": [0.0],
                    "tokens": [[1], [2]],
                    "payloads": [{}],
                },
                Completed(request_id="good", stage="hold", sequence=2),
            ]
        )
        push.send(frame)
        push.close(linger=1000)
        got = list(good)
        assert [e.event_type for e in got] == ["segment", "segment", "completed"]
        assert [e.tokens for e in got[:2]] == [[7], [8]]
        err = terminal(bad)
        assert err.code == "bad_message" and "stage 'hold'" in err.message
        err = terminal(run)
        assert err.code == "bad_message" and "one entry per segment" in err.message
        assert not other.done
        gate.open()
        untouched = list(other)  # its own output, as if nothing had happened
        assert [e.event_type for e in untouched] == ["segment", "completed"]
        assert pipe.healthy and pipe.failure is None


def test_a_worker_fails_only_the_request_of_an_undecodable_data_message():
    cfg = chain(
        ("src", "synthetic.source", {}),
        ("hold", "synthetic.sleep", {"hold_s": 2}, {"max_inflight": 2}),
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        victim = pipe.submit({"n": 1}, request_id="victim")
        ctx = zmq.Context.instance()
        push = ctx.socket(zmq.PUSH)
        push.connect(pipe.backend.addr.data("hold"))
        bad = Segment(request_id="victim", stage="src", sequence=5, payload={0: "x"})
        push.send(encode_frame([bad]))
        push.close(linger=1000)
        err = terminal(victim)
        assert err.code == "bad_message"
        assert "stage 'hold'" in err.message and "stage 'src'" in err.message
        assert all(o.ok for o in pipe.generate([{"n": 2}] * 3))  # the worker lives on
        assert pipe.health()["hold"]["restarts"] == 0


def test_a_failed_control_loop_fails_every_request_and_health_and_submit():
    cfg = chain(("hold", "synthetic.sleep", {"hold_s": 2}), **FAST)
    with Pipeline(cfg) as pipe:
        waiting = pipe.submit({})

        def boom():
            raise RuntimeError("injected control-loop bug")

        pipe.backend.loop.retire_segments = boom
        err = terminal(waiting)
        assert err.code == "runtime_failed" and "injected control-loop bug" in err.message
        assert pipe.failure == {
            "part": "orchestrator control loop",
            "error": "RuntimeError: injected control-loop bug",
        }
        assert not pipe.healthy
        assert all(h["state"] == "failed" for h in pipe.health().values())
        with pytest.raises(RuntimeFailedError, match="injected"):
            pipe.submit({})


def test_a_sigstopped_stage_is_declared_hung_killed_and_restarted(no_leaked_segments):
    cfg = chain(
        ("src", "synthetic.source", {"delay_s": 0.01}),
        ("f", "synthetic.faulty", {}, {"stall_timeout_s": 3.0}),
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        assert pipe.generate([{"n": 4}])[0].ok
        with stopped(pipe.pids()["f"]):
            t0 = time.monotonic()
            h = pipe.submit({"n": 4})
            # health stops saying healthy within a few heartbeats, long before the timeout
            wait_for(lambda: not pipe.healthy, 2.0, "health to notice")
            assert pipe.health()["f"]["state"] == "unresponsive"
            err = terminal(h)
            took = time.monotonic() - t0
            assert err.code == "stage_hung"
            assert "stage 'f'" in err.message and "no heartbeat" in err.message
            assert took < 6.0
        assert wait_ready(pipe, "f", 30)
        assert pipe.health()["f"]["restarts"] == 1
        assert all(o.ok for o in pipe.generate([{"n": 4}] * 3))


def test_a_stage_stuck_in_one_step_is_declared_hung():
    # the step sleeps with the GIL released: heartbeats go on, but its progress does not
    cfg = chain(
        ("src", "synthetic.source", {}),
        ("f", "synthetic.faulty", {}, {"stall_timeout_s": 1.0}),
        **FAST,
    )
    with Pipeline(cfg) as pipe:
        err = terminal(pipe.submit({"n": 2, "hang_s": 60}))
        assert err.code == "stage_hung"
        assert "busy on one step" in err.message
        assert wait_ready(pipe, "f", 30)
        assert pipe.generate([{"n": 2}])[0].ok


def test_admission_past_max_queued_requests_is_refused():
    cfg = chain(("hold", "synthetic.sleep", {"hold_s": 2}), max_queued_requests=3, **FAST)
    with Pipeline(cfg) as pipe:
        held = [pipe.submit({}) for _ in range(3)]
        with pytest.raises(OverloadedError, match="max_queued_requests=3") as e:
            pipe.submit({})
        assert e.value.retry_after_s > 0
        pipe.cancel(held[0].request_id)
        pipe.submit({})  # room again
        for h in held[1:]:
            pipe.cancel(h.request_id)


def test_end_request_never_runs_while_process_does():
    cfg = chain(("probe", "synthetic.end_probe", {}, {"max_inflight": 4}), **FAST)
    with Pipeline(cfg) as pipe:
        for _ in range(6):
            hs = [pipe.submit({"n": 50, "step_s": 0.004}) for _ in range(4)]
            time.sleep(0.03)
            for h in hs[:3]:
                pipe.cancel(h.request_id)
            list(hs[3])
        events = [e for e in pipe.submit({"n": 2}) if e.event_type == "segment"]
    assert events[-1].payload["ends"] > 0
    assert events[-1].payload["overlaps"] == 0


def test_a_caller_whose_event_loop_closed_does_not_break_delivery():
    cfg = chain(("src", "synthetic.source", {"delay_s": 0.02}), **FAST)
    with Pipeline(cfg) as pipe:
        loop = asyncio.new_event_loop()
        orphan = pipe.backend.submit({"n": 40}, "orphan", None, loop)
        loop.close()  # its reader is gone for good
        wait_for(lambda: orphan.done, 10, "the orphan to be cancelled")
        assert orphan.finish_reason == "cancelled"
        assert all(o.ok for o in pipe.generate([{"n": 4}] * 3))
        assert pipe.failure is None


def test_a_slow_reader_gets_coalesced_events_not_unbounded_memory():
    cfg = chain(("src", "synthetic.source", {"segment": 1}), **FAST)
    with Pipeline(cfg) as pipe:
        h = pipe.submit({"n": 5000})
        wait_for(lambda: h.done, 30, "the request to finish unread")
        assert h.waiting < 100  # 5000 one-token events folded into a few dozen
        events = list(h)
    assert events[-1].event_type == "completed"
    tokens = [t for e in events if e.event_type == "segment" for t in e.tokens]
    assert tokens == list(range(5000))  # nothing lost, in order
    assert [e.sequence for e in events] == list(range(len(events)))


def test_a_slow_async_reader_is_bounded_too():
    cfg = chain(("src", "synthetic.source", {"segment": 1}), **FAST)

    async def run(pipe):
        h = pipe.backend.submit({"n": 3000}, None, None, asyncio.get_running_loop())
        while not h.done:
            await asyncio.sleep(0.02)
        assert h.waiting < 100
        return [e async for e in h]

    with Pipeline(cfg) as pipe:
        events = asyncio.run(run(pipe))
    tokens = [t for e in events if e.event_type == "segment" for t in e.tokens]
    assert tokens == list(range(3000))


def test_a_failed_backend_part_fails_the_runtime_loudly():
    # e.g. a Ray node gateway whose forwarding thread stopped for good
    cfg = chain(("hold", "synthetic.sleep", {"hold_s": 2}), **FAST)
    with Pipeline(cfg) as pipe:
        waiting = pipe.submit({})
        failure = {"part": "gateway on node n1: b.data", "error": "b.data: ZMQError: gone"}
        pipe.backend.launcher.failure = lambda: failure
        err = terminal(waiting)
        assert err.code == "runtime_failed" and "gateway on node n1" in err.message
        assert pipe.failure == failure and not pipe.healthy
        with pytest.raises(RuntimeFailedError):
            pipe.submit({})


def test_garbage_on_a_workers_control_socket_is_dropped_and_control_goes_on():
    cfg = chain(("hold", "synthetic.sleep", {"hold_s": 5}), **FAST)
    with Pipeline(cfg) as pipe:
        held = pipe.submit({})
        wait_for(lambda: pipe.metrics()["stages"]["hold"]["dequeued"] >= 1, 10, "held")
        queued = pipe.submit({})
        ctx = zmq.Context.instance()
        push = ctx.socket(zmq.PUSH)
        push.connect(pipe.backend.addr.control("hold"))
        push.send(b"\x00garbage")
        push.send(encode_frame([{"event_type": "cancel", "request_id": 7}]))
        # decodable, but not a control message a worker takes (its table has no submit):
        # logged and dropped, never run as a request
        push.send(encode_frame([Submit(request_id="stray", request={})]))
        push.close(linger=1000)
        acks = pipe.metrics()["cancel_acks"]
        assert pipe.cancel(queued.request_id)  # a real cancel still reaches the worker
        wait_for(lambda: pipe.metrics()["cancel_acks"] > acks, 5, "the worker's ack")
        assert pipe.health()["hold"]["restarts"] == 0 and pipe.healthy
        pipe.cancel(held.request_id)


def test_a_timeout_that_is_not_a_positive_finite_number_is_refused():
    with Pipeline(chain(("src", "synthetic.source", {}), **FAST)) as pipe:
        for bad in (float("nan"), float("inf"), 0.0, -1.0):
            with pytest.raises(ValueError, match="timeout_s"):
                pipe.submit({"n": 2}, timeout_s=bad)
        assert pipe.generate([{"n": 2}])[0].ok
        assert pipe.metrics()["in_flight"] == 0
