"""``omni bench audio``: Qwen2.5-Omni speaking, staged against the model's own ``generate``.

Same checkpoint (``--model``: the embedded ``tiny-qwen2.5-omni`` or a Qwen2.5-Omni
directory), same prompts (the AR benches' chat prompts, one per request, in the thinker
stage's own chat format: the baseline is handed the very ids the staged thinker reads),
same decoding: the thinker greedy up to ``--max-tokens``; the talker greedy (``--talker
sampled``: generate's default sampling, from each request's seed), at most
``--max-codes`` (the config's ``max_codes``); the voice is the checkpoint's first.

* staged: ``configs/omni_speech.yaml`` in worker processes as shipped (each model stage
  pins torch to one thread; token2wav's DiT streams windows of 24 codes, growing to 96,
  to its vocoder in a process of its own), with the waveform stage's events (mel2wav,
  or token2wav in a config that keeps the halves together) streamed to the caller too,
  for the order and loss check. At each
  concurrency ``c`` the requests run as ``c`` clients that each send the next once
  theirs ended. Time to first audio (TTFA): submit to the first encoded audio bytes the
  caller receives.
* baseline: ``Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)`` in
  this process, torch's default threads (every core). ``sequential``: one request per
  call, in waves of ``c`` that arrive together (its default use); ``batched``: each wave
  as one call of ``c`` left-padded prompts (transformers' batched generate; sampled codes
  come from the wave's first seed, so not the sequential ones); ``batched_1_thread``:
  the same at one torch thread (its best setting here, some runs). Its first audio is the
  whole waveform: TTFA is its whole latency. A call that raises (generate's token2wav
  refuses a reply of one or two codes) is reported under ``errors``, its requests silent.

Per arm and concurrency: TTFA and latency p50/p95 (ms), real-time factor p50/p95 (a
request's synthesis time, submit to last audio, over its audio seconds) and throughput
(audio seconds per wall second). Ratios: staged TTFA p50 over the baseline's latency p50
(target <= 0.5), staged throughput over the baseline's best at the highest concurrency
(target >= 1.5). Where the time goes: CPU seconds per process of the staged pipeline,
and the baseline's seconds in its thinker, talker and token2wav. ``no_audio_lost``: in
every staged request the waveform stage's chunk offsets are contiguous, and the audio stage's
bytes concatenated are the WAV of exactly those samples; ``audio_samples_match_baseline``:
each staged request spoke as many samples as the baseline's sequential run of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from omni_core import Pipeline, load_config

from omni_bench.prompts import PROMPTS
from omni_bench.report import cpu_model, emit, run_arms
from omni_bench.serve import session_cpu
from omni_bench.serve_load import percentile

CONFIG = Path(__file__).resolve().parents[4] / "configs" / "omni_speech.yaml"
# the baseline's ways of serving a wave; "_1_thread": torch at one thread (on a shared
# machine, two threads' spin-waits can cost more than they give)
BASELINES = ("sequential", "batched", "batched_1_thread")
WAVE_KINDS = ("speech.token2wav", "speech.mel2wav")  # the stages that speak samples


@dataclass
class Reply:
    """One request's timings (seconds from its start) and the audio it spoke."""

    ttfa_s: float
    latency_s: float
    samples: int
    rate: int
    intact: bool = True
    error: str = ""  # the baseline's call raised (its requests spoke nothing)

    @property
    def audio_s(self) -> float:
        return self.samples / self.rate


def requests(n: int, max_tokens: int) -> list[dict[str, Any]]:
    """Request ``i``: prompt ``i`` of the fixed prompts, greedy text, seed ``i``."""
    return [
        {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0, "seed": i}
        for i in range(n)
    ]


def level(replies: Sequence[Reply], wall_s: float) -> dict[str, Any]:
    """One arm at one concurrency: percentiles (ms), real-time factor, throughput. TTFA
    and real-time factor are over the requests that spoke (``silent``: those that did
    not; ``errors``: those whose call raised, with the first message)."""

    def pct(xs: list[float], scale: float = 1.0) -> dict[str, float]:
        return {f"p{q}": round(percentile(xs, q) * scale, 3) for q in (50, 95)}

    spoke = [r for r in replies if r.samples]
    audio_s = sum(r.audio_s for r in spoke)
    out = {
        "requests": len(replies),
        "silent": len(replies) - len(spoke),
        "wall_s": round(wall_s, 3),
        "audio_s": round(audio_s, 3),
        "ttfa_ms": pct([r.ttfa_s for r in spoke], 1000),
        "latency_ms": pct([r.latency_s for r in replies], 1000),
        "rtf": pct([r.latency_s / r.audio_s for r in spoke]),
        "throughput_audio_s_per_s": round(audio_s / wall_s, 4),
    }
    errors = [r.error for r in replies if r.error]
    if errors:
        out["errors"] = {"count": len(errors), "first": errors[0]}
    return out


