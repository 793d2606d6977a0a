"""``omni bench ar``: the staged AR pipeline next to one engine in one process.

Same model, same prompts, one run. ``direct``: the transformers engine in this process
(all cores), requests one after another, as ``generate`` would serve them. ``staged``:
intake -> prefill -> decode -> postprocess, each its own worker (one torch thread each),
requests submitted at once. ``inline_detok``: the same without the postprocess stage,
detokenizing inside the decode loop. Concurrency 1 gives time to first token (staged: to
the first text the caller receives); concurrency 8, generated tokens per second. Every
request generates exactly ``--max-tokens`` tokens (``ignore_eos``).

``--engine vllm``: omni's vLLM pipelines against vLLM's own ``AsyncLLM`` and the cost of
the prefill -> decode KV handoff (:mod:`omni_bench.ar_vllm`).

Windows between model stages: ``configs/ar_chain.yaml``, where a talker stage consumes
the decode stage's tokens in windows of 16 with 4 of overlap; the time from submit to the
talker's first output, on a ``--chain-tokens`` long first-stage output, with window 16 and
with -1 (the talker waits for the whole output).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from omni_core import Pipeline, load_config
from omni_core.config import WindowSpec

from omni_bench.prompts import PROMPTS
from omni_bench.report import emit

CHAIN_CONFIG = "configs/ar_chain.yaml"


def config(model: str, inline: bool) -> dict[str, Any]:
    common = {"model": model, "chat": True}
    worker = {**common, "threads": 1}
    env = {"OMP_NUM_THREADS": "1"}
    decode = {"name": "decode", "kind": "ar.decode", "extra_env": env}
    prefill = {"name": "prefill", "kind": "ar.prefill", "extra_env": env, "options": worker}
    decode["options"] = {**worker, "max_segment_tokens": 8, "inline_detokenize": inline}
    stages = [
        {"name": "intake", "kind": "ar.intake", "options": common},
        prefill,
        decode,
    ]
    edges = [{"from": "intake", "to": "prefill"}, {"from": "prefill", "to": "decode"}]
    if not inline:
        stages.append({"name": "postprocess", "kind": "ar.postprocess", "options": common})
        edges.append({"from": "decode", "to": "postprocess", "window": {"size": 1}})
    return {"name": "bench-ar", "ready_timeout_s": 600, "stages": stages, "edges": edges}


def request(i: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "ignore_eos": True}


def first_text_ms(pipe: Pipeline, req: dict[str, Any]) -> float:
    t0 = time.monotonic()
    ttft = None
    for ev in pipe.stream(req):
        if ttft is None and ev.event_type == "segment" and ev.payload.get("text"):
            ttft = time.monotonic() - t0
    return (ttft or float("nan")) * 1000


def staged_c8(pipe: Pipeline, max_tokens: int, sink: str = "postprocess") -> float:
    """Generated tokens per second of 8 requests submitted at once."""
    t0 = time.monotonic()
    outs = pipe.generate([request(i, max_tokens) for i in range(8)])
    elapsed = time.monotonic() - t0
    tokens = sum(len(e.tokens) for o in outs for e in o.by_stage(sink))
    if tokens != 8 * max_tokens or not all(o.ok for o in outs):
        raise RuntimeError(f"staged run produced {tokens} tokens, expected {8 * max_tokens}")
    return tokens / elapsed


def staged(model: str, max_tokens: int, inline: bool) -> tuple[float, float]:
    """(time to first text in ms at concurrency 1, tokens/s at concurrency 8)."""
    with Pipeline(config(model, inline)) as pipe:
        pipe.generate([request(0, 4)])  # warm up
        ttft = first_text_ms(pipe, request(0, max_tokens))
        tps = staged_c8(pipe, max_tokens, "decode" if inline else "postprocess")
    return ttft, tps


def first_downstream_ms(model: str, size: int, tokens: int) -> float:
    """Submit to the talker's first output, with the decode -> talker window ``size``."""
    cfg = load_config(CHAIN_CONFIG)
    for st in cfg.stages:
        st.options["model"] = model
    cfg.edges[-1].window = WindowSpec(size=size, overlap=4 if size > 0 else 0)
    with Pipeline(cfg) as pipe:
        pipe.generate([request(0, 4)])  # warm up
        t0 = time.monotonic()
        first = None
        for ev in pipe.stream(request(0, tokens)):
            if first is None and ev.stage == "talker" and getattr(ev, "tokens", None):
                first = time.monotonic() - t0
        if first is None:
            raise RuntimeError("the talker produced nothing")
    return first * 1000


