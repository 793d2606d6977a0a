"""``omni bench mm-handoff`` on the tiny Llava, on each engine: every key is there and
what does not depend on timing holds (decode gets well under 1% of the full-media
request's bytes, both arms give the same tokens, each level ran its requests, the seed
table has a row per shape and level with both arms' figures, the prefix-cache arm hit its
cache, and on vLLM the handoff's tokens equal ``LLM.generate`` given the images).
Figures are not asserted: shared machines are noisy. A small run: three shapes (the
large + small pair, one and four small images), two requests per level, three tokens.

The vLLM run needs vLLM's Llava, which imports torchvision: it runs in the ``vllm-mm``
environment (``hatch run vllm-mm:test``) and is skipped elsewhere.
"""

import os
from pathlib import Path

import pytest
from omni_bench.mm_handoff import LARGE, SMALL, parse_shapes, vllm_hit_rate

SHAPES = ["pair", "1S", "4S"]


@pytest.mark.timeout(960)  # the bench's own 900 s (a few minutes alone, more beside other work)
@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_mm_handoff_bench(bench_json, engine):
    from omni_ar.multimodal.testing import vllm_llava_missing

    if engine == "vllm" and (why := vllm_llava_missing()) is not None:
        if os.environ.get("OMNI_VLLM_MM"):
            pytest.fail(f"vLLM's Llava does not import here: {why}", pytrace=False)
        pytest.skip(f"vLLM's Llava does not import here ({why}): hatch run vllm-mm:test")
    args = ["--engine", engine, "--shapes", ",".join(SHAPES), "--concurrency", "1,2"]
    args += ["--requests", "2", "--max-tokens", "3", "--repeats", "3"]
    res = bench_json("mm-handoff", args, timeout_s=900)
    assert res["engine"] == engine
    assert res["images_per_request"] == ["4032x3024 JPEG", "640x480 JPEG"]
    for arm in ("handoff", "full_media"):
        assert [res[arm][c]["requests"] for c in ("c1", "c2")] == [2, 2]
        for level in res[arm].values():
            assert level["ttft_p50_ms"] <= level["ttft_p95_ms"] and level["output_tok_s"] > 0
            assert 0 < level["decode_ttft_p50_ms"] <= level["decode_ttft_p95_ms"]
    assert 0 < res["handoff_request_bytes"] < 0.01 * res["full_media_request_bytes"]
    assert res["kv_bytes"] > 0 and res["same_tokens_both_arms"]
    ratios = {f"ttft_p{q}_ratio_c{c}" for q in (50, 95) for c in (1, 2)}
    assert ratios <= set(res)
    prefix = res["prefix_cache"]
    assert prefix["repeats"] == 2
    side = "decode" if engine == "vllm" else "prefill"
    # a repeat hits every whole block but the last: 2 repeats of 3 sends, > 1/3 in all
    assert 1 / 3 < prefix["hit_rate"][side] < 2 / 3
    rows = res["seed_table"]
    assert [(r["shape"], r["concurrency"]) for r in rows] == [
        (s, c) for s in SHAPES for c in (1, 2)
    ]
    assert [(r["images_per_request"], r["image_size"]) for r in rows[::2]] == [
        (2, "mixed"),
        (1, "small"),
        (4, "small"),
    ]
    for r in rows:
        assert r["requests"] == 2 and r["prefix_cache_side"] == side
        for k in ("ttft_p50_ms", "ttft_p95_ms", "decode_ttft_p50_ms", "decode_ttft_p95_ms"):
            assert r[k]["ratio"] == pytest.approx(r[k]["handoff"] / r[k]["full_media"], abs=1e-3)
        sizes = r["decode_request_bytes"]
        assert 0 < sizes["handoff"] < sizes["full_media"]
        assert 0 < r["handoff_bytes_to_media"] < 0.05 and r["media_bytes"] > 0
        assert 0 < r["prefix_cache_hit_rate"] < 1
    assert set(res["seed_table_notes"]) >= {"decode_ttft_*", "prefix_cache_hit_rate"}
    targets = res["targets_met"]
    assert targets["handoff_request_bytes <= 0.01 x full_media"]
    assert targets["same tokens in both arms"]
    if engine == "vllm":
        assert res["equal_to_llm_generate"] is True


def test_shapes():
    """``--shapes``: the pair, N images of one size, each once in order; a bad one named."""
    shapes = parse_shapes("pair,4L,1S,4L")
    assert [(s.name, s.sizes, s.size_class) for s in shapes] == [
        ("pair", (LARGE, SMALL), "mixed"),
        ("4L", (LARGE,) * 4, "large"),
        ("1S", (SMALL,), "small"),
    ]
    for bad in ("9L", "0S", "2M", ""):
        with pytest.raises(ValueError):
            parse_shapes(bad)


def test_vllm_hit_rate(tmp_path: Path):
    """The local prefix cache's rate from vLLM's stats lines (template, arguments), the
    last line's; the external (connector) rate beside it is not taken."""
    log = tmp_path / "decode.log"
    assert vllm_hit_rate(log) is None
    line = (
        "Engine %03d: Avg prompt throughput: %.1f tokens/s, Running: %d reqs, "
        "%s KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
        "External prefix cache hit rate: %.1f%%\t{}\n"
    )
    log.write_text(
        "Engine %03d: Running: %d reqs\t(0, 1)\n"
        + line.format((0, 12.5, 1, "CPU", 3.0, 20.0, 90.0))
        + line.format((0, 12.5, 1, "CPU", 3.0, 37.5, 60.0))
    )
    assert vllm_hit_rate(log) == 0.375


@pytest.mark.timeout(960)  # the bench's own 900 s
@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_mm_handoff_bench_on_qwen2_5_vl(bench_json, engine):
    """``--model qwen2_5_vl`` (M-RoPE, a tiny Qwen2.5-VL built on the spot), one small
    run: both arms give the same tokens, and on vLLM they are ``LLM.generate``'s given the
    images (the oracle renders the prompt with Qwen's own image marker)."""
    if engine == "vllm":
        from omni_ar.multimodal.testing import vllm_llava_missing

        if (why := vllm_llava_missing()) is not None:
            if os.environ.get("OMNI_VLLM_MM"):
                pytest.fail(f"vLLM's multimodal models do not import here: {why}", pytrace=False)
            pytest.skip(f"vLLM's multimodal models do not import here ({why})")
    args = ["--engine", engine, "--model", "qwen2_5_vl", "--shapes", "2L", "--concurrency", "1"]
    args += ["--requests", "1", "--max-tokens", "4", "--repeats", "2"]
    res = bench_json("mm-handoff", args, timeout_s=900)
    assert res["model"] == "tiny random Qwen2.5-VL" and res["same_tokens_both_arms"]
    assert 0 < res["handoff_request_bytes"] < 0.01 * res["full_media_request_bytes"]
    if engine == "vllm":
        assert res["equal_to_llm_generate"] is True
