"""Structured generation: every constraint kind (JSON schema, JSON object, regex, choice,
grammar) on both engines and every layout (``ar.generate``; ``ar.prefill`` ->
``ar.decode``, the grammar's state carried over the handoff; decode prefilling short
prompts itself), each answer checked against its constraint; on vLLM, token for token
what vLLM's own ``LLM.generate`` gives under the same constraint. A malformed
constraint, or one a backend cannot hold to, fails its own request naming the field."""

import importlib.util
import json
import os
import re

import pytest
from omni_ar.params import RequestError, SamplingParams, parse_request
from omni_ar.structured import choice_grammar
from omni_ar.testing import run_oracle
from omni_core import Pipeline
from omni_core.config import ConfigError

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
REGEX = r"(cat|dog)s? [0-9]{2}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "a" ("b" | "c") ("b" | "c")? "!"'
# one request per kind, the answer's check for each
KINDS = {
    "json_schema": ({"response_format": JSON_SCHEMA}, "schema"),
    "json": ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "schema"),
    "json_object": ({"response_format": {"type": "json_object"}}, "object"),
    "regex": ({"structured_outputs": {"regex": REGEX}}, "regex"),
    "choice": ({"structured_outputs": {"choice": CHOICES}}, "choice"),
    "grammar": ({"structured_outputs": {"grammar": GRAMMAR}}, "grammar"),
}
PROMPTS = ["the quick brown fox", "a red fox in the snow, under a pale winter sky"]


def requests(max_tokens=40):
    return [
        {"prompt": p, "max_tokens": max_tokens, **spec}
        for spec, _ in KINDS.values()
        for p in PROMPTS
    ]


def holds(check, text, reason):
    """The answer is what its constraint allows (an answer cut at max_tokens: only a
    JSON object may run that long, and then it is one's start)."""
    if check == "object":
        if reason == "length":
            return text.startswith("{")
        return isinstance(json.loads(text), dict)
    if reason != "stop":
        return False
    if check == "schema":
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if check == "regex":
        return re.fullmatch(REGEX, text) is not None
    if check == "choice":
        return text in CHOICES
    return re.fullmatch(r"a[bc][bc]?!", text) is not None


def text_of(out):
    """(the answer's text, its finish reason, its tokens)."""
    segs = out.by_stage("postprocess")
    text = "".join(e.payload.get("text", "") for e in segs)
    return text, segs[-1].payload["finish_reason"], [t for e in segs for t in e.tokens]


def check_all(outs):
    """Every answer holds to its request's constraint; their tokens, in order."""
    checks = [check for _, check in KINDS.values() for _ in PROMPTS]
    tokens = []
    for out, check in zip(outs, checks, strict=True):
        assert out.ok, out.error
        text, reason, toks = text_of(out)
        assert holds(check, text, reason), (check, text, reason)
        tokens.append(toks)
    return tokens


# -- the constraint, checked where it enters -------------------------------------------


@pytest.mark.parametrize(
    "spec,where,message",
    [
        ({"regex": "(a|b"}, "structured_outputs.regex", "parenthesis is not closed"),
        ({"json": {"type": "nonsense"}}, "structured_outputs.json", "Unsupported type"),
        ({"json": "{not json"}, "structured_outputs.json", "not JSON"),
        ({"json": [1]}, "structured_outputs.json", "expected a JSON Schema object"),
        (
            {"json": {"type": "integer", "multipleOf": 3}},
            "structured_outputs.json",
            "'multipleOf' at $ is not supported",
        ),
        ({"grammar": 'root ::= "a" | '}, "structured_outputs.grammar", "EBNF parser error"),
        ({"grammar": ""}, "structured_outputs.grammar", "expected a non-empty string"),
        ({"choice": []}, "structured_outputs.choice", "expected a non-empty list"),
        ({}, "structured_outputs", "exactly one of"),
        ({"choice": ["a", 1]}, "structured_outputs.choice", "list of strings"),
        ({"choice": ["a", ""]}, "structured_outputs.choice", "must not be empty"),
        ({"regex": "a\x00b"}, "structured_outputs.regex", "NUL"),
        ({"regex": "a", "choice": ["b"]}, "structured_outputs", "exactly one of"),
        ({"xml": "a"}, "structured_outputs.xml", "unknown"),
        ({"json_object": "yes"}, "structured_outputs.json_object", "expected true"),
        ("json", "structured_outputs", "Expected `object"),
        ({"regex": "a" * 65537}, "structured_outputs.regex", "65537 characters, over 65536"),
        ({"json": "[" * 65536}, "structured_outputs.json", "not JSON"),
        (
            {"json": {"type": "string", "pattern": "[a-z]+", "maxLength": 5}},
            "structured_outputs.json",
            "'pattern' or 'format' with a length bound at $",
        ),
        (
            {"json": {"type": "object", "patternProperties": {"a": {}, "b": {}}}},
            "structured_outputs.json",
            "'patternProperties' beside 'properties' or another pattern at $",
        ),
        (
            {"json": {"type": "object", "propertyNames": {}, "properties": {}}},
            "structured_outputs.json",
            "'propertyNames' with other property keywords at $",
        ),
    ],
)
def test_a_bad_constraint_names_the_field(spec, where, message):
    with pytest.raises(RequestError, match=re.escape(f"field '{where}'")) as e:
        parse_request({"prompt": "x", "structured_outputs": spec}, 100)
    assert message in str(e.value)