def direct(model: str, max_tokens: int) -> tuple[float, float]:
    import torch
    from omni_ar.engines.transformers_engine import TransformersEngine
    from omni_ar.params import parse_request

    torch.set_num_threads(os.cpu_count() or 1)
    engine = TransformersEngine(model)
    engine.load_tokenizer()
    engine.load_model()

    def run(i: int, n: int) -> tuple[float, int]:
        r = request(i, n)
        _, params = parse_request(r, 4096)
        t0 = time.monotonic()
        ids = engine.encode([{"role": "user", "content": r["prompt"]}])
        first, _, keys, values = engine.prefill(ids, params)
        engine.tokenizer.decode([first])
        ttft = time.monotonic() - t0
        count = 1 + sum(1 for _ in engine.decode(first, keys, values, params))
        return ttft, count

    run(0, 4)  # warm up
    ttft, _ = run(0, max_tokens)
    t0 = time.monotonic()
    tokens = sum(run(i, max_tokens)[1] for i in range(8))
    return ttft * 1000, tokens / (time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench ar", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default="smollm2", help="a named model or a model directory")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chain-tokens", type=int, default=256, help="thinker output (0: skip)")
    ap.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    ap.add_argument(
        "--prompt-tokens",
        "--long-prompt-tokens",
        type=int,
        default=1024,
        help="vLLM: the KV handoff's prompt length (0: skip)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="vLLM: rounds over every arm")
    ap.add_argument("--c1-requests", type=int, default=2, help="vLLM: requests at concurrency 1")
    ap.add_argument("--kv-cache-mib", type=int, default=160, help="vLLM: each engine's KV cache")
    ap.add_argument(
        "--before-src",
        default=None,
        help="vLLM: also split with omni_ar imported from this directory (before/after)",
    )
    args = ap.parse_args(argv)
    from omni_ar.models import resolve_model

    model = resolve_model(args.model)
    if args.engine == "vllm":
        from omni_bench.ar_vllm import bench_vllm

        emit(bench_vllm(str(model), args), args.json)
        return 0
    direct_ttft, direct_tps = direct(model, args.max_tokens)
    staged_ttft, staged_tps = staged(model, args.max_tokens, inline=False)
    _, inline_tps = staged(model, args.max_tokens, inline=True)
    res: dict[str, Any] = {
        "engine": "transformers",
        "model": args.model,
        "max_tokens": args.max_tokens,
        "staged_tok_per_s_c8": round(staged_tps, 2),
        "direct_tok_per_s_c8": round(direct_tps, 2),
        "inline_detok_tok_per_s_c8": round(inline_tps, 2),
        "staged_ttft_ms_c1": round(staged_ttft, 1),
        "direct_ttft_ms_c1": round(direct_ttft, 1),
    }
    res["staged_vs_direct_c8"] = round(staged_tps / direct_tps, 3)
    res["targets_met"] = {"staged_tok_per_s_c8 >= 0.9 x direct": staged_tps >= 0.9 * direct_tps}
    if args.chain_tokens:
        w16 = first_downstream_ms(model, 16, args.chain_tokens)
        full = first_downstream_ms(model, -1, args.chain_tokens)
        res["chain_tokens"] = args.chain_tokens
        res["first_downstream_ms_window_16"] = round(w16, 1)
        res["first_downstream_ms_window_full"] = round(full, 1)
        res["targets_met"]["window 16 <= 0.1 x full"] = w16 <= 0.1 * full
    emit(res, args.json)
    return 0
