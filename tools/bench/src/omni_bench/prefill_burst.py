"""``omni bench prefill-burst``: 8 prompts that arrive together, prefilled in one forward
(the transformers engine's batched prefill) against one after another.

The figure is the time to the last prompt's first token (issue 49: batched <= 0.5x one by
one). ``engine``: one engine in this process, the burst through ``prefill_many`` (one
padded forward) and through ``prefill`` per prompt, alternating, ``--rounds`` times; the
outputs of the two are checked equal (first tokens; KV within float rounding).
``pipeline``: intake -> ``ar.prefill`` (``max_batch_size: 8``) -> decode in worker
processes, ``batch_prefill`` true and false, both up at once, the burst submitted to
each in turn: submit to the last first token the caller receives (the worker hands
prefill what is queued when it is free, so the first prompt may go alone). The prompts
are the AR benches' 8 chat prompts through SmolLM2's chat template (``--no-chat``: the
bare text; ``--repeat``: each text that many times, for longer prompts).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from omni_core import Pipeline
from omni_core.client.collector import collect

from omni_bench.prompts import PROMPTS
from omni_bench.report import cpu_model, emit, run_arms


def texts(n: int, repeat: int) -> list[str]:
    return [" ".join([PROMPTS[i % len(PROMPTS)]] * repeat) for i in range(n)]


def summary(times: list[float]) -> dict[str, float]:
    """Median and best, in ms."""
    return {
        "median_ms": round(statistics.median(times) * 1000, 1),
        "best_ms": round(min(times) * 1000, 1),
    }


def engine_arm(model: str, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    from omni_ar.engines.transformers_engine import TransformersEngine
    from omni_ar.params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = TransformersEngine(model)
    engine.load_tokenizer()
    engine.load_model()
    prompts = [
        engine.encode([{"role": "user", "content": t}] if args.chat else t)
        for t in texts(args.prompts, args.repeat)
    ]
    params = [SamplingParams(max_tokens=1)] * len(prompts)

    def batched() -> list[Any]:
        return list(engine.prefill_many(prompts, params))

    def one_by_one() -> list[Any]:
        return [engine.prefill(ids, p) for ids, p in zip(prompts, params, strict=True)]

    a, b = batched(), one_by_one()  # warm up, and the outputs compared
    kv_diff = max(
        float(np.abs(x[i] - y[i]).max()) for x, y in zip(a, b, strict=True) for i in (2, 3)
    )
    forwards = engine.prefill_forwards
    runs: dict[str, list[float]] = {"batched": [], "one_by_one": []}
    for r in range(args.rounds):
        order = [("batched", batched), ("one_by_one", one_by_one)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "prompt_tokens": [len(p) for p in prompts],
        "batched": summary(runs["batched"]),
        "one_by_one": summary(runs["one_by_one"]),
        "ratio_per_round": [
            round(x / y, 3) for x, y in zip(runs["batched"], runs["one_by_one"], strict=True)
        ],
        "last_first_token_ratio": round(med["batched"] / med["one_by_one"], 3),
        "forwards_per_burst": (engine.prefill_forwards - forwards) // args.rounds,
        "first_tokens_equal": [x[0] for x in a] == [y[0] for y in b],
        "kv_max_abs_diff": kv_diff,
    }


def pipeline_config(model: str, batch: bool, threads: int, chat: bool) -> dict[str, Any]:
    opts = {"model": model, "chat": chat, "threads": threads}
    env = {"OMP_NUM_THREADS": str(threads)}
    engine = {"model": model, "threads": threads}
    return {
        "name": f"bench-prefill-burst-{'batched' if batch else 'one'}",
        "ready_timeout_s": 600,
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": opts},
            {
                "name": "prefill",
                "kind": "ar.prefill",
                "max_batch_size": 8,
                "extra_env": env,
                "options": {**engine, "batch_prefill": batch},
            },
            {
                "name": "decode",
                "kind": "ar.decode",
                "max_inflight": 8,
                "extra_env": env,
                "options": engine,
            },
        ],
        "edges": [{"from": "intake", "to": "prefill"}, {"from": "prefill", "to": "decode"}],
    }


def last_first_token_s(pipe: Pipeline, requests: list[dict[str, Any]]) -> float:
    """Submit every request at once; the time to the last one's first event (its first
    token: ``max_tokens`` is 1), as the caller's collector stamped it on arrival."""
    t0 = time.monotonic()
    handles = [pipe.submit(r, timeout_s=600) for r in requests]
    for h in handles:
        out = collect(h)
        if not out.ok or not any(e.tokens for e in out.by_stage("decode")):
            raise RuntimeError(f"request {out.request_id} failed or gave no token: {out.error}")
    return max(h.first_event or 0.0 for h in handles) - t0


def pipeline_arm(model: str, args: argparse.Namespace) -> dict[str, Any]:
    requests = [{"prompt": t, "max_tokens": 1} for t in texts(args.prompts, args.repeat)]
    runs: dict[str, list[float]] = {"batched": [], "one_by_one": []}
    with (
        Pipeline(pipeline_config(model, True, args.threads, args.chat)) as on,
        Pipeline(pipeline_config(model, False, args.threads, args.chat)) as off,
    ):
        pipes = [("batched", on), ("one_by_one", off)]
        for _, pipe in pipes:
            last_first_token_s(pipe, requests)  # warm up
        for r in range(args.rounds):
            for name, pipe in pipes if r % 2 == 0 else pipes[::-1]:
                runs[name].append(last_first_token_s(pipe, requests))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "batched": summary(runs["batched"]),
        "one_by_one": summary(runs["one_by_one"]),
        "last_first_token_ratio": round(med["batched"] / med["one_by_one"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench prefill-burst", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default="smollm2", help="a named model or a model directory")
    ap.add_argument("--arms", default="engine,pipeline", help="comma-separated: engine, pipeline")
    ap.add_argument("--prompts", type=int, default=8, help="prompts in the burst")
    ap.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prompts through the chat template (--no-chat: the bare text, fewer tokens)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="each prompt's text this many times")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    args = ap.parse_args(argv)
    from omni_ar.models import resolve_model

    model = str(resolve_model(args.model))
    run = {"engine": lambda: engine_arm(model, args), "pipeline": lambda: pipeline_arm(model, args)}
    arms, failed = run_arms(args.arms, run, ap.error)
    res: dict[str, Any] = {
        "model": args.model,
        "prompts": args.prompts,
        "chat": args.chat,
        "repeat": args.repeat,
        "rounds": args.rounds,
        "threads": args.threads,
        "cpu_model": cpu_model(),
        **arms,
    }
    res["targets_met"] = {
        f"{arm}: last first token batched <= 0.5 x one by one": r["last_first_token_ratio"] <= 0.5
        for arm, r in arms.items()
        if "last_first_token_ratio" in r
    }
    emit(res, args.json)
    return 1 if failed else 0
