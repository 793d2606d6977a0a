"""vLLM's sampling fields on the transformers engine, each against transformers' own
logits processors on the same logits (greedy on the tiny Llama: token for token), every
request of a batched decode with its own; their ranges at the limit and one past; and
the fields carried through every text layout (split, fused, conditional
disaggregation)."""

import pytest
import torch
from omni_ar.logits import Logits, bad_word_ids, warp
from omni_ar.params import RequestError, SamplingParams, parse_request
from omni_core import Pipeline
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper

PROMPT = "the quick brown fox"
N = 12


class OpenAIPenalties(LogitsProcessor):
    """The frequency and presence penalties as vLLM applies them (OpenAI's definition),
    over the generated tokens only: transformers has no processor of its own for them."""

    def __init__(self, prompt_len, frequency, presence):
        self.n, self.f, self.p = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.n :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, out, torch.ones_like(out, dtype=scores.dtype)
        )
        return scores - self.f * counts - self.p * (counts > 0).to(scores.dtype)


def hf_generate(engine, ids, n=N, processors=(), **kwargs):
    """Greedy ``model.generate`` with transformers' processors (its kwargs and ours)."""
    gen = engine.model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        logits_processor=LogitsProcessorList(list(processors)),
        pad_token_id=0,
        **kwargs,
    )
    return gen[0, len(ids) :].tolist()


def ours(engine, ids, params):
    """Prefill, then the batched decode: every token."""
    first, _, keys, values = engine.prefill(ids, params)
    return [first, *(t for t, _ in engine.decode(first, keys, values, params, ids))]


@pytest.fixture(scope="module")
def ids(engine):
    return engine.encode(PROMPT)


@pytest.fixture(scope="module")
def greedy(engine, ids):
    out = hf_generate(engine, ids)
    assert len(out) == N and 2 not in out
    return out


def cases(engine, ids, greedy):
    """(our params, transformers' generate arguments) per field."""
    n = len(ids)
    eos_bias = {"sequence_bias": {(2,): 50.0}}
    again, again_hf = {str(greedy[0]): 3.0}, {(greedy[0],): 3.0}
    bad = bad_word_ids(engine.tokenizer, [engine.tokenizer.decode([greedy[2]])])
    return {
        # the first token made likeliest at every step, so that it repeats: the penalties
        # take it back (this model's plain greedy output repeats nothing)
        "repetition_penalty": (
            {"repetition_penalty": 1.8, "logit_bias": again},
            {"repetition_penalty": 1.8, "sequence_bias": again_hf},
        ),
        "repetition_penalty<1": ({"repetition_penalty": 0.5}, {"repetition_penalty": 0.5}),
        "frequency_penalty": (
            {"frequency_penalty": 0.6, "logit_bias": again},
            {"sequence_bias": again_hf, "processors": [OpenAIPenalties(n, 0.6, 0.0)]},
        ),
        "presence_penalty": (
            {"presence_penalty": 2.0, "logit_bias": again},
            {"sequence_bias": again_hf, "processors": [OpenAIPenalties(n, 0, 2.0)]},
        ),
        "negative_penalties": (
            {"frequency_penalty": -0.5, "presence_penalty": -1.0},
            {"processors": [OpenAIPenalties(n, -0.5, -1.0)]},
        ),
        "logit_bias": (
            {"logit_bias": {str(greedy[1]): -100.0, "7": 5.0}},
            {"sequence_bias": {(greedy[1],): -100.0, (7,): 5.0}},
        ),
        # EOS made likeliest: min_tokens holds it off (MinNewTokensLengthLogitsProcessor)
        "min_tokens": (
            {"logit_bias": {"2": 50.0}, "min_tokens": 5},
            {**eos_bias, "min_new_tokens": 5, "eos_token_id": 2},
        ),
        "min_tokens_with_stop_token_ids": (
            {"logit_bias": {"2": 50.0, "9": 60.0}, "min_tokens": 4, "stop_token_ids": [9]},
            {
                "sequence_bias": {(2,): 50.0, (9,): 60.0},
                "min_new_tokens": 4,
                "eos_token_id": [2, 9],
            },
        ),
        "bad_words": (
            {"bad_words": [engine.tokenizer.decode([greedy[2]])]},
            {"bad_words_ids": bad},
        ),
        "all_of_them": (
            {
                "repetition_penalty": 1.3,
                "frequency_penalty": 0.7,
                "presence_penalty": 0.4,
                "logit_bias": {"11": 3.0},
            },
            {
                "repetition_penalty": 1.3,
                "sequence_bias": {(11,): 3.0},
                "processors": [OpenAIPenalties(n, 0.7, 0.4)],
            },
        ),
    }


CASES = [
    "repetition_penalty",
    "repetition_penalty<1",
    "frequency_penalty",
    "presence_penalty",
    "negative_penalties",
    "logit_bias",
    "min_tokens",
    "min_tokens_with_stop_token_ids",
    "bad_words",
    "all_of_them",
]


