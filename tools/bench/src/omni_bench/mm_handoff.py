"""``omni bench mm-handoff``: the requires_kv handoff next to a decode that gets the media.

Same model, same stages, one run; every request brings two images of its own (a
4032x3024 JPEG and a 640x480 one, as base64 data URLs), so no cache of processed media
helps either arm. ``handoff``: prefill drops the media and hands decode token ids, item
hashes, placeholder spans, block names and the KV. ``full_media``: prefill forwards the
request as it came, and decode decodes and hashes the images, re-tokenizes the prompt
and preprocesses the images again (on vLLM: vLLM's own processor, given the images), as
a decode without the contract must; the KV covers the images in both arms, so neither
decode runs a vision encoder. Prefix caching is off in both.

At each ``--concurrency`` level ``c`` the requests go in waves of ``c`` submitted at once:
``ttft`` is submit to the first decoded token at the caller (p50, p95 over the level's
requests), ``output_tok_s`` the tokens of a level over its wall time. ``*_request_bytes``:
what decode receives with the KV (the request, the handoff payload; msgpack as on the
wire), per request; the KV itself travels in shared memory, the same in both arms
(``kv_bytes``). ``prefix_cache``: the handoff pipeline with prefix caching on, one image
and prompt sent again and again (the first cold, the rest served from the caches).
On ``--engine vllm``, ``equal_to_llm_generate``: the handoff's greedy tokens against
vLLM's own ``LLM.generate`` given the images, in a process of its own.

The default model is a tiny random Llava built on the spot (``--model`` takes a
Llava-style model directory instead).
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from omni_core import Pipeline

from omni_bench.report import emit
from omni_bench.serve import percentile

LARGE = (4032, 3024)
SMALL = (640, 480)
# vLLM on the CPU: blocks of 32 tokens (its attention needs a multiple of 32), a small KV
# cache per engine
VLLM_ARGS = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}


def config(
    model: str, engine: str, full_media: bool, prefix_cache: bool = False, inflight: int = 8
) -> dict[str, Any]:
    opts: dict[str, Any] = {"model": model, "threads": 1}
    prefill: dict[str, Any] = {"forward_media": full_media}
    if engine == "vllm":
        opts |= {
            "engine": "vllm",
            "engine_args": {**VLLM_ARGS, "enable_prefix_caching": prefix_cache},
        }
    else:
        prefill["prefix_cache_blocks"] = 4096 if prefix_cache else 0
    env = {"OMP_NUM_THREADS": "1"}
    return {
        "name": "bench-mm-handoff",
        "ready_timeout_s": 600,
        "stages": [
            {"name": "intake", "kind": "ar.mm_intake", "options": {"model": model}},
            {
                "name": "prefill",
                "kind": "ar.mm_prefill",
                "extra_env": env,
                "client_stream": True,  # the event decode receives, to count its bytes
                "options": {**opts, **prefill},
            },
            {
                "name": "decode",
                "kind": "ar.mm_decode",
                "extra_env": env,
                "max_inflight": inflight,
                "options": {
                    **opts,
                    "max_segment_tokens": 1,
                    "media": "reprocess" if full_media else "none",
                },
            },
        ],
        "edges": [{"from": "intake", "to": "prefill"}, {"from": "prefill", "to": "decode"}],
    }


def data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def variants(n: int) -> list[list[str]]:
    """``n`` pairs of images (large, small) as data URLs, each pair its own: a base image
    with a rectangle in a colour of its own, encoded again."""
    from omni_ar.multimodal.testing import synthetic_image
    from PIL import Image

    bases = [
        np.asarray(Image.open(io.BytesIO(synthetic_image(i, *size, fmt="JPEG"))).convert("RGB"))
        for i, size in enumerate((LARGE, SMALL))
    ]
    out = []
    for i in range(n):
        pair = []
        for base in bases:
            px = base.copy()
            h, w = px.shape[:2]
            px[h // 3 : h // 2, w // 3 : w // 2] = ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256)
            buf = io.BytesIO()
            Image.fromarray(px).save(buf, format="JPEG", quality=90)
            pair.append(data_url(buf.getvalue()))
        out.append(pair)
    return out


def request(i: int, urls: list[str], max_tokens: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": f"request {i}: compare "}]
    for u in urls:
        content += [{"type": "image", "image": u}, {"type": "text", "text": " and "}]
    content.append({"type": "text", "text": "the red fox"})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


class _Timed(msgspec.Struct):
    ttft_ms: float
    tokens: list[int]
    request_bytes: int
    kv_bytes: int


def timed(pipe: Pipeline, req: dict[str, Any]) -> _Timed:
    """One request: time to its first decoded token, its tokens, what decode received."""
    t0 = time.monotonic()
    first: float | None = None
    tokens: list[int] = []
    size = kv = 0
    for ev in pipe.stream(req):
        if ev.event_type == "error":
            raise RuntimeError(ev.message)
        if ev.event_type != "segment":
            continue
        if ev.stage == "prefill":
            body = {"request": ev.request, "payload": ev.payload, "tokens": ev.tokens}
            size = len(msgspec.msgpack.encode(body))
            kv = sum(a.nbytes for a in ev.arrays.values())
        elif ev.stage == "decode" and ev.tokens:
            if first is None:
                first = time.monotonic() - t0
            tokens += ev.tokens
    if first is None:
        raise RuntimeError("decode produced no token")
    return _Timed(first * 1000, tokens, size, kv)


def run_level(pipe: Pipeline, reqs: list[dict[str, Any]], c: int) -> tuple[dict[str, Any], list]:
    """The requests in waves of ``c`` at once: TTFT p50/p95, output tok/s, the results."""
    results: list[_Timed] = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(c) as pool:  # each request streamed by a thread of its own
        for w in range(0, len(reqs), c):
            results += pool.map(lambda q: timed(pipe, q), reqs[w : w + c])
    wall = time.monotonic() - t0
    ttfts = [r.ttft_ms for r in results]
    level = {
        "requests": len(results),
        "ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "ttft_p95_ms": round(percentile(ttfts, 95), 1),
        "output_tok_s": round(sum(len(r.tokens) for r in results) / wall, 1),
    }
    return level, results


def run_arm(
    model: str,
    engine: str,
    full_media: bool,
    levels: dict[int, list[dict[str, Any]]],
    warm: dict[str, Any],
) -> dict[str, Any]:
    with Pipeline(config(model, engine, full_media, inflight=max(levels))) as pipe:
        timed(pipe, warm)  # warm up, with images of its own
        out: dict[str, Any] = {}
        tokens: list[list[int]] = []
        sizes: list[int] = []
        kv = 0
        for c, reqs in levels.items():
            out[f"c{c}"], results = run_level(pipe, reqs, c)
            sizes += [r.request_bytes for r in results]
            kv = results[0].kv_bytes
            if c == min(levels):
                tokens = [r.tokens for r in results]
    return {**out, "request_bytes": max(sizes), "kv_bytes": kv, "tokens": tokens}


def run_prefix_cache(model: str, engine: str, urls: list[str], n: int, max_tokens: int) -> dict:
    """One image and prompt ``n`` times with prefix caching on: the cold TTFT and the p50
    of the repeats."""
    with Pipeline(config(model, engine, False, prefix_cache=True, inflight=1)) as pipe:
        timed(pipe, request(-1, urls[:1], 2))  # warm up: another prompt
        ttfts = [timed(pipe, request(0, urls, max_tokens)).ttft_ms for _ in range(n)]
    return {
        "cold_ttft_ms": round(ttfts[0], 1),
        "repeat_ttft_p50_ms": round(statistics.median(ttfts[1:]), 1),
        "repeats": n - 1,
    }


def llm_generate(model: str, reqs: list[dict[str, Any]], tmp: Path) -> list[list[int]]:
    """vLLM's own ``LLM.generate`` of the requests given their images, in a process of
    its own."""
    from omni_ar.multimodal.testing import chat_case, vllm_generate
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model)
    return vllm_generate(model, [chat_case(proc, r) for r in reqs], VLLM_ARGS, tmp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench mm-handoff", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    ap.add_argument("--model", default=None, help="a Llava-style model directory")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    ap.add_argument("--requests", type=int, default=8, help="requests at each level")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    levels_c = sorted({int(c) for c in args.concurrency.split(",") if c})
    if not levels_c or levels_c[0] < 1 or args.requests < 1:
        ap.error("--concurrency needs levels >= 1 and --requests >= 1")
    from omni_ar.multimodal.testing import build_tiny_llava
    from omni_hf import quiet_offline

    quiet_offline()
    n = args.requests * len(levels_c)
    pairs = variants(n + 2)  # the levels', the prefix-cache arm's, the warm-up's
    warm = request(-1, pairs[n + 1], 2)
    levels: dict[int, list[dict[str, Any]]] = {}
    for k, c in enumerate(levels_c):
        at = k * args.requests
        levels[c] = [request(at + i, pairs[at + i], args.max_tokens) for i in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="omni-mm-bench-") as tmp:
        model = args.model or str(build_tiny_llava(tmp, for_vllm=args.engine == "vllm"))
        handoff = run_arm(model, args.engine, False, levels, warm)
        full = run_arm(model, args.engine, True, levels, warm)
        prefix = run_prefix_cache(model, args.engine, pairs[n], 5, args.max_tokens)
        equal = None
        if args.engine == "vllm":
            expected = llm_generate(model, levels[levels_c[0]], Path(tmp))
            equal = expected == handoff["tokens"]
    res: dict[str, Any] = {
        "engine": args.engine,
        "model": args.model or "tiny random Llava (CLIP 32px tower + 2-layer Llama)",
        "images_per_request": [f"{w}x{h} JPEG" for w, h in (LARGE, SMALL)],
        "max_tokens": args.max_tokens,
        "handoff": {f"c{c}": handoff[f"c{c}"] for c in levels_c},
        "full_media": {f"c{c}": full[f"c{c}"] for c in levels_c},
        "handoff_request_bytes": handoff["request_bytes"],
        "full_media_request_bytes": full["request_bytes"],
        "bytes_ratio": round(handoff["request_bytes"] / full["request_bytes"], 5),
        "kv_bytes": handoff["kv_bytes"],
        "prefix_cache": prefix,
    }
    for c in levels_c:
        ratio = handoff[f"c{c}"]["ttft_p50_ms"] / full[f"c{c}"]["ttft_p50_ms"]
        res[f"ttft_p50_ratio_c{c}"] = round(ratio, 3)
    res["same_tokens_both_arms"] = handoff["tokens"] == full["tokens"]
    targets = {
        "handoff_request_bytes <= 0.01 x full_media": res["bytes_ratio"] <= 0.01,
        **{f"ttft_p50_ratio_c{c} <= 0.8": res[f"ttft_p50_ratio_c{c}"] <= 0.8 for c in levels_c},
        "same tokens in both arms": res["same_tokens_both_arms"],
    }
    if equal is not None:
        res["equal_to_llm_generate"] = equal
        targets["equal to LLM.generate given the images"] = equal
    res["targets_met"] = targets
    emit(res, args.json)
    return 0
