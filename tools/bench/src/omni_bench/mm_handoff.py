"""``omni bench mm-handoff``: the requires_kv handoff next to a decode that gets the media.

Same model, same images (a 4032x3024 JPEG and a 640x480 one per request, as base64 data
URLs), same stages, one run. ``handoff``: prefill drops the media and hands decode token
ids, item hashes, placeholder spans and the KV. ``full_media``: prefill forwards the
request as it came, and decode decodes, hashes and preprocesses the images and
re-tokenizes the prompt, as a decode without the contract must; the KV covers the images
in both arms, so neither decode runs a vision encoder.

``*_request_bytes``: what decode receives with the KV (the request, the handoff payload;
msgpack-encoded as on the wire), per request; the KV itself travels in shared memory,
the same in both arms (``kv_bytes``). ``*_ttft_ms``: submit to the first decoded token
at the caller, median over ``--requests`` requests one after another (prefill's prefix
cache off, so each request runs the whole path). The default model is a tiny random
Llava built on the spot (``--model`` takes a Llava-style model directory instead).
"""

from __future__ import annotations

import argparse
import base64
import statistics
import tempfile
import time
from typing import Any

import msgspec
from omni_core import Pipeline

from omni_bench.report import emit

LARGE = (4032, 3024)
SMALL = (640, 480)


def config(model: str, full_media: bool) -> dict[str, Any]:
    opts = {"model": model, "threads": 1}
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
                "options": {**opts, "prefix_cache_blocks": 0, "forward_media": full_media},
            },
            {
                "name": "decode",
                "kind": "ar.mm_decode",
                "extra_env": env,
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


def request(i: int, urls: list[str]) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": f"request {i}: compare "}]
    for u in urls:
        content += [{"type": "image", "image": u}, {"type": "text", "text": " and "}]
    content.append({"type": "text", "text": "the red fox"})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


def run_arm(model: str, full_media: bool, urls: list[str], n: int) -> dict[str, Any]:
    """Median time to first token (ms), decode-side request bytes and KV bytes of an arm."""
    with Pipeline(config(model, full_media)) as pipe:
        pipe.generate([request(-1, urls)])  # warm up
        ttfts, sizes, kv = [], [], 0
        for i in range(n):
            t0 = time.monotonic()
            first = None
            for ev in pipe.stream(request(i, urls)):
                if ev.event_type == "error":
                    raise RuntimeError(ev.message)
                if ev.stage == "prefill":
                    body = {"request": ev.request, "payload": ev.payload, "tokens": ev.tokens}
                    sizes.append(len(msgspec.msgpack.encode(body)))
                    kv = sum(a.nbytes for a in ev.arrays.values())
                elif first is None and ev.stage == "decode" and ev.tokens:
                    first = time.monotonic() - t0
            if first is None:
                raise RuntimeError("decode produced no token")
            ttfts.append(first * 1000)
    return {"ttft_ms": statistics.median(ttfts), "bytes": max(sizes), "kv_bytes": kv}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench mm-handoff", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="a Llava-style model directory")
    ap.add_argument("--requests", type=int, default=5)
    args = ap.parse_args(argv)
    from omni_ar.multimodal.testing import build_tiny_llava, synthetic_image
    from omni_hf import quiet_offline

    quiet_offline()

    urls = [
        data_url(synthetic_image(i, *size, fmt="JPEG")) for i, size in enumerate((LARGE, SMALL))
    ]
    with tempfile.TemporaryDirectory(prefix="omni-mm-bench-") as tmp:
        model = args.model or str(build_tiny_llava(tmp))
        handoff = run_arm(model, False, urls, args.requests)
        full = run_arm(model, True, urls, args.requests)
    res: dict[str, Any] = {
        "engine": "transformers",
        "model": args.model or "tiny random Llava (CLIP 32px tower + 2-layer Llama)",
        "images_per_request": [f"{w}x{h} JPEG" for w, h in (LARGE, SMALL)],
        "requests": args.requests,
        "handoff_request_bytes": handoff["bytes"],
        "full_media_request_bytes": full["bytes"],
        "bytes_ratio": round(handoff["bytes"] / full["bytes"], 5),
        "kv_bytes": handoff["kv_bytes"],
        "handoff_ttft_ms": round(handoff["ttft_ms"], 1),
        "full_media_ttft_ms": round(full["ttft_ms"], 1),
    }
    res["targets_met"] = {
        "handoff_request_bytes <= 0.01 x full_media": handoff["bytes"] <= 0.01 * full["bytes"],
        "handoff_ttft_ms < full_media_ttft_ms": handoff["ttft_ms"] < full["ttft_ms"],
    }
    emit(res, args.json)
    return 0
