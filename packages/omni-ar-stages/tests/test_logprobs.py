"""Logprobs through the AR stages (decode's, passed on by postprocess with each token's
text) and the finish reason the stages decide: ``length`` at max_tokens, ``stop`` at a
stop string."""

import pytest
import torch
from omni_core import Pipeline
from transformers import AutoModelForCausalLM, AutoTokenizer


def ar_config(model, post_window=1):
    opts = {"model": model, "threads": 1}
    names = ["intake", "prefill", "decode", "postprocess"]
    return {
        "heartbeat_interval_s": 0.1,
        "stages": [
            {
                "name": n,
                "kind": f"ar.{n}",
                "options": opts if n in ("prefill", "decode") else {"model": model},
            }
            for n in names
        ],
        "edges": [
            {"from": "intake", "to": "prefill"},
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "postprocess", "window": {"size": post_window}},
        ],
    }


REQUEST = {"prompt": "the quick brown fox", "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def expected(tiny_model):
    """(tokens, logprobs) of greedy decoding in this process."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    ids = tok(REQUEST["prompt"])["input_ids"]
    tokens, lps = [], []
    with torch.inference_mode():
        for _ in range(REQUEST["max_tokens"]):
            logits = model(torch.tensor([ids + tokens])).logits[0, -1]
            t = int(torch.argmax(logits))
            lps.append(float(torch.log_softmax(logits.float(), -1)[t]))
            tokens.append(t)
    return tok, tokens, lps


@pytest.mark.parametrize("post_window", [1, 4])
def test_postprocess_passes_logprobs_and_token_texts(tiny_model, expected, post_window):
    tok, tokens, lps = expected
    with Pipeline(ar_config(tiny_model, post_window=post_window)) as pipe:
        with_lp, without = pipe.generate([{**REQUEST, "logprobs": True}, REQUEST])
    assert with_lp.ok and without.ok, (with_lp.error, without.error)
    segs = with_lp.by_stage("postprocess")
    got_tokens = [t for e in segs for t in e.tokens]
    got_lps = [x for e in segs for x in e.logprobs]
    texts = [x for e in segs for x in e.payload.get("token_texts", [])]
    assert got_tokens == tokens
    assert got_lps == pytest.approx(lps, abs=1e-3)
    assert texts == [tok.decode([t]) for t in tokens]
    assert segs[-1].payload["finish_reason"] == "length"
    plain = without.by_stage("postprocess")
    assert all(e.logprobs is None and "token_texts" not in e.payload for e in plain)
    assert plain[-1].payload["finish_reason"] == "length"


def test_stop_string_and_default_max_tokens(tiny_model, expected):
    tok, tokens, _ = expected
    full = tok.decode(tokens, skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    with Pipeline(ar_config(tiny_model)) as pipe:
        cut, dflt = pipe.generate(
            [{**REQUEST, "stop": [stop]}, {"prompt": REQUEST["prompt"], "ignore_eos": True}]
        )
    assert cut.by_stage("postprocess")[-1].payload["finish_reason"] == "stop"
    segs = dflt.by_stage("postprocess")
    assert sum(len(e.tokens) for e in segs) == 16  # the stage's default_max_tokens
    assert segs[-1].payload["finish_reason"] == "length"