def expected_tokens(engine, ids, kwargs, n=N):
    """transformers' tokens, cut where our engine ends (EOS or a stop token: generate
    pads after it)."""
    out = hf_generate(engine, ids, n, **kwargs)
    stops = {2} | set(
        kwargs.get("eos_token_id", []) if isinstance(kwargs.get("eos_token_id"), list) else []
    )
    for i, t in enumerate(out):
        if t in stops:
            return out[: i + 1]
    return out


@pytest.mark.parametrize("case", CASES)
def test_each_field_equals_transformers_processors_greedy(engine, ids, greedy, case):
    ours_kw, hf_kw = cases(engine, ids, greedy)[case]
    hf_kw = dict(hf_kw)
    expected = expected_tokens(engine, ids, hf_kw)
    got = ours(engine, ids, SamplingParams(max_tokens=N, **ours_kw))
    assert got == expected
    # the field changed something (beside the logit_bias that sets the scene)
    scene = {k: v for k, v in ours_kw.items() if k == "logit_bias" and case != "logit_bias"}
    assert got != ours(engine, ids, SamplingParams(max_tokens=N, **scene))


def test_requests_in_one_batched_decode_each_get_their_own_fields(engine, ids, greedy):
    table = cases(engine, ids, greedy)
    started, expected = [], []
    for case in CASES:
        ours_kw, hf_kw = table[case]
        expected.append(expected_tokens(engine, ids, dict(hf_kw)))
        p = SamplingParams(max_tokens=N, **ours_kw)
        first, _, keys, values = engine.prefill(ids, p)
        started.append(([first], engine.decode(first, keys, values, p, ids)))
    plain = SamplingParams(max_tokens=N)
    first, _, keys, values = engine.prefill(ids, plain)
    started.append(([first], engine.decode(first, keys, values, plain, ids)))
    expected.append(greedy)
    before = engine.batch.forwards
    active = list(range(len(started)))
    while active:
        for i in list(active):
            s = next(started[i][1], None)
            if s is None:
                active.remove(i)
            else:
                started[i][0].append(s[0])
    assert [out for out, _ in started] == expected
    assert engine.batch.forwards - before == N - 1  # one forward a step for all of them


def test_stop_token_ids_end_the_request_at_the_first_of_them(engine, ids, greedy):
    stop = greedy[4]
    got = ours(engine, ids, SamplingParams(max_tokens=N, stop_token_ids=[stop, 319]))
    assert got == greedy[: greedy.index(stop) + 1]
    # ignore_eos does not reach stop_token_ids (vLLM's meaning)
    got = ours(engine, ids, SamplingParams(max_tokens=N, stop_token_ids=[stop], ignore_eos=True))
    assert got == greedy[: greedy.index(stop) + 1]


@pytest.mark.parametrize("k", [1, 5, 40])
def test_top_k_equals_transformers_top_k_warper(k):
    logits = torch.randn(320, generator=torch.Generator().manual_seed(k))
    p = SamplingParams(temperature=0.7, top_k=k)
    want = TopKLogitsWarper(k)(None, logits[None] / 0.7)[0]
    assert torch.equal(warp(logits / 0.7, p), want)


@pytest.mark.parametrize("min_p", [0.01, 0.2, 1.0])
def test_min_p_equals_transformers_min_p_warper(min_p):
    logits = torch.randn(320, generator=torch.Generator().manual_seed(3)) * 4
    p = SamplingParams(temperature=1.3, min_p=min_p)
    want = MinPLogitsWarper(min_p)(None, logits[None] / 1.3)[0]
    assert torch.equal(warp(logits / 1.3, p), want)


@pytest.mark.parametrize("field", [{"top_k": 1}, {"min_p": 1.0}])
def test_sampling_under_top_k_1_or_min_p_1_is_greedy(engine, ids, greedy, field):
    got = ours(engine, ids, SamplingParams(max_tokens=N, temperature=1.5, seed=7, **field))
    assert got == greedy
    sampled = ours(engine, ids, SamplingParams(max_tokens=N, temperature=1.5, seed=7))
    assert sampled != greedy


def test_repetition_penalty_counts_prompt_and_output_as_transformers_does(engine, ids):
    logits = torch.randn(320, generator=torch.Generator().manual_seed(0))
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    p = SamplingParams(repetition_penalty=1.7)
    state = Logits(p, ids, {2}, output=[5, 5, 9])
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[*ids, 5, 5, 9]]), logits[None])
    assert torch.equal(state.adjust(logits), want[0])


# -- ranges: at the limit and one past ------------------------------------------------


@pytest.mark.parametrize(
    "field,ok,bad",
    [
        ("frequency_penalty", [-2.0, 2.0], [-2.01, 2.01]),
        ("presence_penalty", [-2.0, 2.0], [-2.01, 2.01]),
        ("repetition_penalty", [1e-6, 2.0, 100.0], [0.0, -1.0]),
        ("top_k", [-1, 0, 1, 1000], [-2]),
        ("min_p", [0.0, 1.0], [-0.01, 1.01]),
        ("min_tokens", [0, 16], [-1, 17]),
    ],
)
def test_ranges_at_the_limit_and_one_past(field, ok, bad):
    for value in ok:
        assert getattr(parse_request({"prompt": "a", field: value}, 100)[1], field) == value
    for value in bad:
        with pytest.raises(RequestError, match=f"field '{field}'"):
            parse_request({"prompt": "a", field: value}, 100)


