"""The core runtime end to end with synthetic stages: one worker process per stage."""

import os
import time

import numpy as np
import pytest
from omni_core import Pipeline
from omni_core.dataplane.shm import list_segments
from omni_core.errors import StageStartError, UserInputError
from omni_testing.configs import chain


def test_stages_overlap_across_requests(no_leaked_segments):
    """Stage A works on request 1 while stage B works on request 0 (from timestamps)."""
    cfg = chain(
        ("a", "synthetic.sleep", {"hold_s": 0.2}, {"client_stream": True}),
        ("b", "synthetic.sleep", {"hold_s": 0.2}),
    )
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([{"i": i} for i in range(4)])
    assert all(o.ok for o in outs)
    spans = {
        (o.request_id, e.stage): (e.payload["start"], e.payload["end"])
        for o in outs
        for e in o.events
    }
    pids = {e.stage: e.payload["pid"] for o in outs for e in o.events}
    assert pids["a"] != pids["b"] != os.getpid()
    r0, r1 = outs[0].request_id, outs[1].request_id
    b_r0, a_r1 = spans[r0, "b"], spans[r1, "a"]
    overlap = min(b_r0[1], a_r1[1]) - max(b_r0[0], a_r1[0])
    assert overlap > 0.1, f"stage b on r0 {b_r0} and stage a on r1 {a_r1} did not overlap"


def test_windows_with_overlap_end_to_end():
    cfg = chain(
        ("src", "synthetic.source", {"segment": 3}),
        ("map", "synthetic.map", {"scale": 1}),
        edges=[{"from": "src", "to": "map", "window": {"size": 4, "overlap": 1}}],
    )
    with Pipeline(cfg) as pipe:
        events = list(pipe.stream({"n": 10}))
    data = [e for e in events if e.event_type == "segment"]
    assert [e.tokens for e in data] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [e.payload["context"] for e in data] == [[], [3], [7]]
    assert [e.sequence for e in events] == list(range(len(events)))
    assert events[-1].event_type == "completed"


def test_fan_out_and_fan_in():
    with Pipeline("configs/demo.yaml") as pipe:
        outs = pipe.generate([{"n": n} for n in (5, 16, 0)])
    for o, n in zip(outs, (5, 16, 0), strict=False):
        assert o.ok, o.error
        # join sums double (2t) and shift (t + 1000) position by position
        join = [t for e in o.by_stage("join") for t in e.tokens]
        assert join == [3 * t + 1000 for t in range(n)]
        assert [t for e in o.by_stage("source") for t in e.tokens] == list(range(n))


@pytest.mark.parametrize("config", ["configs/demo.yaml"])
def test_parity_mrs_enabled_and_disabled(config):
    from omni_core import load_config

    requests = [{"n": n, "start": s} for n, s in ((7, 0), (24, 3), (1, 9), (13, 100))]
    results = {}
    for enabled in (True, False):
        cfg = load_config(config)
        cfg.mrs.enabled = enabled
        with Pipeline(cfg) as pipe:
            outs = pipe.generate(requests)
        # per stage, the same events in the same order (stages interleave differently)
        results[enabled] = [
            {
                stage: [(e.event_type, e.tokens, e.is_last) for e in o.by_stage(stage)]
                for stage in ("source", "join")
            }
            for o in outs
        ]
    assert results[True] == results[False]
    assert all(results[True])


def test_large_arrays_cross_through_shared_memory(no_leaked_segments):
    nbytes = 4 << 20
    cfg = chain(
        ("src", "synthetic.array_source", {"nbytes": nbytes, "count": 3}, {"client_stream": True}),
        ("sink", "synthetic.array_sink", {}),
        shm_pool_bytes=64 << 20,
    )
    with Pipeline(cfg) as pipe:
        segs = list_segments(os.getpid())
        assert len(segs) == 2
        for name in segs:
            assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
        out = pipe.generate([{}])[0]
    assert out.ok, out.error
    src = [e for e in out.events if e.stage == "src"]
    assert len(src) == 3
    expected = np.arange(nbytes, dtype=np.uint8)
    for e in src:
        assert np.array_equal(e.arrays["data"], expected)
        assert all(type(h).__name__ == "ShmHandle" for h in e.device_handles.values())
    sink = [e for e in out.events if e.stage == "sink"]
    assert sink[0].payload["bytes"] == 3 * nbytes
    assert sink[0].payload["check"] == 3 * (0 + int(expected[-1]))


def test_small_arrays_ride_inline():
    cfg = chain(("src", "synthetic.array_source", {"nbytes": 1000, "count": 2}))
    with Pipeline(cfg) as pipe:
        out = pipe.generate([{}])[0]
    assert [type(h).__name__ for e in out.events for h in e.device_handles.values()] == [
        "InlineArray",
        "InlineArray",
    ]


