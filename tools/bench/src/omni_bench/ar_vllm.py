"""``omni bench ar --engine vllm``: omni's vLLM pipelines against vLLM as its users run it.

Arms, on the same model, prompts (the 8 chat prompts, through the same chat template),
``max_tokens`` and ``ignore_eos``; all stay up for the whole run and are measured in turn,
round after round (``--rounds``, the order rotating), so the machine's swings hit each:

* ``vllm``: vLLM's ``AsyncLLM`` in a subprocess with its own environment, as a user runs
  it: vLLM's default threading (no ``OMP_NUM_THREADS``), its engine-core process,
  detokenization on, requests streamed concurrently. Same engine settings as omni's CPU
  engine (``enforce_eager``, float32).
* ``fused``: intake -> ``ar.generate`` (one engine, every core) -> postprocess.
* ``split``: intake -> prefill -> decode -> postprocess, one thread per engine, the
  prompt's KV crossing through the data-plane connector (``shm``).
* ``split_turns``: the same, both engines on every core, computing in turns
  (``cpu_turns``, :mod:`omni_ar.engines.cpu_turns`).

(the layouts of :func:`omni_bench.serve.omni_config`). Concurrency 1 (``--c1-requests``
one after another) and 8 (8 at once): output tokens per second and time to first text
(omni: the first text the caller receives; vLLM: the first streamed output with text).
Per arm and level the best and median of the rounds; ``omni_vs_vllm_*`` (fused) and
``split_vs_vllm_*`` are ratios of medians.

``kv_handoff`` (``--prompt-tokens N``, 0 skips): time to first text of an N-token prompt
(a fresh one each round, so no prefix-cache hit), 8 tokens generated, for ``split``,
``split_file`` (vLLM's file connector), ``fused_1t`` (the fused layout on one thread, the
compute of split's engines: what the handoff adds is ``ttft_split_over_fused_1t``),
``fused`` and ``vllm``. Target: split <= 1.1 x fused_1t. ``--before-src DIR`` adds
``split_before``, split with prefill and decode importing ``omni_ar`` from ``DIR`` (another
checkout's ``packages/omni-ar-stages/src``): before/after figures in one run.

Every engine (both sides) gets a KV cache of ``--kv-cache-mib`` (default 160) and
``max_model_len`` 2048 (:func:`engine_args`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from omni_bench.prompts import PROMPTS

READY, RESULT = "OMNI-BENCH-READY", "OMNI-BENCH-RESULT "
ARMS = ("fused", "fused_1t", "split", "split_turns", "split_file")  # omni's
Stream = Callable[[int], AsyncIterator[tuple[int, bool]]]  # i -> (new tokens, has text)


def engine_args(model: str, kv_bytes: int) -> dict[str, int]:
    """Every engine's (both sides): a ``kv_bytes`` KV cache and sequences of at most 2,048
    tokens, which these requests never pass; eight engines then fit a small machine."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    longest = min(2048, cfg.get("max_position_embeddings") or 2048)
    return {"kv_cache_memory_bytes": kv_bytes, "max_model_len": longest}


async def drive(stream: Stream, n: int, concurrency: int) -> dict[str, float]:
    """Requests 0..n-1, at most ``concurrency`` open at once: output tokens per second
    over the wall time, and the median time to first text."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> tuple[float, int]:
        async with sem:
            t0 = time.monotonic()
            first = first_token = None
            tokens = 0
            async for count, text in stream(i):
                tokens += count
                if first_token is None and count:
                    first_token = time.monotonic() - t0
                if first is None and text:
                    first = time.monotonic() - t0
            # a tiny test model's tokens may decode to no text: then its first token counts
            first = first if first is not None else first_token
            return (first if first is not None else float("nan")) * 1000, tokens

    t0 = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.monotonic() - t0
    tokens = sum(r[1] for r in results)
    return {
        "tok_per_s": tokens / wall,
        "ttft_ms": statistics.median(r[0] for r in results),
        "tokens": tokens,
    }


# -- vLLM as its users run it (in a subprocess) -----------------------------------------
def baseline_main() -> None:
    """The ``vllm`` arm's process: an ``AsyncLLM`` serving the JSON commands read from
    stdin (``{"prompts": [[ids]], "max_tokens": n, "concurrency": c}``), one result line
    each on stdout."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    async def serve() -> None:
        model, kv_bytes = sys.argv[1], int(sys.argv[2])
        args = AsyncEngineArgs(
            model=model, enforce_eager=True, dtype="float32", **engine_args(model, kv_bytes)
        )
        llm = AsyncLLM.from_engine_args(args)
        loop = asyncio.get_running_loop()
        print(READY, flush=True)
        try:
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                res = await run(llm, json.loads(line))
                print(RESULT + json.dumps(res), flush=True)
        finally:
            llm.shutdown()

    asyncio.run(serve())