def test_logit_bias_values_and_keys():
    ok = {"prompt": "a", "logit_bias": {"0": -100.0, "319": 100.0}}
    assert parse_request(ok, 100)[1].logit_bias == {"0": -100.0, "319": 100.0}
    for bias, where in [
        ({"5": 100.5}, "logit_bias.5"),
        ({"5": -100.5}, "logit_bias.5"),
        ({"x": 1.0}, "logit_bias"),
        ({"-1": 1.0}, "logit_bias"),
        ({str(i): 1.0 for i in range(301)}, "logit_bias"),
    ]:
        with pytest.raises(RequestError, match=f"field '{where}'"):
            parse_request({"prompt": "a", "logit_bias": bias}, 100)


def test_token_ids_outside_the_vocabulary_are_refused_by_the_engine(engine):
    engine.check_tokens(SamplingParams(logit_bias={"319": 1.0}, stop_token_ids=[319]))
    for params, field in [
        (SamplingParams(logit_bias={"320": 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[320]), "stop_token_ids"),
    ]:
        with pytest.raises(RequestError, match=f"field '{field}': token id 320 is not in"):
            engine.check_tokens(params)


def test_other_lists_at_their_limits():
    parse_request({"prompt": "a", "stop_token_ids": list(range(64))}, 100)
    parse_request({"prompt": "a", "bad_words": ["x"] * 128}, 100)
    for field, value in [
        ("stop_token_ids", list(range(65))),
        ("stop_token_ids", [-1]),
        ("bad_words", ["x"] * 129),
        ("bad_words", [" "]),
    ]:
        with pytest.raises(RequestError, match=f"field '{field}'"):
            parse_request({"prompt": "a", field: value}, 100)


# -- every text layout carries them -----------------------------------------------------


def layout(model, kind):
    opts = {"model": model, "threads": 1}
    intake = {"name": "intake", "kind": "ar.intake", "options": {"model": model}}
    post = {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": model}}
    if kind == "fused":
        stages = [intake, {"name": "decode", "kind": "ar.generate", "options": opts}, post]
        edges = [("intake", "decode"), ("decode", "postprocess")]
    else:
        local = 1000 if kind == "disaggregated-local" else 0
        prefill = {"model": model, "threads": 1, "local_prefill_max_tokens": local}
        stages = [
            intake,
            {"name": "prefill", "kind": "ar.prefill", "options": prefill},
            {"name": "decode", "kind": "ar.decode", "options": opts},
            post,
        ]
        edges = [("intake", "prefill"), ("prefill", "decode"), ("decode", "postprocess")]
    return {
        "mrs": {"enabled": False},
        "stages": stages,
        "edges": [{"from": a, "to": b} for a, b in edges],
    }


@pytest.mark.parametrize("kind", ["split", "fused", "disaggregated-local"])
def test_every_layout_carries_the_fields(tiny_model, engine, ids, greedy, kind):
    table = cases(engine, ids, greedy)
    reqs, expected = [], []
    for case in ("all_of_them", "min_tokens_with_stop_token_ids", "bad_words"):
        ours_kw, hf_kw = table[case]
        reqs.append({"prompt": PROMPT, "max_tokens": N, **ours_kw})
        expected.append(expected_tokens(engine, ids, dict(hf_kw)))
    tok = engine.tokenizer
    # the stop token's text: dropped (vLLM's default) or kept; special tokens' text kept
    stop = greedy[4]
    reqs.append({"prompt": PROMPT, "max_tokens": N, "stop_token_ids": [stop]})
    reqs.append(
        {
            "prompt": PROMPT,
            "max_tokens": N,
            "stop_token_ids": [stop],
            "include_stop_str_in_output": True,
        }
    )
    upto = greedy[: greedy.index(stop) + 1]
    expected += [upto, upto]
    text = tok.decode(greedy)
    cut = text[len(tok.decode(greedy[:1])) :][:3]  # a stop string after the first token
    reqs.append(
        {"prompt": PROMPT, "max_tokens": N, "stop": [cut], "include_stop_str_in_output": True}
    )
    expected.append(None)
    with Pipeline(layout(tiny_model, kind)) as pipe:
        outs = pipe.generate(reqs)
    texts = []
    for out, exp in zip(outs, expected, strict=True):
        assert out.ok, out.error
        segs = out.by_stage("postprocess")
        texts.append("".join(e.payload["text"] for e in segs))
        if exp is not None:
            assert [t for e in segs for t in e.tokens] == exp
    assert texts[3] == tok.decode(upto[:-1]) and texts[4] == tok.decode(upto)
    assert (
        texts[5].endswith(cut)
        and texts[5] == text[: text.index(cut, len(tok.decode(greedy[:1]))) + len(cut)]
    )