def test_no_segment_left_after_shutdown_even_with_killed_worker():
    cfg = chain(
        ("src", "synthetic.array_source", {"nbytes": 1 << 20}),
        ("sink", "synthetic.array_sink", {}),
    )
    pipe = Pipeline(cfg).start()
    assert len(list_segments(os.getpid())) == 2
    pids = pipe.backend.pids()
    assert pipe.generate([{}])[0].ok
    os.kill(pids["sink"], 9)
    pipe.close()
    assert list_segments(os.getpid()) == []
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_error_in_one_request_leaves_others_alone():
    cfg = chain(
        ("src", "synthetic.source", {"segment": 2}),
        ("f", "synthetic.faulty", {}),
    )
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([{"n": 4}, {"n": 4, "fail": True}, {"n": 3, "reject": True}, {"n": 5}])
        again = pipe.generate([{"n": 2}])
    assert [o.finish_reason for o in outs] == ["completed", "error", "error", "completed"]
    assert "stage 'f'" in outs[1].error and "synthetic failure" in outs[1].error
    assert "field 'reject'" in outs[2].error
    assert outs[0].tokens == [0, 1, 2, 3] and outs[3].tokens == [0, 1, 2, 3, 4]
    assert again[0].ok


def test_a_raised_user_input_error_is_the_requests_fault():
    """A stage that raises UserInputError fails the request with code invalid_request
    (a server shows its words); any other exception is the stage's failure."""
    cfg = chain(("src", "synthetic.source", {"segment": 2}), ("f", "synthetic.faulty", {}))
    with Pipeline(cfg) as pipe:
        refused = list(pipe.submit({"n": 4, "refuse": True}, timeout_s=20))[-1]
        failed = list(pipe.submit({"n": 4, "fail": True}, timeout_s=20))[-1]
        assert pipe.generate([{"n": 2}])[0].ok
    assert refused.event_type == "error" and refused.code == UserInputError.code, refused
    assert refused.message == "stage 'f': field 'refuse': this stage refuses such requests"
    assert failed.event_type == "error" and failed.code == "stage_error", failed


def test_load_failure_names_the_stage():
    cfg = chain(("ok", "synthetic.source", {}), ("bad", "synthetic.faulty", {"fail_on_load": True}))
    with pytest.raises(
        StageStartError, match=r"stage 'bad' \(kind 'synthetic.faulty'\).*synthetic load failure"
    ):
        Pipeline(cfg).start()
    assert list_segments(os.getpid()) == []


def test_worker_exit_during_load_is_reported():
    cfg = chain(("bad", "synthetic.faulty", {"exit_on_load": True}))
    with pytest.raises(StageStartError, match=r"stage 'bad'.*exited with code 7"):
        Pipeline(cfg).start()


def test_killed_worker_fails_its_requests_fast():
    cfg = chain(
        ("src", "synthetic.source", {"segment": 1, "delay_s": 0.05}),
        ("f", "synthetic.faulty", {}),
        edges=[{"from": "src", "to": "f", "window": {"size": 1}}],
    )
    with Pipeline(cfg) as pipe:
        h = pipe.submit({"n": 200})
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(pipe.backend.pids()["f"], 9)
        events = list(h)
        assert time.monotonic() - t0 < 2.0
        assert events[-1].event_type == "error"
        assert events[-1].code == "stage_died" and "'f'" in events[-1].message
        assert pipe.health()["f"]["alive"] is False


def test_cancel_and_timeout():
    cfg = chain(("src", "synthetic.source", {"segment": 1, "delay_s": 0.05}))
    with Pipeline(cfg) as pipe:
        h = pipe.submit({"n": 100})
        first = next(iter(h))
        assert first.event_type == "segment"
        assert pipe.cancel(h.request_id)
        rest = list(h)
        assert rest[-1].event_type == "cancelled" and rest[-1].reason == "cancelled"
        assert sum(e.terminal for e in rest) == 1
        timed = list(pipe.stream({"n": 100}, timeout_s=0.3))
        assert timed[-1].event_type == "cancelled" and timed[-1].reason == "timeout"
        # the stage stopped and serves the next request promptly
        t0 = time.monotonic()
        assert pipe.generate([{"n": 2}])[0].ok
        assert time.monotonic() - t0 < 1.5


def test_micro_batching_and_devices_env():
    cfg = chain(
        ("src", "synthetic.source", {"segment": 1}),
        ("b", "synthetic.sleep", {"hold_s": 0.1}, {"max_batch_size": 4}),
    )
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([{"n": 1} for _ in range(9)])
    sizes = [o.events[0].payload["batch"] for o in outs]
    assert max(sizes) > 1 and max(sizes) <= 4

    cfg = chain(
        (
            "a",
            "synthetic.env",
            {},
            {"devices": "1,2", "extra_env": {"OMNI_X": "y"}, "client_stream": True},
        ),
        ("b", "synthetic.env", {}, {"devices": "cpu", "client_stream": True}),
    )
    with Pipeline(cfg) as pipe:
        out = pipe.generate([{"env": ["CUDA_VISIBLE_DEVICES", "OMNI_X"]}])[0]
    env = {e.stage: e.payload["env"] for e in out.events}
    assert env["a"] == {"CUDA_VISIBLE_DEVICES": "1,2", "OMNI_X": "y"}
    assert env["b"] == {"CUDA_VISIBLE_DEVICES": "", "OMNI_X": None}


