"""``omni bench prefill-burst`` run small on the tiny Llama: both arms, their keys and
their sanity (figures are not asserted: shared machines are noisy)."""

import pytest


def test_prefill_burst_keys(tmp_path, bench_json):
    pytest.importorskip("transformers")
    from omni_ar.testing import build_tiny_llama

    model = str(build_tiny_llama(tmp_path / "tiny"))
    r = bench_json("prefill-burst", ["--model", model, "--rounds", "1"], timeout_s=300)
    assert isinstance(r["cpu_model"], str) and r["prompts"] == 8
    engine = r["engine"]
    assert engine["forwards_per_burst"] == 1 and engine["first_tokens_equal"]
    assert engine["kv_max_abs_diff"] < 1e-4
    assert len(engine["prompt_tokens"]) == 8 and len(set(engine["prompt_tokens"])) > 1
    for arm in ("engine", "pipeline"):
        res = r[arm]
        assert res["batched"]["median_ms"] > 0 and res["one_by_one"]["median_ms"] > 0
        assert res["last_first_token_ratio"] > 0
        assert isinstance(
            r["targets_met"][f"{arm}: last first token batched <= 0.5 x one by one"], bool
        )
