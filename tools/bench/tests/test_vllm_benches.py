"""The vLLM benches on a tiny model (the keys are there and every arm produced its
tokens; figures are not asserted: shared machines are noisy):

* ``omni bench serve``: vLLM's own OpenAI server, then ``omni serve``, each driven by the
  same streaming load at concurrency 1 and 2;
* ``omni bench ar --engine vllm``: vLLM's ``AsyncLLM`` in its own process against omni's
  fused and split pipelines, and the KV handoff's time to first text.

Skipped when vLLM is not installed, except under CI (env ``CI`` set), where that fails.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        pytest.fail("vLLM is not installed, and CI must run the vLLM tests", pytrace=False)
    pytest.skip("vLLM is not installed", allow_module_level=True)

OMNI = [sys.executable, "-c", "import sys; from omni_core.cli import main; sys.exit(main())"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from omni_ar.testing import build_tiny_llama

    # vLLM's CPU attention needs head_dim >= 32
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-64"), head_dim=64))


@pytest.mark.timeout(1200)  # four servers start, vLLM's default one compiling its model
def test_serve_keys(tiny_model):
    # the servers get this environment, less any VLLM_* of an in-process engine
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    args = ["--model", tiny_model, "--concurrency", "1,2", "--requests-per-level", "4"]
    args += ["--layouts", "fused,split_local"]  # split_local: decode prefills these prompts
    args += ["--eager"]  # omni's engines start in seconds (vLLM's own default compiles)
    out = subprocess.run(
        [*OMNI, "bench", "serve", *args, "--max-tokens", "12", "--ready-timeout", "480", "--json"],
        capture_output=True,
        text=True,
        timeout=1100,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # vllm_default: vLLM as its users start it; omni: the fused ar.generate layout
    for server in ("vllm_default", "vllm", "omni", "omni_split_local"):
        for level in ("c1", "c2"):
            m = r[server][level]
            assert m["tokens"] == 4 * 12, (server, level, m)  # ignore_eos: every token
            assert m["tok_per_s"] > 0 and m["ttft_p50_ms"] > 0, (server, level, m)
            assert m["ttft_p99_ms"] >= m["ttft_p50_ms"]
            assert m["itl_p50_ms"] >= 0
            cpu = m["cpu_ms_per_token"]  # where each server's CPU went, per process
            assert cpu["total"] > 0 and cpu["server"] > 0, (server, level, cpu)
    for stage in ("omni:intake", "omni:generate", "omni:postproces"):  # 15 bytes: Linux's cut
        assert stage in r["omni"]["c2"]["cpu_ms_per_token"], r["omni"]["c2"]
    assert "omni:prefill" in r["omni_split_local"]["c2"]["cpu_ms_per_token"]
    for key in (
        "omni_vs_vllm_tok_per_s_c1",
        "omni_vs_vllm_tok_per_s_c2",
        "omni_vs_vllm_ttft_p50_c1",
        "omni_vs_vllm_default_tok_per_s_c2",
        "split_local_vs_fused_tok_per_s_c1",
    ):
        assert r[key] > 0, key
    assert "split_local_tok_per_s_c2 >= 0.8 x fused" in r["targets"]
    assert "tok_per_s_c2 >= 1 x vllm_default (vLLM at its defaults)" in r["targets"]
    assert r["vllm_dtype"] in ("bfloat16", "float32")
    assert isinstance(r["targets_met"], bool)


@pytest.mark.timeout(900)  # ten engines start (vLLM's and omni's four layouts)
def test_ar_vllm_keys(tiny_model):
    model = tiny_model
    # the bench's processes get this environment, less any VLLM_* of an in-process engine
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    args = ["--model", model, "--max-tokens", "6", "--rounds", "1", "--c1-requests", "1"]
    args += ["--kv-cache-mib", "64"]  # eight engines at once: small caches
    out = subprocess.run(
        [*OMNI, "bench", "ar", "--engine", "vllm", *args, "--prompt-tokens", "200", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for arm in ("vllm", "fused", "split", "split_turns"):
        for key in ("tok_per_s_c1", "tok_per_s_c8", "ttft_ms_c1", "ttft_ms_c8"):
            m = r[arm][key]
            assert len(m["runs"]) == 1 and m["best"] > 0 and m["median"] > 0, (arm, key, m)
    for label in ("omni", "split", "split_turns"):
        for key in ("tok_per_s_c1", "tok_per_s_c8", "ttft_c1", "ttft_c8"):
            assert r[f"{label}_vs_vllm_{key}"] > 0, (label, key)
    kv = r["kv_handoff"]
    assert 150 <= kv["prompt_tokens"] <= 200, kv
    assert set(kv["ttft_ms"]) == {"split", "split_file", "fused_1t", "fused", "vllm"}
    for key in ("split_over_fused_1t", "split_file_over_fused_1t", "split_over_vllm"):
        assert kv[f"ttft_{key}"] > 0, key
    assert "direct" not in r and "staged_tok_per_s_c8" not in r  # the in-house arm is gone
    assert all(isinstance(v, bool) for v in r["targets_met"].values())
