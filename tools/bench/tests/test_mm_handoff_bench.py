"""``omni bench mm-handoff`` on the tiny Llava, on each engine: every key is there and
what does not depend on timing holds (decode gets well under 1% of the full-media
request's bytes, both arms give the same tokens, each level ran its requests, and on vLLM
the handoff's tokens equal ``LLM.generate`` given the images). Figures are not asserted:
shared machines are noisy.

The vLLM run needs vLLM's Llava, which imports torchvision: it runs in the ``vllm-mm``
environment (``hatch run vllm-mm:test``) and is skipped elsewhere.
"""

import os

import pytest


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_mm_handoff_bench(bench_json, engine):
    from omni_ar.multimodal.testing import vllm_llava_missing

    if engine == "vllm" and (why := vllm_llava_missing()) is not None:
        if os.environ.get("OMNI_VLLM_MM"):
            pytest.fail(f"vLLM's Llava does not import here: {why}", pytrace=False)
        pytest.skip(f"vLLM's Llava does not import here ({why}): hatch run vllm-mm:test")
    args = ["--engine", engine, "--concurrency", "1,2", "--requests", "2", "--max-tokens", "3"]
    res = bench_json("mm-handoff", args, timeout_s=900)
    assert res["engine"] == engine
    for arm in ("handoff", "full_media"):
        assert [res[arm][c]["requests"] for c in ("c1", "c2")] == [2, 2]
        for level in res[arm].values():
            assert level["ttft_p50_ms"] <= level["ttft_p95_ms"] and level["output_tok_s"] > 0
    assert 0 < res["handoff_request_bytes"] < 0.01 * res["full_media_request_bytes"]
    assert res["kv_bytes"] > 0 and res["same_tokens_both_arms"]
    assert {"ttft_p50_ratio_c1", "ttft_p50_ratio_c2"} <= set(res)
    assert res["prefix_cache"]["repeats"] == 4
    targets = res["targets_met"]
    assert targets["handoff_request_bytes <= 0.01 x full_media"]
    assert targets["same tokens in both arms"]
    if engine == "vllm":
        assert res["equal_to_llm_generate"] is True
