"""``omni bench mm-handoff``: the requires_kv handoff next to a decode that gets the media.

Same model, same stages, one run. ``handoff``: prefill drops the media and hands decode
token ids, item hashes, placeholder spans, block names and the KV. ``full_media``:
prefill forwards the request as it came, and decode decodes and hashes the images,
re-tokenizes the prompt and preprocesses the images again (on vLLM: vLLM's own
processor, given the images), as a decode without the contract must; the KV covers the
images in both arms, so neither decode runs a vision encoder. Prefix caching is off in
both.

``--shapes`` picks what a request carries, each shape measured in both arms: ``pair``
(a 4032x3024 and a 640x480 JPEG), or ``N`` images of one size, ``NL`` (4032x3024) or
``NS`` (640x480, the small-image control), N from 1 to 8. Every image is its own (a
rectangle in a colour of its own, encoded again, sent as a base64 data URL), so no
cache of processed media helps either arm.

At each ``--concurrency`` level ``c`` the requests go in waves of ``c`` submitted at once:
``ttft`` is submit to the first decoded token at the caller (p50, p95 over the level's
requests), ``decode_ttft`` the part decode accounts for: from prefill's handoff segment
to decode's first token segment, each stamped where it was made (``ev.ts``: transit,
admission, in ``full_media`` the media handling, and on transformers decode's first
step; on vLLM decode forwards prefill's first token as soon as it admits the request).
``output_tok_s`` is the tokens of a level over its wall time. ``*_request_bytes``: what
decode receives with the KV (the request, the handoff payload; msgpack as on the wire),
per request; the KV itself travels in shared memory, the same in both arms
(``kv_bytes``). ``prefix_cache``: the handoff pipeline with prefix caching on, each
shape's request sent ``--repeats`` times (the first cold): TTFT and the hit rate, on
vLLM the decode engine's own (vLLM's prefix-cache stats, read from its stats log), on
transformers prefill's (decode has no prefix cache there). ``seed_table``: one row per
shape and level, as the vLLM pull request's table has them. On ``--engine vllm``,
``equal_to_llm_generate``: the handoff's greedy tokens against vLLM's own
``LLM.generate`` given the images, in a process of its own.

``--model``: ``llava`` (a tiny random Llava built on the spot), ``qwen2_5_vl`` (a tiny
random Qwen2.5-VL built on the spot), or a model directory.
"""

from __future__ import annotations

import argparse
import ast
import base64
import io
import json
import re
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
from omni_core import Pipeline

from omni_bench.report import emit
from omni_bench.serve_load import percentile

LARGE = (4032, 3024)
SMALL = (640, 480)
SIZE_CODES = {"L": LARGE, "S": SMALL}
# vLLM on the CPU: blocks of 32 tokens (its attention needs a multiple of 32), a small KV
# cache per engine
VLLM_ARGS = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}
MODELS = {
    "llava": "tiny random Llava (CLIP 32px tower + 2-layer Llama)",
    "qwen2_5_vl": "tiny random Qwen2.5-VL",
}
# vLLM's stats logger (LoggingStatLogger) and the part of its line that holds the local
# prefix cache's hit rate
VLLM_STATS_LOGGER = "vllm.v1.metrics.loggers"
VLLM_HIT_RATE = "Prefix cache hit rate: "


class Shape(NamedTuple):
    """What each request of a seed-table row carries: its name and its images' sizes."""

    name: str
    sizes: tuple[tuple[int, int], ...]

    @property
    def size_class(self) -> str:
        kinds = set(self.sizes)
        return "large" if kinds == {LARGE} else "small" if kinds == {SMALL} else "mixed"

    @property
    def pixels(self) -> int:
        return sum(w * h for w, h in self.sizes)

    def describe(self) -> list[str]:
        return [f"{w}x{h} JPEG" for w, h in self.sizes]


