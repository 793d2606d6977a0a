"""The transformers engine prefills prompts that arrive together in one forward
(left-padded, an attention mask, each row's own positions), with what each prompt gets
alone: the same first token (greedy, seeded, under a grammar), its logprob and
alternatives, and its KV without the padding, within float rounding."""

import numpy as np
import pytest
from omni_ar.engines import transformers_engine
from omni_ar.engines.transformers_engine import TransformersEngine, _chunks
from omni_ar.params import SamplingParams, params_payload, parse_request
from omni_ar.stages.prefill import Prefill
from omni_core import Pipeline, StageInput
from omni_core.client.collector import collect
from omni_core.dataplane.windows import Piece, Window
from omni_core.stage import StageContext
from omni_testing.events import events_of

TOL = 1e-4  # float32: a padded batch's sums round differently, ~1e-6 here
TEXTS = [  # 8 prompts of different lengths, the longest 30x the shortest
    "hi",
    "the quick brown fox jumps over the lazy dog, " * 3,
    "a red fox",
    "héllo wörld, omni",
    "x " * 40,
    "what is the capital of France?",
    "q",
    "stream tokens from stage to stage",
]


def params_of(i):
    """A mix: greedy, seeded sampling (with top_p), top_logprobs, and a grammar."""
    kinds = [
        {},
        {"temperature": 0.9, "seed": 7},
        {"logprobs": True, "top_logprobs": 5},
        {"structured_outputs": {"regex": "(cat|dog)s? [0-9]{2}"}},
        {"temperature": 1.2, "top_p": 0.8, "seed": 3, "logprobs": True, "top_logprobs": 2},
        {"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
        {"temperature": 0.7, "seed": 11},
        {},
    ]
    return parse_request({"prompt": "x", "max_tokens": 8, **kinds[i % len(kinds)]}, 100)[1]


def assert_same(one, batched):
    """A batched prefill's results equal one-by-one's: tokens exactly, floats within TOL."""
    assert len(one) == len(batched)
    for a, b in zip(one, batched, strict=True):
        assert a[0] == b[0]
        assert abs(a[1] - b[1]) < TOL
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert np.allclose([lp for _, lp in a.top], [lp for _, lp in b.top], atol=TOL)
        for x, y in ((a[2], b[2]), (a[3], b[3])):
            assert x.shape == y.shape and x.dtype == y.dtype
            assert np.isfinite(y).all()
            assert np.abs(x - y).max() < TOL * max(1.0, float(np.abs(x).max()))


def one_by_one(engine, prompts, params):
    return [engine.prefill(ids, p) for ids, p in zip(prompts, params, strict=True)]


def test_a_burst_of_8_prefills_in_one_forward_with_one_by_ones_outputs(engine):
    prompts = [engine.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == 8
    params = [params_of(i) for i in range(8)]
    expected = one_by_one(engine, prompts, params)
    before = engine.prefill_forwards
    got = list(engine.prefill_many(prompts, params))
    assert engine.prefill_forwards - before == 1
    assert_same(expected, got)
    # the KV is each prompt's own length: the padding is cut off
    assert [k.shape[2] for _, _, k, _ in got] == [len(p) for p in prompts]


def test_the_seeded_and_constrained_rows_take_their_own_token_again(engine):
    """The same burst twice gives the same tokens (each row's generator is seeded
    afresh); a grammar row's token is one its grammar allows."""
    prompts = [engine.encode(t) for t in TEXTS]
    params = [params_of(i) for i in range(8)]
    first = [r[0] for r in engine.prefill_many(prompts, params)]
    assert [r[0] for r in engine.prefill_many(prompts, params)] == first
    choice = engine.tokenizer.decode([first[5]])
    assert any(c.startswith(choice) for c in ["yes", "no", "maybe so"])


def test_a_token_budget_splits_the_burst_and_keeps_the_outputs(engine, monkeypatch):
    prompts = [engine.encode(t) for t in TEXTS]
    params = [params_of(i) for i in range(8)]
    expected = one_by_one(engine, prompts, params)
    monkeypatch.setattr(engine, "prefill_batch_tokens", 100)
    chunks = _chunks([len(p) for p in prompts], 100)
    assert len(chunks) > 2 and [i for c in chunks for i in c] == list(range(8))
    before = engine.prefill_forwards
    assert_same(expected, list(engine.prefill_many(prompts, params)))
    assert engine.prefill_forwards - before == sum(len(c) > 1 for c in chunks)


def test_chunks_keep_the_order_within_the_budget():
    assert _chunks([3, 5, 2, 9, 1], 100) == [[0, 1, 2, 3, 4]]
    assert _chunks([3, 5, 2, 9, 1], 15) == [[0, 1, 2], [3], [4]]
    assert _chunks([3, 5, 2, 9, 1], 12) == [[0, 1], [2], [3], [4]]
    assert _chunks([20, 1, 1], 10) == [[0], [1, 2]]


def test_where_batching_cannot_be_exact_prefill_goes_one_by_one(engine, monkeypatch):
    """An M-RoPE model (3-D positions from the images), or one with a layer that is not
    attention (the padding would run through a recurrent state: no mask stops it)."""
    assert engine._batches_prefill()
    prompts = [engine.encode(t) for t in TEXTS[:3]]
    params = [SamplingParams(max_tokens=4)] * 3
    monkeypatch.setattr(transformers_engine, "uses_mrope", lambda config: True)
    assert not engine._batches_prefill()
    before = engine.prefill_forwards
    assert_same(one_by_one(engine, prompts, params), list(engine.prefill_many(prompts, params)))
    assert engine.prefill_forwards == before
    monkeypatch.undo()
    config = engine.model.config
    monkeypatch.setattr(config, "layer_types", ["mamba", "full_attention"], raising=False)
    assert not engine._batches_prefill()
    monkeypatch.setattr(config, "layer_types", ["sliding_attention", "full_attention"])
    assert engine._batches_prefill()


def test_smollm2_burst_equals_one_by_one():
    from omni_ar.models import resolve_model

    try:
        model = str(resolve_model("smollm2"))
    except Exception as e:  # the packaged model is not installed here
        pytest.skip(f"smollm2: {e}")
    e = TransformersEngine(model)
    e.load_tokenizer()
    e.load_model()
    prompts = [e.encode([{"role": "user", "content": t}]) for t in TEXTS]
    params = [params_of(i) for i in range(8)]
    expected = one_by_one(e, prompts, params)
    before = e.prefill_forwards
    assert_same(expected, list(e.prefill_many(prompts, params)))
    assert e.prefill_forwards - before == 1


# -- the stage ---------------------------------------------------------------------------


def stage_input(i, ids, params):
    """Request ``i`` as ``ar.prefill`` receives it from intake: its ids, its params."""
    piece = Piece(0, ids, {}, params_payload(params))
    windows = {"up": Window("up", 0, 0, 0, [piece], True)}
    return StageInput(f"r{i}", {"prompt": "x"}, windows, True, True)


def run(stage, inputs):
    return events_of(stage.process(inputs))


def test_the_prefill_stage_batch_equals_its_prompts_one_by_one(tiny_model):
    """What the worker hands ``ar.prefill`` with ``max_batch_size: 8``: one forward; the
    events (first token, logprobs, top ids, KV) are those of each prompt alone, and those
    of ``batch_prefill: false``."""
    stages = {}
    for flag in (True, False):
        ctx = StageContext("prefill", "ar.prefill", {"model": tiny_model, "batch_prefill": flag})
        stages[flag] = Prefill(ctx)
        stages[flag].load()
    tok = stages[True].engine.load_tokenizer()
    inputs = [stage_input(i, tok(t)["input_ids"], params_of(i)) for i, t in enumerate(TEXTS)]
    alone = [ev for inp in inputs for ev in run(stages[True], [inp])]
    before = stages[True].engine.prefill_forwards
    batched = run(stages[True], inputs)
    assert stages[True].engine.prefill_forwards - before == 1
    unbatched = run(stages[False], inputs)
    assert stages[False].engine.prefill_forwards == 0
    for a, b, c in zip(alone, batched, unbatched, strict=True):
        assert a.request_id == b.request_id == c.request_id
        assert a.tokens == b.tokens == c.tokens
        assert a.payload.keys() == b.payload.keys()
        tops = [np.array(e.payload.get("top_ids", [])).reshape(-1, 2) for e in (a, b)]
        assert np.array_equal(tops[0][:, 0], tops[1][:, 0])
        assert np.allclose(tops[0][:, 1], tops[1][:, 1], atol=TOL)
        assert np.allclose(a.payload.get("logprobs", []), b.payload.get("logprobs", []), atol=TOL)
        for name in ("keys", "values"):
            assert np.array_equal(a.arrays[name], c.arrays[name])
            assert np.abs(a.arrays[name] - b.arrays[name]).max() < TOL


def test_a_pipeline_prefilling_bursts_equals_the_inline_pipeline(tiny_model):
    """Eight requests at once through worker processes, prefill taking up to 8 a batch,
    give the tokens of the in-process pipeline (one request after another)."""
    opts = {"model": tiny_model, "threads": 1}
    requests = [
        {"prompt": t, "max_tokens": 6, **({"temperature": 0.8, "seed": i} if i % 2 else {})}
        for i, t in enumerate(TEXTS)
    ]

    def config(enabled):
        return {
            "mrs": {"enabled": enabled},
            "stages": [
                {"name": "intake", "kind": "ar.intake", "options": {"model": tiny_model}},
                {"name": "prefill", "kind": "ar.prefill", "max_batch_size": 8, "options": opts},
                {"name": "decode", "kind": "ar.decode", "max_inflight": 8, "options": opts},
            ],
            "edges": [{"from": "intake", "to": "prefill"}, {"from": "prefill", "to": "decode"}],
        }

    outs = {}
    for enabled in (False, True):
        with Pipeline(config(enabled)) as pipe:
            handles = [pipe.submit(r, timeout_s=120) for r in requests]
            outs[enabled] = [collect(h) for h in handles]
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a.ok and b.ok, (a.error, b.error)
        tokens = [[t for e in o.by_stage("decode") for t in e.tokens] for o in (a, b)]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 6
