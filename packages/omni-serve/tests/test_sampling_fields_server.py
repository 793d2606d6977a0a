"""The penalties, logit_bias and vLLM's extra sampling fields through ``omni serve`` with
the real ``openai`` client (vLLM's extras in ``extra_body``), chat and completions: each
answer equals the transformers engine's in this process with the same params (the engine
itself is held to transformers' logits processors in omni-ar-stages' test_sampling_fields);
each range at its limit and one past, a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
PROMPT = "a red fox"

# (OpenAI arguments, vLLM's extras) of each request
FIELDS = [
    ({"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {"261": 3.0}}, {}),
    ({"logit_bias": {"2": 50.0}}, {"min_tokens": 5}),
    ({}, {"repetition_penalty": 0.5}),
    # "ken" and "re": in the chat's and the completion's plain answers; 289 ends the chat's
    ({}, {"bad_words": ["ken", "re"], "stop_token_ids": [289]}),
    ({"temperature": 1.5, "seed": 3}, {"top_k": 1}),
    ({"temperature": 1.5, "seed": 3}, {"min_p": 1.0}),
    ({"logit_bias": {"2": 50.0}}, {"ignore_eos": True, "skip_special_tokens": False}),
]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from omni_ar.engines.transformers_engine import TransformersEngine

    e = TransformersEngine(tiny_llama)
    e.load_tokenizer()
    e.load_model()
    return e


def expected_text(engine, source, fields, n):
    """The engine's answer in this process, as the postprocess stage makes it text."""
    from omni_ar.detokenizer import detokenizer
    from omni_ar.params import parse_request

    key = "messages" if isinstance(source, list) else "prompt"
    _, params = parse_request({key: source, "max_tokens": n, **fields}, 100)
    ids = engine.encode(source)
    first, _, keys, values = engine.prefill(ids, params)
    tokens = [first, *(t for t, _ in engine.decode(first, keys, values, params, ids))]
    stops = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else engine.eos_ids))
    d = detokenizer(engine.tokenizer, params, stops)
    return d.add(tokens) + d.flush(), tokens


@pytest.mark.parametrize("openai_kw,extra", FIELDS, ids=lambda x: ",".join(x) or "-")
def test_chat_and_completions_carry_the_fields(client, engine, openai_kw, extra):
    n = 10
    want_chat, tokens = expected_text(engine, MESSAGES, {**openai_kw, **extra}, n)
    sampling = {k: v for k, v in openai_kw.items() if k in ("temperature", "seed")}
    plain, _ = expected_text(engine, MESSAGES, sampling, n)
    if extra.get("ignore_eos"):
        assert 2 in tokens and "</s>" in want_chat  # EOS's text, special tokens kept
    chat = client.chat.completions.create(
        model="tiny_chat", messages=MESSAGES, max_tokens=n, extra_body=extra, **openai_kw
    )
    assert chat.choices[0].message.content == want_chat
    assert want_chat != plain  # the fields changed the answer
    want_text, _ = expected_text(engine, PROMPT, {**openai_kw, **extra}, n)
    text = client.completions.create(
        model="tiny_chat", prompt=PROMPT, max_tokens=n, extra_body=extra, **openai_kw
    )
    assert text.choices[0].text == want_text


def test_min_tokens_holds_the_end_off_and_a_stop_token_ends_it(client):
    kw = {"model": "tiny_chat", "messages": MESSAGES, "max_tokens": 12, "logit_bias": {"2": 50}}
    assert client.chat.completions.create(**kw).usage.completion_tokens == 1  # EOS at once
    out = client.chat.completions.create(**kw, extra_body={"min_tokens": 6})
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "stop"
    out = client.chat.completions.create(
        **kw, extra_body={"min_tokens": 3, "stop_token_ids": [261], "ignore_eos": True}
    )
    assert out.choices[0].finish_reason in ("stop", "length")


def test_include_stop_str_in_output(client):
    kw = {"model": "tiny_chat", "prompt": PROMPT, "max_tokens": 12}
    full = client.completions.create(**kw).choices[0].text
    stop = full[2:5]
    cut = client.completions.create(**kw, stop=[stop]).choices[0].text
    kept = (
        client.completions.create(
            **kw, stop=[stop], extra_body={"include_stop_str_in_output": True}
        )
        .choices[0]
        .text
    )
    assert kept == cut + stop and full.startswith(kept)


def bad(client, param, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny_chat", messages=MESSAGES, max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


# (field, values at the limit, values one past) as OpenAI or vLLM bounds them
RANGES = [
    ("frequency_penalty", [-2, 2], [-2.01, 2.01]),
    ("presence_penalty", [-2, 2], [-2.01, 2.01]),
    ("repetition_penalty", [1e-3], [0, -1]),
    ("top_k", [-1, 0, 1], [-2]),
    ("min_p", [0, 1], [-0.01, 1.01]),
    ("min_tokens", [0, 4], [-1]),
]


@pytest.mark.parametrize("field,ok,past", RANGES, ids=[r[0] for r in RANGES])
def test_ranges_at_the_limit_and_one_past(client, field, ok, past):
    for value in ok:
        client.chat.completions.create(
            model="tiny_chat", messages=MESSAGES, max_tokens=4, extra_body={field: value}
        )
    for value in past:
        bad(client, field, extra_body={field: value})


def test_the_pipeline_checks_what_needs_the_model(client):
    # min_tokens past max_tokens, token ids outside the 320-token vocabulary
    assert "max_tokens" in bad(client, "min_tokens", extra_body={"min_tokens": 5})
    client.chat.completions.create(
        model="tiny_chat", messages=MESSAGES, max_tokens=2, logit_bias={"319": 100}
    )
    assert "vocabulary" in bad(client, "logit_bias", logit_bias={"320": 1})
    assert "vocabulary" in bad(client, "stop_token_ids", extra_body={"stop_token_ids": [320]})


def test_logit_bias_values_and_keys(client):
    client.chat.completions.create(
        model="tiny_chat", messages=MESSAGES, max_tokens=2, logit_bias={"5": -100, "6": 100}
    )
    bad(client, "logit_bias.5", logit_bias={"5": 100.5})
    bad(client, "logit_bias.5", logit_bias={"5": -100.5})
    assert "token ids" in bad(client, "logit_bias", logit_bias={"x": 1})
    assert "at most 300" in bad(client, "logit_bias", logit_bias={str(i): 1 for i in range(301)})
