"""What OpenAI clients send: logprobs and top_logprobs (chat and completions, streamed
too), finish_reason as the AR stages decide it, structured output (response_format and
vLLM's structured_outputs), image parts a text pipeline refuses, and the fields omni does
not support refused by name. Driven by the real ``openai`` client against ``omni serve``
on the tiny Llama."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from .conftest import chained, start_server, stop_server

pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def test_chat_logprobs_match_the_tokens(client):
    out = client.chat.completions.create(
        model="tiny_chat",
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=0,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 10
    assert all(c.logprob <= 0 for c in content)
    assert all(c.bytes == list(c.token.encode()) and c.top_logprobs == [] for c in content)
    # the tokens' texts spell the answer (the tiny model's vocabulary has no specials here)
    assert "".join(c.token for c in content).strip() == choice.message.content.strip()
    assert choice.finish_reason == "length"
    # without logprobs: none
    plain = client.chat.completions.create(
        model="tiny_chat", messages=MESSAGES, max_tokens=4, temperature=0
    )
    assert plain.choices[0].logprobs is None


def test_streamed_chat_logprobs_equal_the_whole_answers(client):
    kw = {"model": "tiny_chat", "messages": MESSAGES, "max_tokens": 9, "temperature": 0}
    full = client.chat.completions.create(**kw, logprobs=True)
    chunks = list(
        client.chat.completions.create(
            **kw, logprobs=True, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = [
        (c.token, c.logprob)
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    assert len(streamed) == chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [t for t, _ in streamed] == [c.token for c in full.choices[0].logprobs.content]
    expected = [c.logprob for c in full.choices[0].logprobs.content]
    assert [lp for _, lp in streamed] == pytest.approx(expected, abs=1e-4)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content


def test_completion_logprobs(client):
    out = client.completions.create(
        model="tiny_chat",
        prompt="a red fox",
        max_tokens=6,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(
        client.completions.create(
            model="tiny_chat",
            prompt="a red fox",
            max_tokens=6,
            logprobs=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert tokens == lp.tokens


def test_top_logprobs_the_models_alternatives(client):
    """``top_logprobs: k``: each token's k most likely alternatives, most likely first;
    greedy, the chosen token is the first of them (chat and completions, streamed too)."""
    kw = {"model": "tiny_chat", "max_tokens": 6, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    out = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for c in content:
        assert len(c.top_logprobs) == 3
        lps = [t.logprob for t in c.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert all(t.bytes == list(t.token.encode()) for t in c.top_logprobs)
        assert c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4)
    chunks = client.chat.completions.create(
        messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True, **kw
    )
    streamed = [
        [t.token for t in c.top_logprobs]
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    assert streamed == [[t.token for t in c.top_logprobs] for c in content]
    # legacy completions: logprobs N is the top N, as {text: logprob} per token
    done = client.completions.create(prompt="a red fox", logprobs=2, **kw)
    lp = done.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 6
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(chosen, abs=1e-4)
    # top_logprobs needs logprobs: true (as OpenAI says)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=MESSAGES, top_logprobs=3, **kw)
    assert e.value.body["param"] == "top_logprobs"


def test_a_text_pipeline_refuses_images_by_name(client):
    url = "data:image/png;base64,iVBORw0KGgo="
    parts = [{"type": "text", "text": "a "}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny_chat", messages=[{"role": "user", "content": parts}], max_tokens=2
        )
    assert e.value.body["param"] == "messages[0].content[1]"
    assert "multimodal pipeline" in e.value.body["message"]


def test_finish_reason_length_vs_stop(client):
    # the request's max_tokens
    out = client.completions.create(
        model="tiny_chat", prompt="a red fox", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    # the stage's default max_tokens (16): the request gives none
    dflt = client.completions.create(
        model="tiny_chat", prompt="a red fox", extra_body={"ignore_eos": True}
    )
    assert dflt.choices[0].finish_reason == "length"
    assert dflt.usage.completion_tokens == 16
    stream = client.completions.create(
        model="tiny_chat", prompt="a red fox", stream=True, extra_body={"ignore_eos": True}
    )
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    # a stop string
    text = out.choices[0].text
    stop = text[len(text) // 2 :][:2]
    cut = client.completions.create(model="tiny_chat", prompt="a red fox", max_tokens=8, stop=stop)
    assert cut.choices[0].finish_reason == "stop"


def test_legacy_functions_are_refused_by_name(client):
    # tools are served (test_tool_calling); the legacy functions API is not
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny_chat", messages=MESSAGES, functions=[{"name": "f", "parameters": {}}]
        )
    assert e.value.body["param"] == "functions"
    assert "not supported" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny_chat", messages=MESSAGES, tool_choice="auto")
    assert e.value.body["param"] == "tool_choice"


SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "c": {"type": "string", "enum": ["red", "blue"]},
    },
    "required": ["n", "c"],
    "additionalProperties": False,
}
# (extra request fields, the answer's check) for each kind of constraint
CONSTRAINED = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            }
        },
        lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
    ),
    ({"extra_body": {"structured_outputs": {"json": SCHEMA}}}, lambda t: json.loads(t)["c"]),
    (
        {"extra_body": {"structured_outputs": {"regex": "[0-9]{3}-x"}}},
        lambda t: re.fullmatch("[0-9]{3}-x", t),
    ),
    (
        {"extra_body": {"structured_outputs": {"choice": ["up", "down"]}}},
        lambda t: t in ("up", "down"),
    ),
    (
        {"extra_body": {"structured_outputs": {"grammar": 'root ::= ("a" | "b") "."'}}},
        lambda t: t in ("a.", "b."),
    ),
]


def check_constrained(client, model, max_tokens=60):
    """Every kind of constraint over the OpenAI client, chat and completions: each answer
    ends (stop) and holds to its constraint; the 400s name the field."""
    for extra, holds in CONSTRAINED:
        chat = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=max_tokens, **extra
        )
        # the client's completions take no response_format: it goes in the body as is
        as_body = (
            {"extra_body": {"response_format": extra["response_format"]}}
            if "response_format" in extra
            else extra
        )
        text = client.completions.create(
            model=model, prompt="the quick brown fox", max_tokens=max_tokens, **as_body
        )
        for choice, answer in (
            (chat.choices[0], chat.choices[0].message.content),
            (text.choices[0], text.choices[0].text),
        ):
            assert choice.finish_reason == "stop", (extra, answer)
            assert holds(answer), (extra, answer)
    json_object = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=max_tokens,
        response_format={"type": "json_object"},
    )
    answer = json_object.choices[0].message.content
    assert answer.startswith("{") and (
        json_object.choices[0].finish_reason == "length" or isinstance(json.loads(answer), dict)
    )
    for extra, param, words in (
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": [1]},
                }
            },
            "response_format.json_schema.schema",
            "expected a JSON Schema object",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "b", "schema": {"type": "no"}},
                }
            },
            "response_format.json_schema.schema",
            "Unsupported type",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "expected 'text'"),
        (
            {"extra_body": {"structured_outputs": {"regex": "(a"}}},
            "structured_outputs.regex",
            "not closed",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"extra_body": {"structured_outputs": {"choice": "ab"}}},
            "structured_outputs.choice",
            "list of strings",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=MESSAGES, **extra)
        assert e.value.body["param"] == param, e.value.body
        assert words in e.value.body["message"], e.value.body


def test_structured_output(client):
    """The prefill -> decode split on the transformers engine holds every kind."""
    ok = client.chat.completions.create(
        model="tiny_chat", messages=MESSAGES, max_tokens=2, response_format={"type": "text"}
    )
    assert ok.choices[0].message.content is not None
    check_constrained(client, "tiny_chat")


def test_unknown_and_null_fields(text_server):
    url = f"{text_server.url}/v1/chat/completions"
    body = {"messages": MESSAGES, "max_tokens": 2}
    # an unsupported field sent as null / empty is taken as absent
    r = httpx.post(url, json={**body, "tools": None, "functions": []}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(url, json={**body, "frobnicate": 1}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "frobnicate"
    assert "not supported" in err["message"]


def test_structured_output_on_vllm(tmp_path):
    """Every kind through ``omni serve`` on a fused vLLM pipeline (vLLM's own structured
    outputs); a bad constraint is a 400 naming the field."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from omni_ar.testing import build_tiny_llama

    model = str(build_tiny_llama(tmp_path / "model", head_dim=32))  # vLLM CPU: >= 32
    args = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20}
    opts = {"model": model, "threads": 1, "engine": "vllm", "engine_args": args}
    stages = [
        {"name": "intake", "kind": "ar.intake", "options": {"model": model}},
        {"name": "gen", "kind": "ar.generate", "options": opts},
        {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": model}},
    ]
    server = start_server(chained("tiny_vllm", stages), tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        check_constrained(client, "tiny_vllm", max_tokens=200)
    finally:
        stop_server(server)