async def run(llm: Any, cmd: dict[str, Any]) -> dict[str, float]:
    """One command of :func:`baseline_main`, on the ``AsyncLLM`` ``llm``."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    prompts = cmd["prompts"]
    sp = SamplingParams(
        max_tokens=cmd["max_tokens"],
        temperature=0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )

    async def stream(i: int) -> AsyncIterator[tuple[int, bool]]:
        async for out in llm.generate({"prompt_token_ids": prompts[i]}, sp, uuid.uuid4().hex):
            c = out.outputs[0]
            yield len(c.token_ids), bool(c.text)

    return await drive(stream, len(prompts), cmd["concurrency"])


class VllmBaseline:
    """The ``vllm`` arm: :func:`baseline_main` in its own process group and environment
    (this one's less ``VLLM_*`` and ``OMP_NUM_THREADS``)."""

    def __init__(self, model: str, kv_bytes: int, log: Path) -> None:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("VLLM_") and k != "OMP_NUM_THREADS"
        }
        env["VLLM_LOGGING_LEVEL"] = "WARNING"  # its KV cache: kv_cache_memory_bytes
        from omni_bench.serve import die_with_parent

        code = "from omni_bench.ar_vllm import baseline_main; baseline_main()"
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, model, str(kv_bytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=f,
                text=True,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self._read(READY)

    def _read(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # vLLM may log to stdout too: skip that
            if line.startswith(prefix):
                return line[len(prefix) :]
        tail = self.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM baseline exited ({self.proc.wait()}):\n{tail}")

    def run(self, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict[str, float]:
        assert self.proc.stdin is not None
        cmd = {"prompts": prompts, "max_tokens": max_tokens, "concurrency": concurrency}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read(RESULT))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine-core process too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


# -- omni's pipelines ---------------------------------------------------------------------
def pipeline_configs(
    model: str, kv_dir: str, kv_bytes: int, before_src: str | None = None
) -> dict[str, dict[str, Any]]:
    """fused, fused_1t, split, split_file (and split_before): the serve bench's layouts
    and variants, every engine with a KV cache of ``kv_bytes``."""
    from omni_bench.serve import omni_config

    cfgs = {
        name: omni_config(model, name if name == "split_turns" else name.split("_")[0])
        for name in ARMS
    }
    gen = cfgs["fused_1t"]["stages"][1]
    gen["options"]["threads"], gen["extra_env"] = 1, {"OMP_NUM_THREADS": "1"}
    for st in cfgs["split_file"]["stages"][1:3]:  # prefill, decode
        st["options"]["kv_connector"] = "file"
        st["extra_env"] = {**st["extra_env"], "OMNI_VLLM_KV_DIR": kv_dir}
    if before_src:
        cfgs["split_before"] = omni_config(model, "split")
        for st in cfgs["split_before"]["stages"][1:3]:
            st["extra_env"] = {**st["extra_env"], "PYTHONPATH": before_src}
    for cfg in cfgs.values():
        for st in cfg["stages"][1:-1]:  # the engines
            st["options"]["engine_args"] = engine_args(model, kv_bytes)
    return cfgs


class OmniArm:
    """An omni pipeline driven like the baseline (prompts as text, through intake)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from omni_core import Pipeline

        self.pipe = Pipeline(cfg).start()

    def run(self, texts: list[str], max_tokens: int, concurrency: int) -> dict[str, float]:
        async def stream(i: int) -> AsyncIterator[tuple[int, bool]]:
            req = {"prompt": texts[i], "max_tokens": max_tokens, "ignore_eos": True}
            async for ev in self.pipe.astream(req):
                if ev.event_type == "segment" and ev.stage == "postprocess":
                    yield len(ev.tokens), bool(ev.payload.get("text"))
                elif ev.event_type in ("error", "cancelled"):
                    raise RuntimeError(f"omni request failed: {ev}")

        return asyncio.run(drive(stream, len(texts), concurrency))

    def close(self) -> None:
        self.pipe.close()


def long_prompt(engine: Any, tokens: int, salt: int) -> tuple[str, list[int]]:
    """(text, chat token ids) of a prompt of about ``tokens`` tokens; ``salt`` makes its
    first tokens differ, so no engine finds it in its prefix cache."""
    words = " ".join(PROMPTS * (tokens // 40 + 2)).split()
    lo, hi = 1, len(words)
    while lo < hi:  # the most words that stay within ``tokens``
        mid = (lo + hi + 1) // 2
        if len(encode(engine, f"{salt}. Summarize: " + " ".join(words[:mid]))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    text = f"{salt}. Summarize: " + " ".join(words[:lo])
    return text, encode(engine, text)


def encode(engine: Any, text: str) -> list[int]:
    """The ids omni's intake makes of a plain prompt with ``chat: true``."""
    return engine.encode([{"role": "user", "content": text}])


def summary(runs: list[float], lower_is_better: bool) -> dict[str, Any]:
    """Best and median of the runs that gave a figure (NaN: a failed run)."""
    ok = [x for x in runs if x == x] or [float("nan")]
    best = min(ok) if lower_is_better else max(ok)
    return {
        "best": round(best, 2),
        "median": round(statistics.median(ok), 2),
        "runs": [round(x, 2) for x in runs],
    }


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def bench_vllm(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every arm up at once, then ``--rounds`` rounds, each measuring every arm in turn."""
    from omni_ar.engines.transformers_engine import TransformersEngine

    tok = TransformersEngine(model)  # its tokenizer only, as intake's
    tok.load_tokenizer()
    n, n_long = args.max_tokens, args.prompt_tokens
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    ids = [encode(tok, t) for t in texts]
    main_arms = ["vllm", "fused", "split", "split_turns"]
    long_arms = ["split", "split_file", "fused_1t", "fused", "vllm"] if n_long else []
    if n_long and args.before_src:
        long_arms.insert(1, "split_before")
    arms: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="omni-bench-ar-") as tmp:
        kv_bytes = args.kv_cache_mib << 20
        cfgs = pipeline_configs(model, os.path.join(tmp, "kv"), kv_bytes, args.before_src)
        try:
            arms["vllm"] = VllmBaseline(model, kv_bytes, Path(tmp) / "vllm.log")
            for name in dict.fromkeys(main_arms[1:] + long_arms[1:-1]):
                arms[name] = OmniArm(cfgs[name])

            def run(arm: str, k: int, max_tokens: int, conc: int, salt: int = 0):  # type: ignore[no-untyped-def]
                if salt:
                    text, pids = long_prompt(tok, n_long, salt)
                    t, p = [text], [pids]
                else:
                    t, p = texts[:k], ids[:k]
                if arm == "vllm":
                    return arms[arm].run(p, max_tokens, conc)
                return arms[arm].run(t, max_tokens, conc)

            for arm in arms:  # warm up: every batch shape seen once
                if arm != "split_file":  # its decode fails on short prompts after a save
                    run(arm, 8, 4, 8)
            main: dict[str, dict[str, list[float]]] = {a: {} for a in main_arms}
            handoff: dict[str, list[float]] = {a: [] for a in long_arms}
            for r in range(args.rounds):
                order = main_arms[r % len(main_arms) :] + main_arms[: r % len(main_arms)]
                for arm in order:
                    for level, k in (("c1", args.c1_requests), ("c8", 8)):
                        m = run(arm, k, n, 1 if level == "c1" else 8)
                        for key in ("tok_per_s", "ttft_ms"):
                            main[arm].setdefault(f"{key}_{level}", []).append(m[key])
                turn = r % max(1, len(long_arms))
                for arm in long_arms[turn:] + long_arms[:turn]:
                    try:
                        handoff[arm].append(run(arm, 1, 8, 1, salt=r + 1)["ttft_ms"])
                    except RuntimeError as e:  # vLLM's reference file connector, say
                        print(f"omni bench ar: {arm}: {e}", file=sys.stderr)
                        handoff[arm].append(float("nan"))
        finally:
            for a in arms.values():
                a.close()
    res: dict[str, Any] = {
        "engine": "vllm",
        "model": args.model,
        "max_tokens": n,
        "rounds": args.rounds,
        "c1_requests": args.c1_requests,
    }
    for arm, figures in main.items():
        res[arm] = {k: summary(v, k.startswith("ttft")) for k, v in figures.items()}
    targets: dict[str, bool] = {}
    for level in ("c1", "c8"):
        v = res["vllm"]
        for name, label in (("fused", "omni"), ("split", "split"), ("split_turns", "split_turns")):
            o = res[name]
            tps = ratio(o[f"tok_per_s_{level}"]["median"], v[f"tok_per_s_{level}"]["median"])
            ttft = ratio(o[f"ttft_ms_{level}"]["median"], v[f"ttft_ms_{level}"]["median"])
            res[f"{label}_vs_vllm_tok_per_s_{level}"] = tps
            res[f"{label}_vs_vllm_ttft_{level}"] = ttft
        targets[f"fused tok_per_s_{level} >= 0.9 x vllm"] = (
            res[f"omni_vs_vllm_tok_per_s_{level}"] >= 0.9
        )
    if n_long:
        med = {a: summary(v, True)["median"] for a, v in handoff.items()}
        res["kv_handoff"] = {
            "prompt_tokens": len(long_prompt(tok, n_long, 1)[1]),
            "ttft_ms": {a: summary(v, True) for a, v in handoff.items()},
            "ttft_split_over_fused_1t": ratio(med["split"], med["fused_1t"]),
            **(
                {"ttft_split_before_over_fused_1t": ratio(med["split_before"], med["fused_1t"])}
                if "split_before" in med
                else {}
            ),
            "ttft_split_file_over_fused_1t": ratio(med["split_file"], med["fused_1t"]),
            "ttft_split_over_fused": ratio(med["split"], med["fused"]),
            "ttft_split_over_vllm": ratio(med["split"], med["vllm"]),
            "ttft_fused_over_vllm": ratio(med["fused"], med["vllm"]),
        }
        targets["kv_handoff: split ttft <= 1.1 x fused_1t"] = (
            res["kv_handoff"]["ttft_split_over_fused_1t"] <= 1.1
        )
    res["targets_met"] = targets
    return res