def parse_shapes(spec: str) -> list[Shape]:
    """``pair,1L,4S``: the shapes, in order, each once; ValueError naming a bad one."""
    out: list[Shape] = []
    for name in dict.fromkeys(s for s in spec.split(",") if s):
        if name == "pair":
            out.append(Shape(name, (LARGE, SMALL)))
        elif m := re.fullmatch(r"([1-8])([LS])", name):
            out.append(Shape(name, (SIZE_CODES[m[2]],) * int(m[1])))
        else:
            raise ValueError(
                f"shape {name!r}: expected 'pair', or 1-8 images of one size as '4L' "
                f"({LARGE[0]}x{LARGE[1]}) or '1S' ({SMALL[0]}x{SMALL[1]})"
            )
    if not out:
        raise ValueError("no shape given")
    return out


def config(
    model: str,
    engine: str,
    full_media: bool,
    prefix_cache: bool = False,
    inflight: int = 8,
    max_pixels: int = 32_000_000,
    stats_dir: Path | None = None,
) -> dict[str, Any]:
    """The pipeline of one arm. ``stats_dir`` (vLLM): the engines log vLLM's stats there
    (:func:`vllm_stats_env`)."""
    opts: dict[str, Any] = {"model": model, "threads": 1}
    limits = {"max_total_pixels": max(max_pixels, 32_000_000)}
    prefill: dict[str, Any] = {"forward_media": full_media}
    engine_args: dict[str, Any] = {**VLLM_ARGS, "enable_prefix_caching": prefix_cache}
    if stats_dir is not None:
        engine_args["disable_log_stats"] = False
    if engine == "vllm":
        opts |= {"engine": "vllm", "engine_args": engine_args}
    else:
        prefill["prefix_cache_blocks"] = 4096 if prefix_cache else 0

    def env(stage: str) -> dict[str, str]:
        base = {"OMP_NUM_THREADS": "1"}
        return base if stats_dir is None else base | vllm_stats_env(stats_dir, stage)

    return {
        "name": "bench-mm-handoff",
        "ready_timeout_s": 600,
        "stages": [
            {"name": "intake", "kind": "ar.mm_intake", "options": {"model": model, **limits}},
            {
                "name": "prefill",
                "kind": "ar.mm_prefill",
                "extra_env": env("prefill"),
                "client_stream": True,  # the event decode receives, to count its bytes
                "options": {**opts, **prefill},
            },
            {
                "name": "decode",
                "kind": "ar.mm_decode",
                "extra_env": env("decode"),
                "max_inflight": inflight,
                "options": {
                    **opts,
                    **limits,
                    "max_segment_tokens": 1,
                    "media": "reprocess" if full_media else "none",
                },
            },
        ],
        "edges": [{"from": "intake", "to": "prefill"}, {"from": "prefill", "to": "decode"}],
    }


def vllm_stats_env(stats_dir: Path, stage: str) -> dict[str, str]:
    """A stage's environment that has its vLLM engine log its stats after every step
    with outputs into ``stats_dir/STAGE.log``, each line the message's template and its
    arguments (full precision), its other logs on stderr as usual."""
    stats_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"raw": {"format": "%(msg)s\t%(args)r"}},
        "handlers": {
            "stats": {
                "class": "logging.FileHandler",
                "filename": str(stats_dir / f"{stage}.log"),
                "formatter": "raw",
            },
            "stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr"},
        },
        "loggers": {
            "vllm": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
            VLLM_STATS_LOGGER: {"handlers": ["stats"], "level": "DEBUG", "propagate": False},
        },
    }
    path = stats_dir / f"{stage}.json"
    path.write_text(json.dumps(cfg))
    return {"VLLM_LOGGING_CONFIG_PATH": str(path), "VLLM_LOG_STATS_INTERVAL": "0.001"}


def vllm_hit_rate(log: Path) -> float | None:
    """The local prefix cache's hit rate in the last stats line of ``log`` (vLLM's, over
    its requests so far), a fraction; None where no line has one yet."""
    if not log.exists():
        return None
    rate = None
    for line in log.read_text().splitlines():
        template, _, args = line.partition("\t")
        at = template.find(VLLM_HIT_RATE)
        if at < 0:
            continue
        # the argument's index: the conversions before it in the template
        k = len(re.findall(r"%[-#0-9.]*[sdfr]", template[:at].replace("%%", "")))
        rate = float(ast.literal_eval(args)[k]) / 100
    return rate


