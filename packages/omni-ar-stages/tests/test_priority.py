"""Request priority in the AR stages: the intake takes the runtime's ``priority`` field,
and the split pipeline (intake -> prefill -> decode -> postprocess, transformers engine)
serves the requests waiting at a busy decode by (priority, arrival) under
``scheduler_policy: priority``, by arrival under ``fcfs``, with the tokens each gives
alone (greedy)."""

import time

import pytest
from omni_ar.engines.vllm_engine import VllmEngine
from omni_ar.params import parse_request
from omni_core import Pipeline
from omni_core.client.collector import collect
from omni_testing.configs import chain
from omni_testing.faults import wait_for


@pytest.mark.parametrize("images", [False, True], ids=["ar.intake", "ar.mm_intake"])
def test_the_intake_takes_a_request_with_a_priority(images):
    source, params = parse_request({"prompt": "a", "max_tokens": 3, "priority": -4}, 16, images)
    assert source == "a" and params.max_tokens == 3


def test_engine_args_may_not_set_another_scheduling_policy_than_the_stage(tiny_model):
    with pytest.raises(ValueError, match="engine_args.scheduling_policy 'priority' differs"):
        VllmEngine(tiny_model, engine_args={"scheduling_policy": "priority"})


# the best priority: the waiting requests never preempt it (see the preemption test)
BLOCKER = {"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True, "priority": -9}
PRIORITIES = {"a": 2, "b": 0, "c": 2, "d": -1, "e": 0}
REQUESTS = {
    name: {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "priority": PRIORITIES[name]}
    for name, prompt in zip(
        PRIORITIES,
        ["a red fox", "the lazy dog", "héllo wörld", "omni pipelines stream", "a pale sky"],
        strict=True,
    )
}


def split_config(model, policy, decode_policy=None):
    """The split pipeline, decode one request at a time: ``policy`` on every stage
    (``decode_policy`` on decode) but postprocess, which schedules by priority (so that
    the pipeline takes priorities; it gets the requests one at a time, from decode, and
    cannot reorder them)."""
    opts = {"model": model, "threads": 1}
    decode = {"max_inflight": 1} | ({"scheduler_policy": decode_policy} if decode_policy else {})
    return chain(
        ("intake", "ar.intake", {"model": model}),
        ("prefill", "ar.prefill", opts),
        ("decode", "ar.decode", opts, decode),
        ("postprocess", "ar.postprocess", {"model": model}, {"scheduler_policy": "priority"}),
        mrs={"defaults": {"scheduler_policy": policy}},
        heartbeat_interval_s=0.05,
    )


def decode(pipe):
    return pipe.metrics()["stages"]["decode"]


def tokens(out):
    assert out.ok, out.error
    return [t for e in out.by_stage("postprocess") for t in e.tokens]


@pytest.mark.parametrize(
    ("policy", "decode_policy"),
    [("priority", None), ("fcfs", "priority"), ("fcfs", None)],
    ids=["priority", "priority-at-decode-only", "fcfs"],
)
def test_a_busy_decode_serves_the_waiting_requests_by_priority_then_arrival(
    tiny_model, policy, decode_policy
):
    """Under priority upstream stages may reorder too (a busy intake); with priority at
    decode only, the requests reach it in arrival order and decode's queue reorders."""
    with Pipeline(split_config(tiny_model, policy, decode_policy)) as pipe:
        blocker = pipe.submit(BLOCKER)
        wait_for(lambda: decode(pipe)["dequeued"] >= 1, 20, "decode took the blocker")
        handles = {name: pipe.submit(r) for name, r in REQUESTS.items()}
        # every one waits at decode at once (none taken yet): the next take chooses
        wait_for(lambda: decode(pipe)["queue_depth"] == len(REQUESTS), 20, "all wait at decode")
        assert collect(blocker).ok
        outs = {name: collect(h) for name, h in handles.items()}
        alone = {name: tokens(pipe.generate([r])[0]) for name, r in REQUESTS.items()}
    assert {name: tokens(out) for name, out in outs.items()} == alone
    ended = sorted(outs, key=lambda name: outs[name].events[-1].ts)
    names = list(REQUESTS)
    if "priority" in (policy, decode_policy):
        assert ended == sorted(names, key=lambda n: (PRIORITIES[n], names.index(n)))
    else:
        assert ended == names


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny Llama with room for 4096 positions: a request that cannot end before the
    test has seen what it waits for."""
    from omni_ar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-4k"), max_positions=4096))


def test_a_better_request_preempts_a_decoding_one_which_resumes_with_its_own_tokens(
    long_model,
):
    """Decode on the transformers engine is preemptible: the worse request leaves the
    decode batch (its KV kept) while the better one decodes, then goes on. The worse one
    asks for 4000 tokens, far more than it makes while the better one crosses the
    pipeline however loaded the machine, and is cancelled once it has streamed 16
    tokens after it resumed: its tokens up to then equal its own greedy run's."""
    low = {"prompt": "the quick brown fox", "max_tokens": 4000, "ignore_eos": True, "priority": 3}
    high = REQUESTS["d"]  # priority -1
    cfg = split_config(long_model, "priority")
    cfg["edges"][-1]["window"] = {"size": 1}  # postprocess streams each decode segment
    with Pipeline(cfg) as pipe:
        slow = pipe.submit(low)
        wait_for(lambda: decode(pipe)["dequeued"] >= 1, 20, "decode took the worse request")
        fast = collect(pipe.submit(high))
        assert not slow.done  # the better one ended while the worse one was paused
        wait_for(
            lambda: decode(pipe)["preemptions"] == 1 and decode(pipe)["paused"] == 0,
            20,
            "the worse request was preempted and resumed",
        )
        resumed = time.time()
        got: list[int] = []
        after = 0  # tokens of postprocess events made after the resume
        for ev in slow:
            if ev.event_type == "segment" and ev.stage == "postprocess":
                got += ev.tokens
                after += len(ev.tokens) if ev.ts > resumed else 0
            if after >= 16:
                break
        assert pipe.cancel(slow.request_id)
        stats = decode(pipe)
        alone = [tokens(pipe.generate([r])[0]) for r in ({**low, "max_tokens": len(got)}, high)]
    assert [got, tokens(fast)] == alone
    assert stats["preemptions"] == 1
