"""The AR stages on the real vLLM engine (CPU), against ``LLM.generate`` in one process.

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
    pytest.skip(
        "vLLM is not installed (pip install 'omni-ar-stages[vllm]')", allow_module_level=True
    )

from omni_ar.engines.vllm_engine import set_vllm_env  # noqa: E402
from omni_core import Pipeline  # noqa: E402
from omni_core.collector import collect  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

set_vllm_env()  # for the in-process runs (mrs.enabled: false)

# vLLM CPU attention needs head_dim >= 32; blocks of 32 tokens so that prompts span
# whole blocks and a partial last one; a small KV cache per engine
ENGINE_ARGS = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20}
PROMPTS = [
    {"prompt": "the quick brown fox", "max_tokens": 24},
    {"prompt": " ".join(["a red fox in the snow, under a pale winter sky"] * 4), "max_tokens": 17},
    {"prompt": " ".join(["héllo wörld, ünïcode ✓ 猫 and emoji 🦊 too"] * 5), "max_tokens": 30},
    {"messages": [{"role": "user", "content": "stream tokens"}], "max_tokens": 20},
]

ORACLE = """
import json, sys
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
model, args, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
tok = AutoTokenizer.from_pretrained(model)
inputs = [
    r["prompt"] if "prompt" in r
    else {"prompt_token_ids": list(tok.apply_chat_template(
        r["messages"], add_generation_prompt=True, tokenize=True)["input_ids"])}
    for r in prompts
]
params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0) for r in prompts]
llm = LLM(model=model, enforce_eager=True, dtype="float32", **args)
outs = llm.generate(inputs, params, use_tqdm=False)
print("ORACLE" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory):
    from omni_ar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-32"), head_dim=32))


def oracle(model, prompts):
    """``LLM.generate`` for all prompts at once, in a process of its own."""
    out = subprocess.run(
        [sys.executable, "-c", ORACLE, model, json.dumps(ENGINE_ARGS), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("ORACLE")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("ORACLE"))


@pytest.fixture(scope="module")
def reference(vllm_model):
    expected = oracle(vllm_model, PROMPTS)
    assert len({tuple(g) for g in expected}) == len(expected)
    assert all(len(set(g)) > 3 for g in expected)
    return AutoTokenizer.from_pretrained(vllm_model), expected


def vllm_config(model, enabled=True, post_window=-1, connector="shm", max_inflight=1):
    opts = {"model": model, "engine": "vllm", "kv_connector": connector}
    engine = {**opts, "engine_args": ENGINE_ARGS}
    return {
        "mrs": {"enabled": enabled},
        "ready_timeout_s": 300,
        "heartbeat_interval_s": 0.2,
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": opts},
            {"name": "prefill", "kind": "ar.prefill", "options": engine},
            {
                "name": "decode",
                "kind": "ar.decode",
                "max_inflight": max_inflight,
                "options": {**engine, "max_segment_tokens": 4},
            },
            {"name": "postprocess", "kind": "ar.postprocess", "options": opts},
        ],
        "edges": [
            {"from": "intake", "to": "prefill"},
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "postprocess", "window": {"size": post_window}},
        ],
    }


def text_and_tokens(out):
    segs = out.by_stage("postprocess")
    return "".join(e.payload["text"] for e in segs), [t for e in segs for t in e.tokens]


def check(outs, reference):
    tok, expected = reference
    for out, exp in zip(outs, expected, strict=True):
        assert out.ok, out.error
        text, tokens = text_and_tokens(out)
        assert tokens == exp
        assert text == tok.decode(exp, skip_special_tokens=True)


@pytest.mark.parametrize(
    "enabled,post_window,connector,max_inflight",
    [(True, -1, "shm", 4), (True, 3, "file", 1), (False, 1, "shm", 1)],
    ids=["procs-window-all-shm-batched", "procs-window-3-file", "inline-window-1-shm"],
)
def test_staged_vllm_equals_llm_generate(
    vllm_model, reference, enabled, post_window, connector, max_inflight
):
    cfg = vllm_config(vllm_model, enabled, post_window, connector, max_inflight)
    with Pipeline(cfg) as pipe:
        check(pipe.generate(PROMPTS), reference)
        if max_inflight > 1:  # cancel mid-decode, with others decoding in the same batch
            long = {"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True}
            h = pipe.submit(long)
            others = [pipe.submit(r) for r in PROMPTS[:2]]
            assert next(iter(h)).event_type == "segment"
            assert pipe.cancel(h.request_id)
            assert [e.event_type for e in h if e.terminal] == ["cancelled"]
            check([collect(o) for o in others], (reference[0], reference[1][:2]))
            check(pipe.generate(PROMPTS[2:]), (reference[0], reference[1][2:]))