def intact(events: Sequence[Any], wave_stage: str) -> tuple[int, int, bool]:
    """(samples, sample rate, whole): ``wave_stage``'s chunks in order with none lost
    (each one's offset the samples before it) and the audio stage's bytes one WAV of
    exactly those samples."""
    import numpy as np
    from omni_speech.audio import encode_whole, finalize_wav

    chunks = [e for e in events if e.stage == wave_stage and "audio" in (e.arrays or {})]
    if not chunks:
        return 0, 1, False
    sizes = [int(e.arrays["audio"].size) for e in chunks]
    rate = int(chunks[0].payload["sample_rate"])
    ordered = [e.payload["offset"] for e in chunks] == [sum(sizes[:k]) for k in range(len(sizes))]
    wave = np.concatenate([e.arrays["audio"] for e in chunks])
    blob = b"".join(bytes(e.arrays["audio"]) for e in events if e.stage == "audio" and e.arrays)
    try:
        same = finalize_wav(blob) == encode_whole(wave, "wav", rate)
    except ValueError:  # not a WAV at all
        same = False
    return sum(sizes), rate, ordered and same


# -- staged ---------------------------------------------------------------------------


def staged_config(path: Path, model: str, max_codes: int, talker: str) -> dict[str, Any]:
    """The shipped config on ``model``, the waveform stage's events to the caller too."""
    cfg = msgspec.to_builtins(load_config(path))
    cfg["mrs"]["enabled"] = True
    for st in cfg["stages"]:
        if "model" in st["options"]:
            st["options"]["model"] = model
        if st["kind"] == "speech.talker":
            st["options"]["max_codes"] = max_codes
            if talker == "greedy":
                st["options"]["sampling"] = {"do_sample": False}
        if st["kind"] in WAVE_KINDS:
            st["client_stream"] = True
    return cfg


def wave_stage(cfg: dict[str, Any]) -> str:
    """The name of the stage that speaks samples (the audio stage encodes them)."""
    names = [st["name"] for st in cfg["stages"] if st["kind"] in WAVE_KINDS]
    if len(names) != 1:
        raise ValueError(f"the config has {len(names)} stages of {' or '.join(WAVE_KINDS)}")
    return names[0]


def staged_one(pipe: Pipeline, req: dict[str, Any], wave: str) -> Reply:
    """Run ``req``, timing the first encoded audio bytes and the end as they arrive."""
    t0 = time.monotonic()
    first = None
    events = []
    for e in pipe.submit(req, timeout_s=3600):
        if first is None and e.stage == "audio" and e.arrays and len(e.arrays["audio"]):
            first = time.monotonic() - t0
        events.append(e)
    end = time.monotonic() - t0
    if events[-1].event_type != "completed":
        raise RuntimeError(f"staged request failed: {events[-1]}")
    samples, rate, whole = intact(events, wave)
    return Reply(first if first is not None else end, end, samples, rate, whole)


def cpu_s(before: dict[int, tuple[str, float]], names: dict[int, str]) -> dict[str, float]:
    """CPU seconds since ``before`` (:func:`~omni_bench.serve.session_cpu`) of each
    process of the pipeline: its stages by ``names`` (pid -> stage), this one as
    ``caller``, the rest of omni's by their own name (the zygote)."""
    out: dict[str, float] = {}
    names = {**names, os.getpid(): "caller"}
    for pid, (name, cpu) in session_cpu(os.getsid(0)).items():
        key = names.get(pid) or (name.removeprefix("omni:") if name.startswith("omni:") else "")
        if key:
            out[key] = round(out.get(key, 0.0) + cpu - before.get(pid, (name, 0.0))[1], 2)
    return dict(sorted(out.items()))