def test_limits_hold_at_the_limit():
    """The largest regex and the most choices pass; one more fails (above)."""
    ok = parse_request({"prompt": "x", "structured_outputs": {"regex": "a" * 65536}}, 100)
    assert ok[1].structured() == {"regex": "a" * 65536}
    many = [f"c{i}" for i in range(1024)]
    assert parse_request({"prompt": "x", "structured_outputs": {"choice": many}}, 100)
    with pytest.raises(RequestError, match="at most 1024 choices, got 1025"):
        parse_request({"prompt": "x", "structured_outputs": {"choice": [*many, "x"]}}, 100)


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
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "x"}}},
            "response_format.json_schema.schema",
            "Unsupported type",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
            "response_format.json_schema.strict",
            "expected a boolean",
        ),
        ("json", "response_format", "Expected `object"),
    ],
)
def test_bad_response_format_names_the_field(fmt, where, message):
    with pytest.raises(RequestError, match=re.escape(f"field '{where}'")) as e:
        parse_request({"prompt": "x", "response_format": fmt}, 100)
    assert message in str(e.value)


def test_constraints_become_the_samplers():
    def structured(**fields):
        return parse_request({"prompt": "x", **fields}, 100)[1].structured()

    assert structured(response_format={"type": "text"}) is None
    assert SamplingParams().structured() is None
    assert structured(response_format={"type": "json_object"}) == {"json_object": True}
    assert structured(response_format=JSON_SCHEMA) == {"json": SCHEMA}
    assert structured(structured_outputs={"json": json.dumps(SCHEMA)}) == {"json": SCHEMA}
    assert structured(structured_outputs={"choice": CHOICES}) == {"choice": CHOICES}
    with pytest.raises(RequestError, match="field 'structured_outputs': give it or a JSON"):
        structured(response_format=JSON_SCHEMA, structured_outputs={"regex": "a"})
    # choices are exact strings: quotes and backslashes stay themselves
    assert choice_grammar(['say "hi"', "a\\b"]) == r'root ::= "say \"hi\"" | "a\\b"'


# -- the transformers engine, every layout ----------------------------------------------


def config(model, layout, engine="transformers", **options):
    """intake -> ar.generate (``fused``) or ar.prefill -> ar.decode (``split``; ``local``:
    decode prefills every prompt itself) -> postprocess."""
    opts = {"model": model, "engine": engine, "threads": 1, **options}
    if layout == "fused":
        gen = [{"name": "gen", "kind": "ar.generate", "max_inflight": 4, "options": opts}]
    else:
        local = 10_000 if layout == "local" else 0
        gen = [
            {
                "name": "prefill",
                "kind": "ar.prefill",
                "max_batch_size": 4,
                "options": {**opts, "local_prefill_max_tokens": local},
            },
            {"name": "gen", "kind": "ar.decode", "max_inflight": 4, "options": opts},
        ]
    intake = {"model": model, **{k: v for k, v in options.items() if k != "engine_args"}}
    stages = [
        {"name": "intake", "kind": "ar.intake", "options": intake},
        *gen,
        {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": model}},
    ]
    names = [s["name"] for s in stages]
    edges = [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)]
    return {"heartbeat_interval_s": 0.1, "ready_timeout_s": 300, "stages": stages, "edges": edges}


@pytest.fixture(scope="module")
def fused_tokens(tiny_model):
    with Pipeline(config(tiny_model, "fused")) as pipe:
        return check_all(pipe.generate(requests()))


@pytest.mark.parametrize("layout", ["split", "local"])
def test_transformers_every_kind_holds_and_the_split_equals_the_fused_stage(
    tiny_model, fused_tokens, layout
):
    """Greedy: the split layout's tokens equal the fused stage's, so decode continued the
    grammar prefill started (a restarted grammar would refuse or change the second
    token of every JSON answer)."""
    with Pipeline(config(tiny_model, layout)) as pipe:
        outs = pipe.generate(requests())
        bad = pipe.generate(
            [
                {"prompt": "x", "structured_outputs": {"regex": "(a"}},
                {"prompt": "the quick", "max_tokens": 8},
            ]
        )
    assert check_all(outs) == fused_tokens
    assert not bad[0].ok and "field 'structured_outputs.regex'" in bad[0].error
    assert bad[1].ok, bad[1].error  # the request beside it goes on


