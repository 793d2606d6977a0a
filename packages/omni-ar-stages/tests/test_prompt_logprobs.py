"""``prompt_logprobs``: each prompt token's logprob after the first, and its k likeliest
alternatives, from the model's raw logits (vLLM's meaning; the server's ``echo`` asks for
them). The text stages hand them to the caller with the first segment as
``prompt_logprobs``: ``{tokens, logprobs, top}``, every prompt token's text, the first
one's logprob and alternatives None. Checked against the model's own forward, on both
engines and every text layout."""

import pytest
from omni_ar.params import RequestError, parse_request
from omni_ar.testing import layout_config, prompt_forward
from omni_core import Pipeline

K = 3
PROMPT = "the quick brown fox jumps over"
ASK = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "prompt_logprobs": K}


@pytest.mark.parametrize(
    "value,message",
    [(21, "expected 0..20, got 21"), (-1, "expected 0..20, got -1"), ("2", "Expected `int")],
)
def test_a_bad_prompt_logprobs_names_the_field(value, message):
    with pytest.raises(RequestError, match="field 'prompt_logprobs'") as e:
        parse_request({"prompt": "x", "prompt_logprobs": value}, 100)
    assert message in str(e.value)
    for fine in (0, 20, None):
        assert (
            parse_request({"prompt": "x", "prompt_logprobs": fine}, 100)[1].prompt_logprobs == fine
        )


def check(cfg: dict, sink: str, model_dir: str, tol: float) -> None:
    """A request asking for the prompt's logprobs beside one that does not, at once: the
    first carries them once, on its first segment, equal to the reference within
    ``tol``; the other carries none; both generate their tokens."""
    ref = prompt_forward(model_dir, PROMPT, K)
    texts, chosen, tops = ref.texts, ref.chosen, ref.tops
    plain = {k: v for k, v in ASK.items() if k != "prompt_logprobs"}
    with Pipeline(cfg) as pipe:
        asked, other = pipe.generate([ASK, plain])
    assert asked.ok and other.ok, (asked.error, other.error)
    segs = asked.by_stage(sink)
    carried = [e.payload["prompt_logprobs"] for e in segs if "prompt_logprobs" in e.payload]
    assert len(carried) == 1 and "prompt_logprobs" in segs[0].payload
    (got,) = carried
    assert got["tokens"] == texts
    assert got["logprobs"][0] is None and got["top"][0] is None
    assert got["ids"] == ref.ids
    assert got["logprobs"][1:] == pytest.approx(chosen, abs=tol)
    assert got["ranks"][0] is None
    # the same rank, or a neighbour's where two logprobs are closer than the engines agree
    slack = 0 if tol <= 1e-4 else 1
    assert all(abs(a - b) <= slack for a, b in zip(got["ranks"][1:], ref.ranks, strict=True))
    assert got["top_ids"][0] is None
    assert [[t for t, _ in row] for row in got["top_ids"][1:]] == [
        [t for t, _ in row] for row in ref.top_ids
    ]
    for mine, want in zip(got["top"][1:], tops, strict=True):
        assert [t for t, _ in mine] == [t for t, _ in want]
        assert [x for _, x in mine] == pytest.approx([x for _, x in want], abs=tol)
    assert sum(len(e.tokens) for e in segs) == ASK["max_tokens"]
    assert not any("prompt_logprobs" in e.payload for e in other.by_stage(sink))


@pytest.mark.parametrize("layout", ["split-window-1", "split-window-4", "fused", "inline"])
def test_the_transformers_engine_gives_the_prompts_logprobs_in_every_layout(tiny_model, layout):
    sink = "gen" if layout == "inline" else "postprocess"
    check(layout_config(tiny_model, layout), sink, tiny_model, 1e-4)


@pytest.mark.parametrize("layout", ["split-window-1", "fused"])
def test_vllm_gives_the_prompts_logprobs_equal_to_the_models_forward(vllm_model, layout):
    """vLLM's prompt logprobs (``SamplingParams(prompt_logprobs=k)``), from its fused
    engine or its prefill, equal to transformers' forward within 1e-3."""
    engine_args = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20}
    cfg = layout_config(vllm_model, layout, engine="vllm", engine_args=engine_args)
    check(cfg, "postprocess", vllm_model, 1e-3)


@pytest.mark.parametrize("layout", ["split-window-1", "fused", "inline"])
def test_a_one_token_prompt_has_only_its_token_and_no_logprob(tiny_model, layout):
    """Nothing predicts a prompt's first token: a prompt of one has an empty list of
    logprobs from the engine, and still carries its one token, its logprob None."""
    sink = "gen" if layout == "inline" else "postprocess"
    with Pipeline(layout_config(tiny_model, layout)) as pipe:
        (out,) = pipe.generate([{**ASK, "prompt": "a"}])
    assert out.ok, out.error
    (got,) = [
        e.payload["prompt_logprobs"] for e in out.by_stage(sink) if "prompt_logprobs" in e.payload
    ]
    assert got == {
        "ids": [got["ids"][0]],
        "tokens": ["a"],
        "logprobs": [None],
        "ranks": [None],
        "top": [None],
        "top_ids": [None],
    }