def staged_arm(
    model: str, reqs: list[dict[str, Any]], levels: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    cfg = staged_config(Path(args.config), model, args.max_codes, args.talker)
    wave = wave_stage(cfg)
    threads = {
        st["name"]: st["options"]["threads"] for st in cfg["stages"] if "threads" in st["options"]
    }
    res: dict[str, Any] = {"torch_threads_by_stage": threads, "replies": {}}
    with Pipeline(cfg) as pipe:
        staged_one(pipe, reqs[0], wave)  # warm up every stage
        for c in levels:
            before = session_cpu(os.getsid(0))
            t0 = time.monotonic()
            with ThreadPoolExecutor(c) as pool:
                replies = list(pool.map(lambda r: staged_one(pipe, r, wave), reqs))
            wall = time.monotonic() - t0
            names = {pid: stage for stage, pid in pipe.pids().items() if pid is not None}
            res[f"c{c}"] = {**level(replies, wall), "cpu_s_by_process": cpu_s(before, names)}
            res["replies"][c] = replies
    return res


# -- baseline -------------------------------------------------------------------------


class Baseline:
    """The model whole in this process, as a user of transformers runs it."""

    def __init__(self, model: str, talker: str, max_tokens: int, max_codes: int) -> None:
        import torch
        from omni_hf import quiet_offline
        from transformers import Qwen2_5OmniForConditionalGeneration

        quiet_offline()
        self.torch = torch
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model).eval()
        m = self.model
        self.voice = next(iter(m.speaker_map))
        self.kw = {
            "speaker": self.voice,
            "thinker_max_new_tokens": max_tokens,
            "thinker_do_sample": False,
            "talker_max_new_tokens": max_codes,
            "talker_do_sample": talker == "sampled",
            # generate's default is the released checkpoint's two codes; a checkpoint's own
            "talker_eos_token_id": [m.talker.codec_pad_token, m.talker.codec_eos_token],
        }
        self.parts = {"thinker": 0.0, "talker": 0.0, "token2wav": 0.0}
        self._time(m.thinker, "generate", "thinker")
        self._time(m.talker, "generate", "talker")
        self._time(m.token2wav, "forward", "token2wav")

    def _time(self, owner: Any, method: str, part: str) -> None:
        fn = getattr(owner, method)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.parts[part] += time.perf_counter() - t0

        setattr(owner, method, timed)

    def run(self, prompts: list[list[int]], seed: int, pad: int) -> list[int]:
        """Samples spoken for each prompt, in one call (left-padded when several)."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(seed)
        with torch.inference_mode():
            _, wav = self.model.generate(input_ids=ids, attention_mask=mask, **self.kw)
        wavs = [wav] if len(prompts) == 1 else wav
        return [int(w.numel()) for w in wavs]


def baseline_ids(model: str, reqs: list[dict[str, Any]]) -> tuple[list[list[int]], int]:
    """Each request's prompt ids as the staged thinker reads it, and a padding id."""
    from omni_core.stage import StageContext
    from omni_speech.thinker import Thinker

    stage = Thinker(StageContext("thinker", "speech.thinker", {"model": model}))
    stage.load()
    ids = [stage.read(r).ids for r in reqs]
    pad = stage.tokenizer.pad_token_id
    return ids, pad if pad is not None else min(stage.eos)


def waves(n: int, c: int) -> list[range]:
    return [range(k, min(k + c, n)) for k in range(0, n, c)]


def baseline_level(
    b: Baseline, ids: list[list[int]], c: int, batched: bool, pad: int, rate: int
) -> tuple[list[Reply], float]:
    """Waves of ``c`` requests that arrive together: one call each (``sequential``: a
    request's latency runs from its wave's start) or one call per wave."""
    replies: list[Reply] = []
    t0 = time.monotonic()
    for wave in waves(len(ids), c):
        start = time.monotonic()
        calls = [list(wave)] if batched else [[i] for i in wave]
        for call in calls:
            try:
                samples, error = b.run([ids[i] for i in call], call[0], pad), ""
            except Exception as e:  # generate's own failure: reported, the others go on
                samples, error = [0] * len(call), f"{type(e).__name__}: {e}"
            end = time.monotonic() - start
            replies += [Reply(end, end, s, rate, error=error) for s in samples]
    return replies, time.monotonic() - t0