def data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


class Media:
    """Images of their own: a base image per size with a rectangle in a colour of its
    own (by a running count), encoded again."""

    def __init__(self) -> None:
        from omni_ar.multimodal.testing import synthetic_image
        from PIL import Image

        self.bases = {
            size: np.asarray(
                Image.open(io.BytesIO(synthetic_image(k, *size, fmt="JPEG"))).convert("RGB")
            )
            for k, size in enumerate((LARGE, SMALL))
        }
        self.count = 0

    def take(self, sizes: tuple[tuple[int, int], ...]) -> tuple[list[str], int]:
        """Data URLs of new images of ``sizes``, and their JPEG bytes in all."""
        from PIL import Image

        urls, total = [], 0
        for size in sizes:
            i, self.count = self.count, self.count + 1
            px = self.bases[size].copy()
            h, w = px.shape[:2]
            top = h // 3 + i // 256  # past 256 colours, the rectangle moves
            px[top : h // 2, w // 3 : w // 2] = ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256)
            buf = io.BytesIO()
            Image.fromarray(px).save(buf, format="JPEG", quality=90)
            total += buf.tell()
            urls.append(data_url(buf.getvalue()))
        return urls, total


def request(i: int, urls: list[str], max_tokens: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": f"request {i}: compare "}]
    for u in urls:
        content += [{"type": "image", "image": u}, {"type": "text", "text": " and "}]
    content.append({"type": "text", "text": "the red fox"})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


class Workload(NamedTuple):
    """A shape's requests at each level, and each request's media bytes."""

    shape: Shape
    levels: dict[int, list[dict[str, Any]]]
    media_bytes: list[int]


def workload(shape: Shape, levels: list[int], n: int, max_tokens: int, media: Media) -> Workload:
    reqs: dict[int, list[dict[str, Any]]] = {}
    sizes: list[int] = []
    for c in levels:
        reqs[c] = []
        for _ in range(n):
            urls, nbytes = media.take(shape.sizes)
            reqs[c].append(request(len(sizes), urls, max_tokens))
            sizes.append(nbytes)
    return Workload(shape, reqs, sizes)


class _Timed(msgspec.Struct):
    ttft_ms: float
    decode_ttft_ms: float  # prefill's handoff segment -> decode's first token segment
    tokens: list[int]
    request_bytes: int
    kv_bytes: int
    prompt_tokens: int
    cached_tokens: int | None  # prompt tokens from prefill's prefix cache (transformers)


def timed(pipe: Pipeline, req: dict[str, Any]) -> _Timed:
    """One request: time to its first decoded token (at the caller, and from prefill's
    handoff), its tokens, what decode received."""
    t0 = time.monotonic()
    first: float | None = None
    handoff_ts = decode_ts = None
    tokens: list[int] = []
    size = kv = prompt = 0
    cached = None
    for ev in pipe.stream(req):
        if ev.event_type == "error":
            raise RuntimeError(ev.message)
        if ev.event_type != "segment":
            continue
        if ev.stage == "prefill":
            handoff_ts = ev.ts
            body = {"request": ev.request, "payload": ev.payload, "tokens": ev.tokens}
            size = len(msgspec.msgpack.encode(body))
            kv = sum(a.nbytes for a in ev.arrays.values())
            prompt = len(ev.payload["handoff"]["prompt_token_ids"])
            cached = ev.payload.get("cached_tokens")
        elif ev.stage == "decode" and ev.tokens:
            if first is None:
                first, decode_ts = time.monotonic() - t0, ev.ts
            tokens += ev.tokens
    if first is None or decode_ts is None or handoff_ts is None:
        raise RuntimeError("no handoff from prefill, or no token from decode")
    return _Timed(first * 1000, (decode_ts - handoff_ts) * 1000, tokens, size, kv, prompt, cached)


def _p(xs: list[float], q: float) -> float:
    return round(percentile(xs, q), 1)


def run_level(pipe: Pipeline, reqs: list[dict[str, Any]], c: int) -> tuple[dict[str, Any], list]:
    """The requests in waves of ``c`` at once: TTFT and decode TTFT p50/p95, output
    tok/s, the results."""
    results: list[_Timed] = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(c) as pool:  # each request streamed by a thread of its own
        for w in range(0, len(reqs), c):
            results += pool.map(lambda q: timed(pipe, q), reqs[w : w + c])
    wall = time.monotonic() - t0
    ttfts = [r.ttft_ms for r in results]
    decode = [r.decode_ttft_ms for r in results]
    level = {
        "requests": len(results),
        "ttft_p50_ms": _p(ttfts, 50),
        "ttft_p95_ms": _p(ttfts, 95),
        "decode_ttft_p50_ms": _p(decode, 50),
        "decode_ttft_p95_ms": _p(decode, 95),
        "output_tok_s": round(sum(len(r.tokens) for r in results) / wall, 1),
    }
    return level, results


def most_pixels(loads: list[Workload]) -> int:
    """The most pixels a request of ``loads`` carries (mm_intake's and mm_decode's
    ``max_total_pixels`` must allow it: four 12 MP images pass the default 32 MP)."""
    return max(w.shape.pixels for w in loads)


def run_arm(
    model: str, engine: str, full_media: bool, loads: list[Workload], warm: dict[str, Any]
) -> list[dict[str, Any]]:
    """One arm's pipeline over every shape: per shape, its levels (``c1``...), the
    largest request decode received, the KV's bytes, the tokens at the lowest level."""
    levels = list(loads[0].levels)
    cfg = config(model, engine, full_media, inflight=max(levels), max_pixels=most_pixels(loads))
    out: list[dict[str, Any]] = []
    with Pipeline(cfg) as pipe:
        timed(pipe, warm)  # warm up, with images of its own
        for load in loads:
            res: dict[str, Any] = {}
            sizes: list[int] = []
            for c, reqs in load.levels.items():
                res[f"c{c}"], results = run_level(pipe, reqs, c)
                sizes += [r.request_bytes for r in results]
                res["kv_bytes"] = results[0].kv_bytes
                if c == min(levels):
                    res["tokens"] = [r.tokens for r in results]
            out.append({**res, "request_bytes": max(sizes)})
    return out


def run_prefix_cache(
    model: str,
    engine: str,
    loads: list[Workload],
    media: Media,
    repeats: int,
    max_tokens: int,
    tmp: Path,
) -> list[dict[str, Any]]:
    """Per shape, one request of its own sent ``repeats`` times with prefix caching on:
    the cold TTFT, the p50 of the repeats, and the hit rate over the sends (decode's on
    vLLM, from its engine's stats; prefill's on transformers)."""
    stats = tmp / "vllm-stats" if engine == "vllm" else None
    cfg = config(model, engine, False, True, 1, most_pixels(loads), stats)
    out: list[dict[str, Any]] = []
    # queries (prompt tokens looked up) so far, and hits so far, per engine (vLLM)
    queries = {"prefill": 0, "decode": 0}
    hits = {"prefill": 0.0, "decode": 0.0}
    with Pipeline(cfg) as pipe:
        for load in [None, *loads]:  # first a warm-up: another prompt
            urls, _ = media.take(load.shape.sizes if load else (SMALL,))
            sent = [timed(pipe, request(-1 if load is None else 0, urls, max_tokens))]
            for _ in range(repeats - 1 if load else 0):
                sent.append(timed(pipe, request(0, urls, max_tokens)))
            queries["prefill"] += sum(r.prompt_tokens for r in sent)
            # decode's vLLM gets prompt + first token, unless prefill's ended it
            queries["decode"] += sum(r.prompt_tokens + 1 for r in sent if len(r.tokens) > 1)
            if load is None:
                if stats is not None:
                    hits = _vllm_hits(stats, queries)
                continue
            ttfts = [r.ttft_ms for r in sent]
            res: dict[str, Any] = {
                "cold_ttft_ms": round(ttfts[0], 1),
                "repeat_ttft_p50_ms": round(statistics.median(ttfts[1:]), 1),
                "repeats": repeats - 1,
            }
            prompt = sum(r.prompt_tokens for r in sent)
            if stats is None:
                cached = sum(r.cached_tokens or 0 for r in sent)
                res["hit_rate"] = {"decode": None, "prefill": round(cached / prompt, 4)}
            else:
                before, hits = hits, _vllm_hits(stats, queries)
                res["hit_rate"] = {
                    side: _rate(hits[side] - before[side], n)
                    for side, n in (
                        ("decode", sum(r.prompt_tokens + 1 for r in sent if len(r.tokens) > 1)),
                        ("prefill", prompt),
                    )
                }
            out.append(res)
    return out


def _vllm_hits(stats: Path, queries: dict[str, int]) -> dict[str, float]:
    """Each engine's prefix-cache hits so far: its hit rate so far (vLLM's stats log)
    times the tokens it looked up so far."""
    return {side: (vllm_hit_rate(stats / f"{side}.log") or 0.0) * n for side, n in queries.items()}


def _rate(hits: float, queries: int) -> float | None:
    return round(min(max(hits / queries, 0.0), 1.0), 4) if queries else None


def llm_generate(model: str, reqs: list[dict[str, Any]], tmp: Path) -> list[list[int]]:
    """vLLM's own ``LLM.generate`` of the requests given their images, in a process of
    its own."""
    from omni_ar.multimodal.engine import VLMEngine
    from omni_ar.multimodal.testing import chat_case, vllm_generate

    render = VLMEngine(model)  # its tokenizer and image marker, as ar.mm_intake's
    render.load_tokenizer()
    return vllm_generate(model, [chat_case(render, r) for r in reqs], VLLM_ARGS, tmp)


def build_model(name: str, tmp: str, engine: str) -> str:
    """``--model``'s directory: a tiny random model built into ``tmp``, or the path."""
    from omni_ar.multimodal import testing

    for_vllm = engine == "vllm"
    if name == "llava":
        return str(testing.build_tiny_llava(tmp, for_vllm=for_vllm))
    if name == "qwen2_5_vl":
        return str(testing.build_tiny_qwen2_vl(tmp, seed=0, version="2.5", for_vllm=for_vllm))
    return name


def _ratio(a: float, b: float, digits: int = 3) -> float | None:
    return round(a / b, digits) if b else None


def _pair(handoff: float, full: float, digits: int = 3) -> dict[str, Any]:
    return {"handoff": handoff, "full_media": full, "ratio": _ratio(handoff, full, digits)}


def seed_rows(
    engine: str,
    loads: list[Workload],
    handoff: list[dict[str, Any]],
    full: list[dict[str, Any]],
    prefix: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The vLLM pull request's table: one row per shape and level."""
    side = "decode" if engine == "vllm" else "prefill"
    rows = []
    for load, h, f, p in zip(loads, handoff, full, prefix, strict=True):
        media = statistics.mean(load.media_bytes)
        for c in load.levels:
            hc, fc = h[f"c{c}"], f[f"c{c}"]
            rows.append(
                {
                    "shape": load.shape.name,
                    "images_per_request": len(load.shape.sizes),
                    "image_size": load.shape.size_class,
                    "concurrency": c,
                    "requests": hc["requests"],
                    **{k: _pair(hc[k], fc[k]) for k in ("ttft_p50_ms", "ttft_p95_ms")},
                    **{
                        k: _pair(hc[k], fc[k]) for k in ("decode_ttft_p50_ms", "decode_ttft_p95_ms")
                    },
                    "decode_request_bytes": _pair(h["request_bytes"], f["request_bytes"], 5),
                    "media_bytes": round(media),
                    "handoff_bytes_to_media": _ratio(h["request_bytes"], media, 5),
                    "prefix_cache_hit_rate": p["hit_rate"][side],
                    "prefix_cache_side": side,
                }
            )
    return rows


SEED_TABLE_NOTES = {
    "ttft_*": "submit -> first decoded token at the caller, ms; ratio = handoff / full_media",
    "decode_ttft_*": "prefill's handoff segment -> decode's first token segment (ev.ts of "
    "each, stamped where made), ms: transit, admission, full_media's media handling, and "
    "on transformers decode's first step (on vLLM decode forwards prefill's first token "
    "once it admits the request)",
    "decode_request_bytes": "the largest request + handoff payload decode received (msgpack), "
    "the KV aside",
    "media_bytes": "the request's images as JPEG, mean over the row's requests",
    "prefix_cache_hit_rate": "prefix_cache arm (caching on; the shape's request sent "
    "--repeats times, the first cold): prompt tokens served from the cache / prompt tokens "
    "looked up; prefix_cache_side: on vLLM the decode engine's own local cache (vLLM's "
    "prefix-cache stats, from its stats log); on transformers decode has no prefix cache, "
    "so prefill's (mm_prefill's prefix_cache_blocks)",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench mm-handoff", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    ap.add_argument(
        "--model", default="llava", help="llava, qwen2_5_vl (tiny, random) or a model directory"
    )
    ap.add_argument(
        "--shapes",
        default="pair,1L,2L,4L,1S",
        help="comma-separated: pair (4032x3024 + 640x480), or NL / NS: N images of 4032x3024 "
        "/ 640x480 (the first shape fills the top-level keys)",
    )
    ap.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    ap.add_argument("--requests", type=int, default=8, help="requests per shape and level")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5, help="sends per shape, prefix-cache arm")
    args = ap.parse_args(argv)
    levels_c = sorted({int(c) for c in args.concurrency.split(",") if c})
    if not levels_c or levels_c[0] < 1 or args.requests < 1:
        ap.error("--concurrency needs levels >= 1 and --requests >= 1")
    if args.max_tokens < 2 or args.repeats < 2:
        ap.error("--max-tokens and --repeats must be >= 2")
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        ap.error(str(e))
    from omni_hf import quiet_offline

    quiet_offline()
    media = Media()
    loads = [workload(s, levels_c, args.requests, args.max_tokens, media) for s in shapes]
    warm = request(-1, media.take(shapes[0].sizes)[0], 2)
    with tempfile.TemporaryDirectory(prefix="omni-mm-bench-") as tmp:
        model = build_model(args.model, tmp, args.engine)
        handoff = run_arm(model, args.engine, False, loads, warm)
        full = run_arm(model, args.engine, True, loads, warm)
        prefix = run_prefix_cache(
            model, args.engine, loads, media, args.repeats, args.max_tokens, Path(tmp)
        )
        equal = None
        if args.engine == "vllm":
            expected = llm_generate(model, loads[0].levels[levels_c[0]], Path(tmp))
            equal = expected == handoff[0]["tokens"]
    h0, f0 = handoff[0], full[0]
    res: dict[str, Any] = {
        "engine": args.engine,
        "model": MODELS.get(args.model, args.model),
        "images_per_request": shapes[0].describe(),
        "max_tokens": args.max_tokens,
        "handoff": {f"c{c}": h0[f"c{c}"] for c in levels_c},
        "full_media": {f"c{c}": f0[f"c{c}"] for c in levels_c},
        "handoff_request_bytes": h0["request_bytes"],
        "full_media_request_bytes": f0["request_bytes"],
        "bytes_ratio": round(h0["request_bytes"] / f0["request_bytes"], 5),
        "kv_bytes": h0["kv_bytes"],
        "prefix_cache": prefix[0],
    }
    for c in levels_c:
        for q in (50, 95):
            ratio = h0[f"c{c}"][f"ttft_p{q}_ms"] / f0[f"c{c}"][f"ttft_p{q}_ms"]
            res[f"ttft_p{q}_ratio_c{c}"] = round(ratio, 3)
    res["same_tokens_both_arms"] = all(
        h["tokens"] == f["tokens"] for h, f in zip(handoff, full, strict=True)
    )
    res["seed_table"] = seed_rows(args.engine, loads, handoff, full, prefix)
    res["seed_table_notes"] = SEED_TABLE_NOTES
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
