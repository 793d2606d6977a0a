"""The AR stages end to end on the transformers engine, against the model in one process."""

import time

import pytest
import torch
from omni_core import Pipeline
from omni_core.client.collector import collect
from omni_testing.events import events_of
from omni_testing.faults import kill_stage, wait_ready
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    {"prompt": "the quick brown fox", "max_tokens": 24},
    {"prompt": "a red fox in the snow", "max_tokens": 17},
    {"prompt": "héllo wörld", "max_tokens": 30},
    {"messages": [{"role": "user", "content": "stream tokens"}], "max_tokens": 20},
]


def ar_config(model, enabled=True, post_window=1, decode=None, **top):
    opts = {"model": model, "threads": 1}
    return {
        "mrs": {"enabled": enabled},
        "heartbeat_interval_s": 0.1,
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": {"model": model}},
            {"name": "prefill", "kind": "ar.prefill", "options": opts},
            {"name": "decode", "kind": "ar.decode", **(decode or {}), "options": opts},
            {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": model}},
        ],
        "edges": [
            {"from": "intake", "to": "prefill"},
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "postprocess", "window": {"size": post_window}},
        ],
        **top,
    }


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy tokens from ``model.generate`` in this process, per prompt."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    out = []
    for r in PROMPTS:
        if "prompt" in r:
            ids = tok(r["prompt"])["input_ids"]
        else:
            ids = list(
                tok.apply_chat_template(r["messages"], add_generation_prompt=True)["input_ids"]
            )
        gen = model.generate(torch.tensor([ids]), max_new_tokens=r["max_tokens"], do_sample=False)[
            0, len(ids) :
        ].tolist()
        out.append(gen)
    assert len({tuple(g) for g in out}) == len(out) and all(len(set(g)) > 3 for g in out)
    return tok, out


def check_outputs(outs, tok, expected):
    """Each output: the reference's tokens and text, ended for the reason it ended."""
    for out, exp, req in zip(outs, expected, PROMPTS, strict=True):
        assert out.ok, out.error
        text, tokens = text_and_tokens(out)
        assert tokens == exp
        assert text == tok.decode(exp, skip_special_tokens=True)
        reason = "length" if len(exp) == req["max_tokens"] else "stop"  # max_tokens, or EOS
        assert out.events[-1].payload["finish_reason"] == reason


def text_and_tokens(out):
    segs = out.by_stage("postprocess")
    return "".join(e.payload["text"] for e in segs), [t for e in segs for t in e.tokens]


@pytest.mark.parametrize(
    "enabled,post_window", [(True, 1), (True, 4), (True, -1), (False, 1)], ids=str
)
def test_staged_tokens_and_text_equal_the_model_in_one_process(
    tiny_model, reference, enabled, post_window
):
    tok, expected = reference
    with Pipeline(ar_config(tiny_model, enabled, post_window)) as pipe:
        outs = pipe.generate(PROMPTS)
    check_outputs(outs, tok, expected)


@pytest.fixture(scope="module")
def pipe(tiny_model):
    cfg = ar_config(
        tiny_model,
        decode={"client_stream": True},
    )
    cfg["stages"][2]["options"] = {
        "model": tiny_model,
        "threads": 1,
        "max_segment_tokens": 5,
        "min_flush_interval_ms": 1e6,
    }
    with Pipeline(cfg) as p:
        yield p


def test_decode_flushes_every_max_segment_tokens(pipe, reference):
    _, expected = reference
    out = pipe.generate([PROMPTS[0]])[0]
    sizes = [len(e.tokens) for e in out.by_stage("decode")]
    # prefill's first token leaves at once (time to first token), then segments of 5
    assert sizes == [1, 5, 5, 5, 5, 3]
    assert [t for e in out.by_stage("decode") for t in e.tokens] == expected[0]