def test_async_stream():
    import asyncio

    async def run():
        with Pipeline(chain(("src", "synthetic.source", {"segment": 2}))) as pipe:
            return [e async for e in pipe.astream({"n": 5})]

    events = asyncio.run(run())
    assert [e.tokens for e in events[:-1]] == [[0, 1], [2, 3], [4]]
    assert events[-1].event_type == "completed"


def test_unserializable_input_and_output_fail_only_their_request():
    cfg = chain(("src", "synthetic.source", {"segment": 2}), ("f", "synthetic.faulty", {}))
    with Pipeline(cfg) as pipe:
        with pytest.raises(TypeError, match="cannot be serialized"):
            pipe.submit({"x": object()})
        outs = pipe.generate([{"n": 2}, {"n": 2, "bad_output": True}, {"n": 3}])
    assert [o.finish_reason for o in outs] == ["completed", "error", "completed"]
    assert "stage 'f': output cannot be serialized" in outs[1].error


@pytest.mark.parametrize("enabled", [True, False])
def test_a_stage_may_yield_lists_of_events(enabled):
    """One yield of many events (a batched step) gives the same stream as one per yield."""
    cfg = chain(
        ("b", "synthetic.burst", {"nbytes": 100}, {"client_stream": True}),
        ("m", "synthetic.map", {"scale": 2}),
        edges=[{"from": "b", "to": "m", "window": {"size": 5, "overlap": 1}}],
        mrs={"enabled": enabled},
    )
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([{"count": 23, "chunk": c} for c in (1, 7, 64)])
    streams = [  # per stage: how the two stages interleave for the caller may vary
        {
            stage: [(e.tokens, e.payload.get("context"), e.is_last) for e in o.by_stage(stage)]
            for stage in ("b", "m")
        }
        for o in outs
    ]
    assert all(o.ok for o in outs)
    assert streams[0] == streams[1] == streams[2]
    assert [t for e in outs[1].by_stage("m") for t in e.tokens] == [2 * i for i in range(23)]


@pytest.mark.parametrize("enabled", [True, False], ids=["mrs", "inline"])
def test_previews_of_a_middle_stage_go_to_the_caller_only(enabled):
    """client_stream: previews -> the caller gets every preview, the next stage only the
    final image (its sequence has no gaps from previews it never sees)."""
    cfg = chain(
        ("gen", "synthetic.previews", {"steps": 5, "size": 4}, {"client_stream": "previews"}),
        ("sink", "synthetic.count", {}),
        mrs={"enabled": enabled},
    )
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([{"steps": 5}, {"steps": 3}])
    for out, steps in zip(outs, (5, 3), strict=True):
        assert out.ok, out.error
        previews = out.by_stage("gen")
        assert [e.step for e in previews] == list(range(steps))
        assert all(e.arrays["image"].shape == (4, 4, 3) for e in previews)
        (result,) = out.by_stage("sink")
        assert result.payload["count"] == 1  # the final image alone
        assert result.payload["bytes"] == 8 * 8 * 3


def test_a_streaming_middle_stage_is_awaited_before_completion():
    """A client_stream stage's events take their own path to the caller; the request
    completes only once they all arrived, even if the sink was faster."""
    cfg = chain(
        ("src", "synthetic.source", {"tokens": 8, "segment": 2}, {"client_stream": True}),
        ("sink", "synthetic.map", {}),
    )
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([{"n": 8} for _ in range(20)])
    for out in outs:
        assert out.ok, out.error
        assert [t for e in out.by_stage("src") for t in e.tokens] == list(range(8))


def test_a_full_work_queue_takes_in_again_as_soon_as_the_stage_frees_room():
    # queue_capacity 2 with frames of 64 events: the I/O thread stops taking in while the
    # queue is full and must be woken when the stage takes work, not at its next heartbeat
    # (it was: 2,000 events took over a minute)
    cfg = chain(
        ("burst", "synthetic.burst", {}),
        ("count", "synthetic.count", {}, {"queue_capacity": 2}),
        edges=[{"from": "burst", "to": "count", "window": {"size": 1}}],
        heartbeat_interval_s=5.0,
    )
    with Pipeline(cfg) as pipe:
        out = pipe.generate([{"count": 2000, "nbytes": 1024, "chunk": 64}], timeout_s=20)[0]
    assert out.ok, out.error
    assert out.events[-1].payload["count"] == 2000


def test_a_stage_yielding_none_gives_the_other_requests_in_flight_a_turn():
    # each request waits, yielding None, until all four are in the stage: only possible if
    # the worker admits and runs the others meanwhile (a continuous-batching engine's shape)
    cfg = chain(("meet", "synthetic.rendezvous", {}, {"max_inflight": 4}))
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([{"expect": 4}] * 4, timeout_s=30)
    for out in outs:
        assert out.ok, out.error
        assert out.events[0].tokens == [4]
