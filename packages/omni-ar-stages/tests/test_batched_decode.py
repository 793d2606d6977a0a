"""The transformers engine decodes every request in flight in one batched forward per
step (left-padded cache, attention mask, position ids), with the tokens each request
gets alone: ``model.generate``'s when greedy, its own seeded stream when sampling."""

import threading

import pytest
import torch
from omni_ar.params import SamplingParams
from omni_core import Pipeline
from omni_core.client.collector import collect

PROMPTS = [  # different lengths, different max_tokens
    ("the quick brown fox", 24),
    ("a red fox in the snow, under a pale winter sky", 9),
    ("héllo", 30),
    ("omni pipelines stream tokens from stage to stage", 17),
]


@pytest.fixture(scope="module")
def expected(engine):
    """Greedy tokens from ``model.generate``, one request at a time."""
    out = []
    for text, n in PROMPTS:
        ids = engine.encode(text)
        gen = engine.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        out.append(gen[0, len(ids) :].tolist())
    assert len({tuple(g) for g in out}) == len(out)
    return out


def start(engine, text, params):
    """(first token, the decode iterator), the request in the batch from now on."""
    first, _, keys, values = engine.prefill(engine.encode(text), params)
    return first, engine.decode(first, keys, values, params)


def round_robin(streams, outs, rounds=None):
    """Drive the iterators in turn, as the decode worker does its generators."""
    active = list(range(len(streams)))
    while active and rounds != 0:
        for i in list(active):
            try:
                outs[i].append(next(streams[i])[0])
            except StopIteration:
                active.remove(i)
        rounds = None if rounds is None else rounds - 1


def test_concurrent_requests_get_their_own_greedy_tokens_in_one_forward_per_step(engine, expected):
    started = [start(engine, t, SamplingParams(max_tokens=n)) for t, n in PROMPTS]
    outs = [[first] for first, _ in started]
    before = engine.batch.forwards
    round_robin([s for _, s in started], outs)
    assert outs == expected
    # one forward per step for all of them: the longest request's steps, not the sum
    longest = max(len(g) for g in expected) - 1
    assert engine.batch.forwards - before == longest < sum(len(g) - 1 for g in expected) / 2
    assert not engine.batch.requests  # all left the batch


def test_a_request_joining_mid_way_and_a_cancel_leave_the_others_right(engine, expected):
    params = [SamplingParams(max_tokens=n) for _, n in PROMPTS]
    started = [start(engine, t, p) for (t, _), p in zip(PROMPTS[:2], params[:2], strict=True)]
    streams = [s for _, s in started]
    outs = [[first] for first, _ in started]
    round_robin(streams, outs, rounds=3)
    late = start(engine, PROMPTS[2][0], params[2])  # joins a batch 3 steps in
    cancelled = start(engine, PROMPTS[3][0], params[3])
    streams += [late[1], cancelled[1]]
    outs += [[late[0]], [cancelled[0]]]
    round_robin(streams, outs, rounds=2)
    streams[3].close()  # cancel: it leaves the batch, its KV with it
    assert len(engine.batch.requests) == 3
    streams[3] = iter(())
    round_robin(streams, outs)
    assert outs[:3] == expected[:3]
    assert outs[3] == expected[3][:3]
    assert not engine.batch.requests
    # closed before its first step (cancelled while queued): out of the batch too
    first, unread = start(engine, PROMPTS[0][0], params[0])
    assert len(engine.batch.requests) == 1
    unread.close()
    assert not engine.batch.requests


