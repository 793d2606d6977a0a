"""``response_format``: json_object and json_schema through vLLM's structured outputs in
the fused ``ar.generate`` stage; a named error where a layout or engine cannot honour it
(the transformers engine, the prefill -> decode split); a schema vLLM refuses fails only
its own request."""

import json

import pytest
from omni_ar.params import RequestError, SamplingParams, parse_request
from omni_core import Pipeline

SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["count", "color"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
NEEDS = "field 'response_format': structured output needs the ar.generate stage on engine vllm"


@pytest.mark.parametrize(
    "fmt,where,message",
    [
        ({"type": "xml"}, "response_format.type", "expected one of"),
        ({}, "response_format.type", "expected one of"),
        ({"type": "json_object", "schema": {}}, "response_format.schema", "unknown"),
        ({"type": "json_schema"}, "response_format.json_schema", "expected an object"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
            "response_format.json_schema.schema",
            "expected a JSON Schema object, got list",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x"}},
            "response_format.json_schema.schema",
            "got nothing",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
            "response_format.json_schema.strict",
            "expected a boolean",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}},
            "response_format.json_schema.extra",
            "unknown field",
        ),
        ("json", "response_format", "Expected `object"),
    ],
)
def test_bad_response_format_names_the_field(fmt, where, message):
    with pytest.raises(RequestError, match=f"field '{where}'") as e:
        parse_request({"prompt": "x", "response_format": fmt}, 100)
    assert message in str(e.value)


def test_response_format_becomes_the_samplers_structured_output():
    def structured(fmt):
        return parse_request({"prompt": "x", "response_format": fmt}, 100)[1].structured()

    assert structured({"type": "text"}) is None
    assert SamplingParams().structured() is None
    assert structured({"type": "json_object"}) == {"json_object": True}
    assert structured(JSON_SCHEMA) == {"json": SCHEMA}


def config(model, split=False, **options):
    """intake -> ar.generate (or ar.prefill -> ar.decode) -> postprocess."""
    opts = {"model": model, "threads": 1, **options}
    if split:
        gen = [
            {"name": "prefill", "kind": "ar.prefill", "options": opts},
            {"name": "gen", "kind": "ar.decode", "max_inflight": 4, "options": opts},
        ]
    else:
        gen = [{"name": "gen", "kind": "ar.generate", "max_inflight": 4, "options": opts}]
    stages = [
        {"name": "intake", "kind": "ar.intake", "options": {"model": model}},
        *gen,
        {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": model}},
    ]
    names = [s["name"] for s in stages]
    edges = [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)]
    return {"heartbeat_interval_s": 0.1, "ready_timeout_s": 300, "stages": stages, "edges": edges}


def text_of(out):
    """(the answer's text, its finish reason)."""
    segs = out.by_stage("postprocess")
    return "".join(e.payload.get("text", "") for e in segs), segs[-1].payload["finish_reason"]


@pytest.mark.parametrize("split", [False, True], ids=["transformers-fused", "split"])
def test_structured_output_where_it_cannot_be_honoured_is_a_named_error(tiny_model, split):
    with Pipeline(config(tiny_model, split=split)) as pipe:
        outs = pipe.generate(
            [
                {"prompt": "a", "max_tokens": 4, "response_format": {"type": "json_object"}},
                {"prompt": "b", "max_tokens": 4, "response_format": JSON_SCHEMA},
                {"prompt": "c", "max_tokens": 4, "response_format": {"type": "text"}},
            ]
        )
    for out in outs[:2]:
        assert not out.ok
        assert NEEDS in out.error
        assert ("split" in out.error) == split and ("'transformers'" in out.error) != split
    assert outs[2].ok, outs[2].error


def test_vllm_fused_stage_samples_json_and_fails_only_a_refused_schema(vllm_model):
    """json_object output is JSON, json_schema output validates; a schema vLLM's backend
    refuses fails its request only, while the plain request that came with it completes."""
    engine_args = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20}
    cfg = config(vllm_model, engine="vllm", engine_args=engine_args)
    bad = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nonsense"}}}
    base = {"prompt": "the quick brown fox", "max_tokens": 200}
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(
            [
                {**base, "response_format": {"type": "json_object"}},
                {**base, "response_format": JSON_SCHEMA},
                {**base, "response_format": bad},
                {**base, "max_tokens": 8},
            ]
        )
        again = pipe.generate([{**base, "max_tokens": 4}])[0]  # the engine goes on
    assert [o.ok for o in outs] == [True, True, False, True], [o.error for o in outs]
    assert "field 'response_format'" in outs[2].error and "vLLM refused" in outs[2].error
    assert again.ok, again.error
    # the tiny random model writes a long string: json_object may run to max_tokens, so
    # a length-cut answer is only a JSON object's start; one that stopped parses
    text, reason = text_of(outs[0])
    assert text.startswith("{") and reason in ("stop", "length")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    text, reason = text_of(outs[1])
    assert reason == "stop", text  # the schema's answer is short: it closes
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(text), SCHEMA)
