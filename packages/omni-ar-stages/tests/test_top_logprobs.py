"""``top_logprobs``: per generated token, the k most likely alternatives; the text
stages put them in the segment payload as ``top_logprobs``, a list aligned with the
segment's tokens of ``[token_text, logprob]`` pairs, most likely first (the contract the
server renders as OpenAI's ``logprobs.content[i].top_logprobs``)."""

import pytest
from omni_ar.engines.transformers_engine import TransformersEngine
from omni_ar.params import RequestError, SamplingParams, parse_request
from omni_ar.testing import layout_config as config
from omni_core import Pipeline

K = 3
REQUEST = {"prompt": "the quick brown fox", "max_tokens": 10, "ignore_eos": True}


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"top_logprobs": 21, "logprobs": True}, "expected 0..20, got 21"),
        ({"top_logprobs": -1, "logprobs": True}, "expected 0..20, got -1"),
        ({"top_logprobs": "3", "logprobs": True}, "Expected `int`"),
        ({"top_logprobs": 2}, "needs 'logprobs': true"),
    ],
)
def test_bad_top_logprobs_name_the_field(fields, message):
    with pytest.raises(RequestError, match="field 'top_logprobs'") as e:
        parse_request({"prompt": "x", **fields}, 100)
    assert message in str(e.value)


def check_alternatives(tokens, logprobs, tops, greedy=True):
    """Each token has K alternatives, sorted, its own logprob among them; greedy's token
    is the first one."""
    assert len(tops) == len(tokens) == len(logprobs) > 0
    for tok, lp, alts in zip(tokens, logprobs, tops, strict=True):
        assert len(alts) == K
        lps = [x for _, x in alts]
        assert lps == sorted(lps, reverse=True)
        if greedy:
            assert alts[0][0] == tok and alts[0][1] == pytest.approx(lp, abs=1e-4)
        elif tok in [t for t, _ in alts]:  # sampled: among them with its logprob, or below
            assert dict(alts)[tok] == pytest.approx(lp, abs=1e-4)
        else:
            assert lp <= lps[-1] + 1e-4


def test_transformers_engine_returns_the_top_k_of_prefill_and_every_step(tiny_model):
    e = TransformersEngine(tiny_model)
    e.load_tokenizer()
    e.load_model()
    for params, greedy in [
        (SamplingParams(max_tokens=8, logprobs=True, top_logprobs=K, ignore_eos=True), True),
        (SamplingParams(max_tokens=8, logprobs=True, top_logprobs=K, temperature=1.5), False),
    ]:
        pre = e.prefill(e.encode(REQUEST["prompt"]), params)
        first, lp, keys, values = pre
        steps = list(e.decode(first, keys, values, params))
        tokens = [first, *(t for t, _ in steps)]
        check_alternatives(
            tokens, [lp, *(x for _, x in steps)], [pre.top, *(s.top for s in steps)], greedy
        )
    plain = e.prefill(e.encode("x"), SamplingParams(logprobs=True))
    assert plain.top == []


@pytest.mark.parametrize("layout", ["split-window-1", "split-window-4", "fused", "inline"])
def test_segments_carry_top_logprobs_as_token_texts(tiny_model, layout):
    check_pipeline(config(tiny_model, layout), "gen" if layout == "inline" else "postprocess")


def check_pipeline(cfg, sink):
    """Two requests with top_logprobs and one without, at once: each segment's
    ``top_logprobs`` are aligned with its tokens and right; the first request's, by token."""
    requests = [
        {**REQUEST, "logprobs": True, "top_logprobs": K},
        {**REQUEST, "logprobs": True},
        {**REQUEST, "prompt": "a red fox", "logprobs": True, "top_logprobs": K},
    ]
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(requests)
    assert all(o.ok for o in outs), [o.error for o in outs]
    for out in outs[::2]:
        segs = out.by_stage(sink)
        tokens = [t for e in segs for t in e.tokens]
        assert len(tokens) == REQUEST["max_tokens"]
        texts = [x for e in segs for x in e.payload["token_texts"]]
        tops = [a for e in segs for a in e.payload["top_logprobs"]]
        assert all(len(e.payload["top_logprobs"]) == len(e.tokens) for e in segs)
        assert all(isinstance(t, str) for alts in tops for t, _ in alts)
        # greedy: the chosen token first, by its text, with its logprob
        check_alternatives(texts, [x for e in segs for x in e.logprobs], tops)
    assert all("top_logprobs" not in e.payload for e in outs[1].by_stage(sink))
    return [a for e in outs[0].by_stage(sink) for a in e.payload["top_logprobs"]]


@pytest.mark.parametrize("layout", ["split-window-1", "fused"])
def test_vllm_segments_carry_top_logprobs_equal_to_the_transformers_engine(vllm_model, layout):
    """vLLM's alternatives (``SamplingParams(logprobs=k)``), prefill's first token's
    included, are the transformers engine's: same texts, same logprobs."""
    engine_args = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20}
    cfg = config(vllm_model, layout, engine="vllm", engine_args=engine_args)
    tops = check_pipeline(cfg, "postprocess")
    e = TransformersEngine(vllm_model)
    e.load_tokenizer()
    e.load_model()
    params = SamplingParams(
        max_tokens=REQUEST["max_tokens"], logprobs=True, top_logprobs=K, ignore_eos=True
    )
    pre = e.prefill(e.encode(REQUEST["prompt"]), params)
    first, _, keys, values = pre
    expected = [pre.top, *(s.top for s in e.decode(first, keys, values, params))]
    assert len(tops) == len(expected)
    for got, want in zip(tops, expected, strict=True):
        assert [x for _, x in got] == pytest.approx([x for _, x in want], abs=1e-3)
        assert [t for t, _ in got] == [e.tokenizer.decode([t]) for t, _ in want]