def test_stop_string_spanning_segments(pipe, reference):
    tok, expected = reference
    full = tok.decode(expected[2], skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    out = pipe.generate([{**PROMPTS[2], "stop": [stop]}])[0]
    text, _ = text_and_tokens(out)
    assert text == full[: full.index(stop)]
    assert out.by_stage("postprocess")[-1].payload["finish_reason"] == "stop"


def test_bad_input_ends_only_its_request(pipe, reference):
    _, expected = reference
    outs = pipe.generate(
        [{"prompt": "a", "max_tokens": 0}, PROMPTS[1], {"prompt": ""}, {"prompt": "x", "top_k": -2}]
    )
    assert [o.finish_reason for o in outs] == ["error", "completed", "error", "error"]
    assert "stage 'intake'" in outs[0].error and "field 'max_tokens'" in outs[0].error
    assert "field 'prompt'" in outs[2].error and "field 'top_k'" in outs[3].error
    assert text_and_tokens(outs[1])[1] == expected[1]


def test_cancel_mid_decode(pipe, reference):
    h = pipe.submit({"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True})
    first = next(iter(h))
    assert first.event_type == "segment"
    assert pipe.cancel(h.request_id)
    assert [e.event_type for e in h if e.terminal] == ["cancelled"]
    out = pipe.generate([PROMPTS[0]])[0]
    assert text_and_tokens(out)[1] == reference[1][0]


def test_decode_killed_mid_request(pipe, reference):
    h = pipe.submit({"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True})
    next(iter(h))
    kill_stage(pipe, "decode")
    events = list(h)
    assert events[-1].event_type == "error" and "stage 'decode'" in events[-1].message
    wait_ready(pipe, "decode")
    out = pipe.generate([PROMPTS[1]])[0]
    assert text_and_tokens(out)[1] == reference[1][1]


def test_inline_detokenization_in_decode_gives_the_same_text(tiny_model, reference):
    tok, expected = reference
    cfg = ar_config(tiny_model, enabled=False)
    cfg["stages"] = cfg["stages"][:3]
    cfg["stages"][2]["options"] = {"model": tiny_model, "inline_detokenize": True}
    cfg["edges"] = cfg["edges"][:2]
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(PROMPTS[:2])
    for out, exp in zip(outs, expected, strict=False):
        segs = out.by_stage("decode")
        assert [t for e in segs for t in e.tokens] == exp
        assert "".join(e.payload["text"] for e in segs) == tok.decode(exp, skip_special_tokens=True)


@pytest.mark.parametrize("size,overlap", [(16, 4), (-1, 0)])
def test_talker_consumes_decode_output_in_windows(tiny_model, size, overlap):
    opts = {"model": tiny_model, "threads": 1}
    window = {"size": size, "overlap": overlap}
    cfg = {
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": {"model": tiny_model}},
            {"name": "prefill", "kind": "ar.prefill", "options": opts},
            {"name": "decode", "kind": "ar.decode", "options": opts, "client_stream": True},
            {"name": "talker", "kind": "ar.talker", "options": opts},
        ],
        "edges": [
            {"from": "intake", "to": "prefill"},
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "talker", "window": window},
        ],
    }
    request = {"prompt": "the quick brown fox", "max_tokens": 40, "ignore_eos": True}
    with Pipeline(cfg) as pipe:
        out = pipe.generate([request])[0]
    assert out.ok, out.error
    talker = [e for e in out.by_stage("talker") if e.tokens]
    if (
        size == 16
    ):  # windows of 16 new tokens (the last shorter), each after the first with 4 of context
        assert [e.payload["tokens_in"] for e in talker] == [16, 20, 12]
        assert [e.payload["context"] for e in talker] == [0, 4, 4]
    else:
        assert [e.payload["tokens_in"] for e in talker] == [40]
    assert all(len(e.tokens) == 1 for e in talker)


def test_the_longest_stop_strings_allowed_do_not_stall_other_requests(tiny_model, reference):
    """Postprocess serves every request: one with 16 stop strings of 1,024 characters
    (the intake's limits) must cost it little per token, or everyone waits behind it."""
    tok, ref = reference
    stops = [chr(0x4E00 + k) * 1024 for k in range(16)]  # never in the tiny model's text
    heavy = {"prompt": "the quick brown fox", "max_tokens": 64, "stop": stops}
    heavy["ignore_eos"] = True
    with Pipeline(ar_config(tiny_model)) as pipe:
        t0 = time.monotonic()
        alone = pipe.generate([PROMPTS[0]])[0]
        solo_s = time.monotonic() - t0
        t0 = time.monotonic()
        h_heavy = pipe.submit(heavy)
        light = pipe.generate([PROMPTS[0]])[0]
        light_s = time.monotonic() - t0
        heavy_out = collect(h_heavy)
    assert alone.ok and light.ok and heavy_out.ok
    assert text_and_tokens(light) == text_and_tokens(alone)
    assert len(text_and_tokens(heavy_out)[1]) == 64
    assert light_s < max(10.0, 5 * solo_s), (light_s, solo_s)


def test_the_fused_generate_stage_equals_the_model_and_the_split_pipeline(tiny_model, reference):
    tok, expected = reference
    opts = {"model": tiny_model, "threads": 1}
    cfg = {
        "heartbeat_interval_s": 0.1,
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": {"model": tiny_model}},
            {"name": "generate", "kind": "ar.generate", "max_inflight": 4, "options": opts},
            {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": tiny_model}},
        ],
        "edges": [
            {"from": "intake", "to": "generate"},
            {"from": "generate", "to": "postprocess", "window": {"size": 1}},
        ],
    }
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(PROMPTS)
    check_outputs(outs, tok, expected)


def test_conditional_disaggregation_prefills_short_prompts_in_decode(tiny_model, reference):
    """``local_prefill_max_tokens``: prompts up to it pass prefill without a forward and
    decode prefills them itself; longer ones hand their KV over; all equal the model."""
    tok, expected = reference
    cfg = ar_config(tiny_model, decode={"max_inflight": 4})
    prefill = cfg["stages"][1]
    prefill["client_stream"] = True  # its events reach the caller: which way each went
    short = len(tok(PROMPTS[0]["prompt"])["input_ids"])
    prefill["options"] = {**prefill["options"], "local_prefill_max_tokens": short}
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(PROMPTS)
    check_outputs(outs, tok, expected)
    local = []
    for out in outs:
        (ev,) = out.by_stage("prefill")
        local.append(bool(ev.payload.get("local_prefill")))
        assert len(ev.tokens) == (0 if local[-1] else 1)
        assert ev.payload["prompt_tokens"] == len(ev.payload["prompt_ids"])
    assert local[0] and not all(local), local  # both ways taken


def test_split_pipeline_across_replicas_equals_the_model(tiny_model, reference):
    """Prefill and decode at 2 replicas each, postprocess in windows of 4 at 2: every
    request's KV goes from the prefill replica it is bound to the decode replica it is
    bound to; tokens and text equal the model (and so one replica), and every replica
    served."""
    tok, expected = reference
    cfg = ar_config(tiny_model, post_window=4, decode={"replicas": 2})
    cfg["stages"][1]["replicas"] = 2
    cfg["stages"][3]["replicas"] = 2
    replicas = [f"{stage}#{i}" for stage in ("prefill", "decode", "postprocess") for i in (0, 1)]
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(PROMPTS * 2)
        # the counters come with heartbeats: wait for those sent after the last request
        deadline = time.monotonic() + 10
        while True:
            stats = pipe.metrics()["stages"]
            served = all(stats[r]["completed"] >= 1 for r in replicas)
            if served or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    check_outputs(outs[: len(PROMPTS)], tok, expected)
    check_outputs(outs[len(PROMPTS) :], tok, expected)
    assert served, {r: stats[r] for r in replicas}


def test_chat_options_put_the_system_prompt_and_examples_before_a_plain_prompt(tiny_model):
    """``chat``, ``system_prompt`` and ``examples`` make a plain prompt the conversation a
    user would send as ``messages``: the same tokens come back; without the examples
    others do."""
    chat = {
        "chat": True,
        "system_prompt": "answer briefly",
        "examples": [
            {"user": "the quick brown fox", "assistant": "jumps"},
            {"user": "a red fox", "assistant": "in the snow"},
        ],
    }
    turns = [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "jumps"},
        {"role": "user", "content": "a red fox"},
        {"role": "assistant", "content": "in the snow"},
        {"role": "user", "content": "stream tokens"},
    ]
    cfg = ar_config(tiny_model)
    cfg["stages"][0]["options"].update(chat)
    plain = {"prompt": "stream tokens", "max_tokens": 12}
    with Pipeline(cfg) as pipe:  # messages are sent as they are
        with_examples, as_messages, no_examples, raw = pipe.generate(
            [
                plain,
                {"messages": turns, "max_tokens": 12},
                {"messages": turns[-1:], "max_tokens": 12},
                {**plain, "raw_prompt": True},  # as the server's /v1/completions sends it
            ]
        )
    assert with_examples.ok and as_messages.ok and no_examples.ok and raw.ok
    assert text_and_tokens(with_examples)[1] == text_and_tokens(as_messages)[1]
    assert text_and_tokens(with_examples)[1] != text_and_tokens(no_examples)[1]
    # raw_prompt: the prompt's own tokens, no template, no system prompt, no examples
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert prompt_tokens(raw) == len(tok("stream tokens")["input_ids"])
    templated = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert prompt_tokens(with_examples) == len(templated) > prompt_tokens(raw)


def prompt_tokens(out) -> int:
    """The prompt's length, as the postprocess stage's first event carries it."""
    (n,) = [
        e.payload["prompt_tokens"]
        for e in out.by_stage("postprocess")
        if "prompt_tokens" in e.payload
    ]
    return n


def test_examples_need_chat():
    from omni_core.config import ConfigError, parse_config

    def config(**options):
        stage = {"name": "intake", "kind": "ar.intake", "options": {"model": "m", **options}}
        return {"stages": [stage]}

    example = [{"user": "u", "assistant": "a"}]
    parse_config(config(chat=True, examples=example))
    with pytest.raises(ConfigError, match=r"examples are chat turns"):
        parse_config(config(examples=example))
    with pytest.raises(ConfigError, match=r"options\.examples\[0\]"):
        parse_config(config(chat=True, examples=[{"user": "u"}]))


def test_decode_fails_a_malformed_handoff_alone_naming_the_edge_and_field(tiny_model):
    """A handoff from prefill that does not parse ends that request, as the stage's
    failure (not the client's), with the edge and the field; the next request is served."""
    from omni_ar.stages.decode import Decode
    from omni_core import StageInput
    from omni_core.dataplane.windows import Piece, Window
    from omni_core.stage import StageContext

    stage = Decode(StageContext("decode", "ar.decode", {"model": tiny_model}))
    stage.load()

    def run(payload):
        window = Window("prefill", 0, 0, 0, [Piece(0, [1], {}, payload)], True)
        return events_of(stage.process([StageInput("r", {}, {"prefill": window}, True, True)]))

    for payload, field in (
        (
            {"params": {"max_tokens": "many"}},
            "Expected `int`, got `str` - at `$.params.max_tokens`",
        ),
        ({"params": {}, "top_ids": "x"}, "Expected `array`, got `str` - at `$.top_ids`"),
        ({}, "Object missing required field `params`"),
    ):
        (ev,) = run(payload)
        assert ev.event_type == "error" and ev.code == "stage_error", ev
        assert ev.message == f"handoff from prefill: {field}", ev.message
    # a well-formed one that prefilled nothing: decode prefills it itself and goes on
    events = run({"params": {"max_tokens": 3}, "prompt_ids": [1, 2, 3], "local_prefill": True})
    assert [t for e in events if e is not None and e.event_type == "segment" for t in e.tokens]