def test_a_stage_constraint_applies_to_requests_that_bring_none(tiny_model):
    cfg = config(tiny_model, "split", structured_outputs={"choice": CHOICES})
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(
            [
                {"prompt": "the quick brown fox", "max_tokens": 20},  # the stage's
                {"prompt": "the quick", "max_tokens": 20, **KINDS["regex"][0]},  # its own
                {"prompt": "the quick", "max_tokens": 6, "response_format": {"type": "text"}},
            ]
        )
    texts = [text_of(o)[0] for o in outs]
    assert texts[0] in CHOICES
    assert re.fullmatch(REGEX, texts[1])
    assert texts[2] not in CHOICES and text_of(outs[2])[1] == "length"  # free text


def test_a_bad_stage_constraint_is_a_config_error(tiny_model):
    with pytest.raises((ConfigError, ValueError), match=r"option 'structured_outputs.regex'"):
        Pipeline(config(tiny_model, "fused", structured_outputs={"regex": "(a"})).start()


def test_the_multimodal_stages_refuse_a_constraint_naming_why():
    from omni_ar.multimodal.stages import MMIntake

    assert "not built for the multimodal stages" in MMIntake.unstructured


# -- vLLM: its own structured outputs, and decode's continuation -------------------------

VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not VLLM and not os.environ.get("CI"), reason="vLLM is not installed"
)
ENGINE_ARGS = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20}

ORACLE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
model, args, reqs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=model, enforce_eager=True, dtype="float32",
          structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
          **args)
params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0,
                         structured_outputs=StructuredOutputsParams(**r["so"])) for r in reqs]
outs = llm.generate([r["prompt"] for r in reqs], params, use_tqdm=False)
print("ORACLE" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.fixture(scope="module")
def vllm_reference(vllm_model):
    """vLLM's own LLM.generate under each request's constraint, in a process of its own."""
    reqs = [
        {
            "prompt": r["prompt"],
            "max_tokens": r["max_tokens"],
            "so": parse_request(r, 100)[1].structured(),
        }
        for r in requests()
    ]
    return run_oracle(ORACLE, vllm_model, json.dumps(ENGINE_ARGS), json.dumps(reqs))


@needs_vllm
@pytest.mark.usefixtures("restore_environment")
@pytest.mark.parametrize("layout", ["fused", "split", "local"])
def test_vllm_every_kind_equals_vllms_own_generate(vllm_model, vllm_reference, layout):
    """Token for token vLLM's LLM.generate under the same constraint: the fused stage
    and decode's own prefill run vLLM's structured outputs; the split's decode continues
    prefill's grammar with omni's matcher, which allows what vLLM's would."""
    cfg = config(vllm_model, layout, engine="vllm", engine_args=ENGINE_ARGS)
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(requests())
        bad = pipe.generate(
            [
                {"prompt": "x", "structured_outputs": {"grammar": 'root ::= "a" | '}},
                {"prompt": "the quick", "max_tokens": 8},
            ]
        )
    assert check_all(outs) == vllm_reference
    assert not bad[0].ok and "field 'structured_outputs.grammar'" in bad[0].error
    assert bad[1].ok, bad[1].error


@needs_vllm
def test_decodes_matcher_waits_for_a_token_still_in_flight(tiny_model):
    """Under async scheduling (vLLM's default on a GPU) a row's output holds -1 for the
    step in flight when the processor runs: the matcher takes the real tokens only, the
    placeholder's token the next time, and masks the row each time."""
    import torch
    from omni_ar.engines.vllm_grammar import MATCHERS, Constrained, GrammarLogitsProcessor
    from omni_ar.structured import Grammars
    from transformers import AutoTokenizer
    from vllm import SamplingParams as VllmParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    tok = AutoTokenizer.from_pretrained(tiny_model)
    grammars = Grammars(tok, len(tok))
    a, b = (tok.convert_tokens_to_ids(t) for t in ("a", "b"))
    MATCHERS["k"] = state = Constrained(grammars.matcher({"regex": "ab+"}, [a]))
    try:
        proc = GrammarLogitsProcessor(None, torch.device("cpu"), False)
        output = [b, -1]
        sp = VllmParams(extra_args={"omni_grammar": "k"})
        proc.update_state(
            BatchUpdate(batch_size=1, removed=[], added=[(0, sp, [1], output)], moved=[])
        )
        logits = proc.apply(torch.zeros(1, len(tok)))
        assert state.accepted == 1 and state.error is None
        assert logits[0, b] == 0 and torch.isinf(logits[0, a])  # only b (or the end) next
        output[1] = b  # the step's token arrives
        proc.apply(torch.zeros(1, len(tok)))
        assert state.accepted == 2 and state.error is None
        output.append(a)  # a token the grammar refuses: the request's error, not the step's
        proc.apply(torch.zeros(1, len(tok)))
        assert state.error is not None and 0 not in proc.rows
    finally:
        MATCHERS.pop("k", None)