def baseline_arm(
    model: str, reqs: list[dict[str, Any]], levels: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    ids, pad = baseline_ids(model, reqs)
    from omni_speech.token2wav import SAMPLE_RATE

    b = Baseline(model, args.talker, args.max_tokens, args.max_codes)
    b.run(ids[0:1], 0, pad)  # warm up
    res: dict[str, Any] = {"torch_threads": b.torch.get_num_threads(), "replies": {}}
    runs = [(name, c) for name in BASELINES for c in levels if c > 1 or name == "sequential"]
    threads = b.torch.get_num_threads()
    for name, c in runs:
        b.parts = dict.fromkeys(b.parts, 0.0)
        b.torch.set_num_threads(1 if name.endswith("_1_thread") else threads)
        batched = name.startswith("batched")
        replies, wall = baseline_level(b, ids, c, batched, pad, SAMPLE_RATE)
        seconds = {k: round(v, 2) for k, v in b.parts.items()}
        res.setdefault(name, {})[f"c{c}"] = {**level(replies, wall), "seconds_by_part": seconds}
        res["replies"][(name, c)] = replies
    return res


# -- the run --------------------------------------------------------------------------


def ratios(staged: dict[str, Any], base: dict[str, Any], levels: list[int]) -> dict[str, Any]:
    """Staged over baseline: TTFA p50 over whole latency p50 (sequential: one request
    per call) per concurrency; throughput at the highest over the baseline's default
    (sequential) and best (the fastest of :data:`BASELINES`)."""
    out: dict[str, Any] = {}
    for c in levels:
        seq = base["sequential"][f"c{c}"]
        out[f"ttfa_p50_vs_baseline_latency_p50_c{c}"] = round(
            staged[f"c{c}"]["ttfa_ms"]["p50"] / seq["latency_ms"]["p50"], 3
        )
    top = f"c{max(levels)}"
    rate = staged[top]["throughput_audio_s_per_s"]
    arms = {
        k: base[k][top]["throughput_audio_s_per_s"] for k in BASELINES if top in base.get(k, {})
    }
    best = max(arms, key=lambda k: arms[k])
    out[f"throughput_vs_baseline_default_{top}"] = round(rate / arms["sequential"], 3)
    out[f"throughput_vs_baseline_best_{top}"] = round(rate / arms[best], 3)
    out["baseline_best"] = best
    return out


def quality_arm() -> dict[str, Any]:
    """The embedded voice (configs/speech_voice.yaml): the share of held-out sentences
    its oracle hears back exactly, and of SmolLM2's replies (omni_speech.oracle)."""
    from omni_speech.oracle import quality_rate

    return quality_rate()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench audio", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default="tiny-qwen2.5-omni", help="a Qwen2.5-Omni directory")
    ap.add_argument("--config", default=str(CONFIG), help="the staged pipeline's config")
    ap.add_argument(
        "--arms",
        default="staged,baseline",
        help="comma-separated: staged, baseline, quality (the embedded voice's oracle rate "
        "on held-out text through configs/speech_voice.yaml; target >= 0.95)",
    )
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    ap.add_argument("--max-tokens", type=int, default=32, help="the thinker's reply, at most")
    ap.add_argument("--max-codes", type=int, default=600, help="the talker's codes, at most")
    ap.add_argument(
        "--talker",
        choices=("greedy", "sampled"),
        default="greedy",
        help="the talker's codes: argmax, or generate's sampling from each request's seed",
    )
    args = ap.parse_args(argv)
    from omni_speech.checkpoint import resolve

    model = resolve(args.model)
    levels = sorted({int(c) for c in args.concurrency.split(",")})
    reqs = requests(args.requests, args.max_tokens)
    run: dict[str, Callable[[], dict[str, Any]]] = {
        "staged": lambda: staged_arm(model, reqs, levels, args),
        "baseline": lambda: baseline_arm(model, reqs, levels, args),
        "quality": quality_arm,
    }
    arms, failed = run_arms(args.arms, run, ap.error)
    replies = {k: a.pop("replies", {}) for k, a in arms.items()}
    res: dict[str, Any] = {
        "model": args.model,
        "config": args.config,
        "requests": args.requests,
        "concurrency": levels,
        "max_tokens": args.max_tokens,
        "max_codes": args.max_codes,
        "talker": args.talker,
        "cpu_model": cpu_model(),
        **arms,
    }
    staged_replies = [r for rs in replies.get("staged", {}).values() for r in rs]
    if staged_replies:
        res["no_audio_lost"] = all(r.intact for r in staged_replies)
        res["staged_audio_s_per_request"] = round(
            statistics.mean(r.audio_s for r in staged_replies), 3
        )
    if all(k in arms and "error" not in arms[k] for k in ("staged", "baseline")):
        want = [r.samples for r in replies["baseline"][("sequential", levels[0])]]
        res["audio_samples_match_baseline"] = all(
            [r.samples for r in rs] == want for rs in replies["staged"].values()
        )
        res["ratios"] = rat = ratios(arms["staged"], arms["baseline"], levels)
        top = f"c{max(levels)}"
        met = {
            f"staged TTFA p50 <= 0.5 x baseline latency p50 (c{c})": (
                rat[f"ttfa_p50_vs_baseline_latency_p50_c{c}"] <= 0.5
            )
            for c in levels
        }
        met[f"staged throughput >= 1.5 x baseline best ({top})"] = (
            rat[f"throughput_vs_baseline_best_{top}"] >= 1.5
        )
        res["targets_met"] = met
    if "quality" in arms and "error" not in arms["quality"]:
        res.setdefault("targets_met", {})["voice quality_rate >= 0.95"] = (
            arms["quality"]["quality_rate"] >= 0.95
        )
    emit(res, args.json)
    return 1 if failed else 0