def test_a_paused_request_leaves_the_steps_and_resumes_with_its_own_tokens(engine, expected):
    # preemption (scheduler_policy: priority): a paused request is out of the batch's
    # forwards, keeps its KV and the tokens it had, and goes on as if never paused
    params = [SamplingParams(max_tokens=n) for _, n in PROMPTS]
    started = [start(engine, t, p) for (t, _), p in zip(PROMPTS, params, strict=True)]
    streams = [s for _, s in started]
    outs = [[first] for first, _ in started]
    round_robin(streams, outs, rounds=3)
    streams[0].pause()
    streams[2].pause()
    assert len(engine.batch.requests) == 2 and len(engine.batch.parked) == 2
    before = engine.batch.forwards
    round_robin([streams[1], streams[3]], [outs[1], outs[3]], rounds=4)
    assert engine.batch.forwards - before == 4  # the paused ones wait; the others step
    assert [len(o) for o in outs] == [4, 8, 4, 8]
    streams[0].resume()
    round_robin(streams[:2], outs[:2], rounds=2)  # one paused while the rest ran
    streams[2].resume()
    streams[3].pause()
    streams[3].close()  # cancelled while paused: nothing of it stays
    streams[3] = iter(())
    round_robin(streams, outs)
    assert outs[:3] == expected[:3]
    assert not engine.batch.requests and not engine.batch.parked


def test_seeded_sampling_in_a_batch_is_the_same_as_alone(engine):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    first, alone = start(engine, PROMPTS[0][0], params)
    alone_out = [[first]]
    round_robin([alone], alone_out)
    others = [
        start(engine, t, SamplingParams(max_tokens=12, temperature=0.8, seed=1))
        for t, _ in PROMPTS[1:]
    ]
    first, again = start(engine, PROMPTS[0][0], params)
    outs = [[first]] + [[f] for f, _ in others]
    round_robin([again] + [s for _, s in others], outs)
    assert outs[0] == alone_out[0] and len(set(outs[0])) > 3


def pipeline_config(model, kind, max_inflight, **options):
    opts = {"model": model, "threads": 1, "max_segment_tokens": 4, **options}
    return {
        "heartbeat_interval_s": 0.1,
        "ready_timeout_s": 300,
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": {"model": model}},
            {"name": "prefill", "kind": "ar.prefill", "options": {"model": model}},
            {"name": "gen", "kind": kind, "max_inflight": max_inflight, "options": opts},
            {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": model}},
        ],
        "edges": [
            {"from": "intake", "to": "prefill" if kind == "ar.decode" else "gen"},
            *([{"from": "prefill", "to": "gen"}] if kind == "ar.decode" else []),
            {"from": "gen", "to": "postprocess", "window": {"size": 1}},
        ],
    }


@pytest.mark.parametrize("kind", ["ar.decode", "ar.generate"])
def test_batched_stage_equals_the_model_and_a_cancel_leaves_the_others_right(
    tiny_model, expected, kind
):
    cfg = pipeline_config(tiny_model, kind, max_inflight=8)
    if kind == "ar.generate":
        cfg["stages"] = [s for s in cfg["stages"] if s["name"] != "prefill"]
    requests = [{"prompt": t, "max_tokens": n} for t, n in PROMPTS]
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(requests)
        assert [[t for e in o.by_stage("postprocess") for t in e.tokens] for o in outs] == expected
        long = {"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True}
        h = pipe.submit(long)
        others = [pipe.submit(r) for r in requests]
        next(iter(h))  # it streams: cancel it mid-decode, the others go on
        assert pipe.cancel(h.request_id)
        outs = [collect(o) for o in others]
        assert [[t for e in o.by_stage("postprocess") for t in e.tokens] for o in outs] == expected


def test_a_request_arriving_mid_decode_joins_the_batch_at_the_next_step(tiny_model):
    """The decode stage's generators give each other a turn after every step, not only
    when one sends a segment: a request that arrives while a long one decodes joins its
    batch at once (here, with segments of 64 tokens, the long one's first send after its
    first token is its last: a turn only then would hold the new one till it ends)."""
    cfg = pipeline_config(
        tiny_model, "ar.decode", max_inflight=8, max_segment_tokens=64, min_flush_interval_ms=60000
    )
    long = {"prompt": "the quick brown fox", "max_tokens": 60, "ignore_eos": True}
    short = {"prompt": "héllo", "max_tokens": 6, "ignore_eos": True}
    with Pipeline(cfg) as pipe:
        h = pipe.submit(long)
        it = iter(h)
        next(it)  # its first token: it decodes now
        ended = []
        other = pipe.submit(short)
        done = threading.Thread(target=lambda: (collect(other), ended.append("short")))
        done.start()
        for _ in it:
            pass
        ended.append("long")
        done.join(60)
        assert ended == ["short", "long"]
