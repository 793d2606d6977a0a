"""The AR stages on the real vLLM engine (CPU), against ``LLM.generate`` in one process;
and the engine itself: the data-plane KV connector really carries the prompt (no silent
recompute), decode streams share engine steps, closing a stream frees its KV blocks.

Skipped when vLLM is not installed, except under CI (env ``CI`` set), where that fails.
"""

import json
import time
import warnings

import numpy as np
import pytest
from omni_ar.testing import kv_engine_pair, require_vllm

require_vllm()

import torch  # noqa: E402
from omni_ar.params import SamplingParams  # noqa: E402
from omni_ar.testing import run_oracle  # noqa: E402
from omni_core import Pipeline  # noqa: E402
from omni_core.client.collector import collect  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

# vLLM CPU attention needs head_dim >= 32; blocks of 32 tokens so that prompts span
# whole blocks and a partial last one; a small KV cache per engine
BLOCK = 32
ENGINE_ARGS = {"block_size": BLOCK, "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20}
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


pytestmark = pytest.mark.usefixtures("restore_environment")  # in-process engines below


def oracle(model, prompts):
    """``LLM.generate`` for all prompts at once, in a process of its own."""
    return run_oracle(ORACLE, model, json.dumps(ENGINE_ARGS), json.dumps(prompts))


@pytest.fixture(scope="module")
def reference(vllm_model):
    expected = oracle(vllm_model, PROMPTS)
    assert len({tuple(g) for g in expected}) == len(expected)
    assert all(len(set(g)) > 3 for g in expected)
    return AutoTokenizer.from_pretrained(vllm_model), expected


def vllm_config(model, enabled=True, post_window=-1, connector="shm", max_inflight=1, local=0):
    opts = {"model": model, "engine": "vllm", "kv_connector": connector}
    engine = {**opts, "engine_args": ENGINE_ARGS}
    prefill = {**engine, "local_prefill_max_tokens": local}
    return {
        "mrs": {"enabled": enabled},
        "ready_timeout_s": 300,
        "heartbeat_interval_s": 0.2,
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": opts},
            {
                "name": "prefill",
                "kind": "ar.prefill",
                "max_batch_size": max_inflight,  # prefills batched in one engine step
                "client_stream": True,  # its events reach the caller: which way each went
                "options": prefill,
            },
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
    "enabled,post_window,connector,max_inflight,local",
    [
        (True, -1, "shm", 4, 0),
        (True, 3, "file", 1, 0),
        (False, 1, "shm", 1, 0),
        (True, 1, "shm", 4, BLOCK),
    ],
    ids=[
        "procs-window-all-shm-batched",
        "procs-window-3-file",
        "inline-window-1-shm",
        "procs-short-prompts-prefilled-by-decode",
    ],
)
def test_staged_vllm_equals_llm_generate(
    vllm_model, reference, enabled, post_window, connector, max_inflight, local, tmp_path
):
    """``local``: ``local_prefill_max_tokens``, prompts up to it prefilled by decode's
    engine (in the same batch as the KV handed over for the longer ones)."""
    cfg = vllm_config(vllm_model, enabled, post_window, connector, max_inflight, local)
    for stage in cfg["stages"][1:3]:  # the file connector's files go with the test
        stage["extra_env"] = {"OMNI_VLLM_KV_DIR": str(tmp_path)}
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(PROMPTS)
        check(outs, reference)
        ways = {len(o.by_stage("prefill")[0].tokens) for o in outs if enabled}
        assert ways == ({0, 1} if local else {1} if enabled else set())
        if max_inflight > 1:  # cancel mid-decode, with others decoding in the same batch
            long = {"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True}
            h = pipe.submit(long)
            others = [pipe.submit(r) for r in PROMPTS[:2]]
            # postprocess's window is -1 here: the caller sees nothing before the end, so
            # wait for decode to be working on it (a heartbeat away), then cancel
            end = time.monotonic() + 60
            while pipe.metrics()["stages"]["decode"]["inflight"] < 1:
                assert time.monotonic() < end, "decode never took the request"
                time.sleep(0.02)
            assert pipe.cancel(h.request_id)
            assert [e.event_type for e in h if e.terminal] == ["cancelled"]
            check([collect(o) for o in others], (reference[0], reference[1][:2]))
            check(pipe.generate(PROMPTS[2:]), (reference[0], reference[1][2:]))


def test_a_prompt_vllm_refuses_fails_alone_in_its_prefill_batch(vllm_model, reference):
    """A prompt past vLLM's max_model_len (512) among three others, prefilled in one
    batch: vLLM refuses it as it enters, prefill finds it by trying one by one, and
    only it fails, with vLLM's reason."""
    too_long = {"prompt": " ".join(["a red fox in the snow"] * 60), "max_tokens": 4}
    batch = [PROMPTS[0], too_long, PROMPTS[1], PROMPTS[2]]
    with Pipeline(vllm_config(vllm_model, max_inflight=4)) as pipe:
        outs = pipe.generate(batch)
    assert not outs[1].ok and "vLLM refused the request" in outs[1].error, outs[1].error
    assert "maximum context length is 512" in outs[1].error
    check([outs[0], outs[2], outs[3]], (reference[0], reference[1][:3]))


def test_fused_vllm_generate_equals_llm_generate_and_cancels(vllm_model, reference):
    """ar.generate: one engine does prefill and decode, batching every request in flight."""
    opts = {"model": vllm_model, "engine": "vllm"}
    engine = {**opts, "engine_args": ENGINE_ARGS, "max_segment_tokens": 4}
    cfg = {
        "ready_timeout_s": 300,
        "heartbeat_interval_s": 0.2,
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": opts},
            {"name": "generate", "kind": "ar.generate", "max_inflight": 8, "options": engine},
            {"name": "postprocess", "kind": "ar.postprocess", "options": opts},
        ],
        "edges": [
            {"from": "intake", "to": "generate"},
            {"from": "generate", "to": "postprocess", "window": {"size": 1}},
        ],
    }
    with Pipeline(cfg) as pipe:
        check(pipe.generate(PROMPTS), reference)
        long = {"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True}
        h = pipe.submit(long)
        others = [pipe.submit(r) for r in PROMPTS[:2]]
        next(iter(h))  # it streams: cancel it mid-generation, the others go on
        assert pipe.cancel(h.request_id)
        check([collect(o) for o in others], (reference[0], reference[1][:2]))
        check(pipe.generate(PROMPTS[2:]), (reference[0], reference[1][2:]))


@pytest.fixture(scope="module")
def engines(vllm_model):
    """(prefill's engine, a KV producer that also runs whole requests; decode's)."""
    return kv_engine_pair(vllm_model, ENGINE_ARGS)


def prompt(n, salt):
    return [3 + (i * 7 + salt) % 300 for i in range(n)]


def kv_usage(engine):
    return engine.engine.engine_core.engine_core.scheduler.kv_cache_manager.usage


@pytest.mark.parametrize("n", [5, BLOCK * 2, BLOCK * 2 + 7], ids=str)
def test_prompt_kv_crosses_in_blocks_and_decode_uses_it(engines, n):
    prefill, decode = engines
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ids, other = prompt(n, 0), prompt(n, 1)
    expected = [t for t, _ in prefill.stream(ids, params)]
    first, _, keys, values = prefill.prefill(ids, params)
    # (layers, blocks, kv_heads, block tokens, head_dim): every block holding the prompt
    assert tuple(keys.shape) == (2, -(-n // BLOCK), 2, BLOCK, 32) == tuple(values.shape)
    # numpy, so that the data plane hands decode a view of its slot, not a copy
    assert isinstance(keys, np.ndarray) and isinstance(values, np.ndarray)
    keys.flags.writeable = values.flags.writeable = False  # as that view is
    with warnings.catch_warnings():
        # read where it is: no copy, so no "not writable" warning either
        warnings.filterwarnings("error", message=".*not writable")
        steps = decode.decode(first, keys, values, params, ids)
        assert [first, *(t for t, _ in steps)] == expected
    # a wrong KV gives other tokens: decode reads the KV it is handed, it does not recompute
    expected = [t for t, _ in prefill.stream(other, params)]
    first, _, keys, values = prefill.prefill(other, params)
    zeroed = list(decode.decode(first, keys * 0, values * 0, params, other))
    assert [first, *(t for t, _ in zeroed)] != expected


def test_streams_share_steps_and_closing_one_frees_its_kv(engines, monkeypatch):
    prefill, decode = engines
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    assert kv_usage(decode) == 0
    streams = []
    for salt in range(3):
        ids = prompt(40, 10 + salt)
        first, _, keys, values = prefill.prefill(ids, params)
        streams.append(decode.decode(first, keys, values, params, ids))
    # in the engine from the call on, before any step: they decode in the same steps
    assert decode.engine.get_num_unfinished_requests() == 3
    unread = decode.decode(first, keys, values, params, ids)
    assert decode.engine.get_num_unfinished_requests() == 4
    unread.close()  # closed before its first token (cancelled while queued): aborted too
    assert decode.engine.get_num_unfinished_requests() == 3
    steps = []
    real_step = decode.engine.step
    monkeypatch.setattr(decode.engine, "step", lambda: steps.append(1) or real_step())
    for _ in range(10):  # round-robin, as the decode worker drives its generators
        for s in streams:
            next(s)
    # one step per round serves all three (30 tokens), the first one included
    assert len(steps) <= 10 + 1
    assert decode.engine.get_num_unfinished_requests() == 3 and kv_usage(decode) > 0
    streams.pop().close()  # a cancel: the request is aborted in vLLM at once
    assert decode.engine.get_num_unfinished_requests() == 2
    for s in streams:
        next(s)
        s.close()
    assert decode.engine.get_num_unfinished_requests() == 0 and kv_usage(decode) == 0


def test_connector_views_both_paged_layouts_and_loads_in_the_cache_dtype_and_device():
    """The data-plane connector's two halves without an engine: ``kv_views`` of the CPU
    layout (per block and head, its keys then its values) and of the GPU one
    (``(2, blocks, block, heads, head_dim)``); received KV goes into a cache in that
    cache's dtype and on its device, whatever it came as."""
    from omni_ar.engines.kv_connector import _as, kv_views

    cpu = torch.zeros(3, 2, BLOCK, 2 * 32, dtype=torch.bfloat16)
    k, v = kv_views(cpu, BLOCK)
    assert tuple(k.shape) == tuple(v.shape) == (3, 2, BLOCK, 32)
    idx = torch.tensor([1])
    k[idx] = _as(np.ones((1, 2, BLOCK, 32), np.float32), cpu)  # numpy float32 in
    v[idx] = _as(torch.full((1, 2, BLOCK, 32), 2.0), cpu)  # a float32 tensor in
    flat = cpu.view(3, 2, -1)
    assert cpu.dtype == torch.bfloat16 and flat[[0, 2]].abs().sum() == 0
    assert (flat[1, :, : BLOCK * 32] == 1).all() and (flat[1, :, BLOCK * 32 :] == 2).all()
    gpu = torch.zeros(2, 4, BLOCK, 2, 32, dtype=torch.float16)
    k, v = kv_views(gpu, BLOCK)
    assert k.data_ptr() == gpu[0].data_ptr() and v.data_ptr() == gpu[1].data_ptr()
    moved = _as(torch.ones(2, BLOCK, 2, 32, dtype=torch.bfloat16), gpu)
    assert moved.dtype == gpu.dtype and moved.device == gpu.device
    with pytest.raises(RuntimeError, match="unknown paged KV layout"):
        kv_views(torch.zeros(4, BLOCK, 64), BLOCK)
