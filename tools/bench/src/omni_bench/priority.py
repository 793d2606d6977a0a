"""``omni bench priority``: does an interactive request pass a batch load?

For each pipeline (``--configs``): ``ar``, ``configs/ar_chat.yaml`` as shipped (the fused
``ar.generate`` stage, transformers engine); ``vllm``, the same with the generate stage on
``engine: vllm`` (run only where vLLM is installed); ``dit``, ``configs/dit_image.yaml``;
``synthetic``, two ``synthetic.sleep`` stages, the second holding one request at a time
(the runtime alone, for tests; not in the default set).

A steady load of ``--concurrency`` requests is kept in flight (a new one as soon as one
ends) and, once the load is saturating (its first request ended), ``--probes`` probe
requests are submitted, one every ``--interval`` seconds, never two at once (a probe that
takes longer delays the next: on a CPU a probe may outlast the interval, and overlapping
probes would be a load of their own, even in the idle arm). The load's requests are
ordinary ones (priority 0, no field); the probes carry ``priority: -1`` where the
pipeline schedules by priority. Three arms per pipeline, in one run:

* ``idle``: the probes alone (on the ``priority`` pipeline);
* ``fcfs``: load + ``--fcfs-probes`` probes (each waits behind the whole queue),
  ``mrs.defaults.scheduler_policy: fcfs`` (the probes carry no priority: a first come,
  first served pipeline refuses one);
* ``priority``: load + probes, ``mrs.defaults.scheduler_policy: priority``.

AR figures: time to first text (``ttft``: submit to the first event carrying text) and to
completion (the terminal event); every AR request asks for exactly ``--max-tokens``
tokens (``ignore_eos``). DiT figures: submit to the first preview and to the final image.
Per arm the probes' p50 and p95, the load's completions per second and output units per
second (tokens, images) over the probes' window, the stages' ``preemptions`` (running
batches paused for a better request, per stage), and completed / errors / lost counts for
load and probes (lost: no terminal event ``--timeout`` seconds after its submit, or for
the load after the last probe ended, plus a grace of 10 s).
``priority_probe_<figure>_vs_idle`` and ``fcfs_probe_<figure>_vs_idle`` are ratios of
p50s; the target is ``priority_probe_ttft_vs_idle <= 2.0`` (AR) and
``priority_probe_image_vs_idle <= 2.0`` (DiT), with nothing lost and no load error.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omni_core import Pipeline, load_config
from omni_core.config import PipelineConfig
from omni_core.events import AnyEvent
from omni_core.scheduling import PRIORITY_KEY, SchedulerPolicy
from omni_testing.configs import chain

from omni_bench.dit import CONFIGS
from omni_bench.prompts import PROMPTS
from omni_bench.report import emit
from omni_bench.serve_load import percentile

PROBE_PRIORITY = -1  # the probes' priority under the priority policy; the load's is 0
TARGET_RATIO = 2.0
GRACE_S = 10.0  # past a request's --timeout, it is counted lost
ALL = ("ar", "vllm", "dit", "synthetic")
DEFAULT = "ar,vllm,dit"


@dataclass
class Target:
    """One pipeline under test: its config per policy, its requests and what its two
    figures time (``first``, ``done``: predicates on the caller's events)."""

    config: Callable[[SchedulerPolicy], PipelineConfig | dict[str, Any]]
    request: Callable[[int], dict[str, Any]]
    figures: tuple[str, str]  # the names of the first and the second figure
    first: Callable[[AnyEvent], bool]
    done: Callable[[AnyEvent], bool]
    units: Callable[[AnyEvent], int]  # output units an event carries (tokens, images)
    about: dict[str, Any]  # what the JSON says of the target


@dataclass
class Sample:
    """One request's timings (seconds from its submit) and outcome (None: no end yet)."""

    first: float | None = None
    done: float | None = None
    ended_at: float | None = None  # monotonic
    outcome: str | None = None
    error: str = ""
    units: int = 0


@dataclass
class Tally:
    samples: list[Sample] = field(default_factory=list)

    def new(self) -> Sample:
        s = Sample()
        self.samples.append(s)
        return s

    def counts(self) -> dict[str, Any]:
        outcomes = Counter(s.outcome or "lost" for s in self.samples)
        res: dict[str, Any] = {
            "completed": outcomes.pop("completed", 0),
            "lost": outcomes.pop("lost", 0),
        }
        res["errors"] = sum(outcomes.values())
        if res["errors"]:
            res["error_outcomes"] = dict(outcomes)
            res["error_example"] = next(s.error for s in self.samples if s.error)[:300]
        return res


# -- targets ---------------------------------------------------------------------------
def _with_policy(cfg: PipelineConfig, policy: SchedulerPolicy) -> PipelineConfig:
    cfg.mrs.defaults.scheduler_policy = policy
    return cfg


def ar_target(engine: str, max_tokens: int) -> Target:
    path = CONFIGS / "ar_chat.yaml"

    def config(policy: SchedulerPolicy) -> PipelineConfig:
        cfg = _with_policy(load_config(path), policy)
        if engine != "transformers":
            gen = next(s for s in cfg.stages if s.kind == "ar.generate")
            gen.options["engine"] = engine
        return cfg

    def request(i: int) -> dict[str, Any]:
        return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "ignore_eos": True}

    return Target(
        config=config,
        request=request,
        figures=("ttft", "completion"),
        first=lambda ev: ev.event_type == "segment" and bool(ev.payload.get("text")),
        done=lambda ev: ev.terminal,
        units=lambda ev: len(ev.tokens or []) if ev.event_type == "segment" else 0,
        about={"config": "configs/ar_chat.yaml", "engine": engine, "max_tokens": max_tokens},
    )


def dit_target() -> Target:
    from omni_dit.shapes import HELD_OUT

    def request(i: int) -> dict[str, Any]:
        return {"prompt": HELD_OUT[i % len(HELD_OUT)].caption(), "image": {"seed": i}}

    def is_image(ev: AnyEvent, last: bool) -> bool:
        return ev.event_type == "image" and ev.is_last is last

    return Target(
        config=lambda policy: _with_policy(load_config(CONFIGS / "dit_image.yaml"), policy),
        request=request,
        figures=("first_preview", "image"),
        first=lambda ev: is_image(ev, False),
        done=lambda ev: is_image(ev, True),
        units=lambda ev: int(is_image(ev, True)),
        about={"config": "configs/dit_image.yaml", "image": "the config's image_defaults"},
    )


def synthetic_target(hold_s: float) -> Target:
    def config(policy: SchedulerPolicy) -> dict[str, Any]:
        return chain(
            ("front", "synthetic.sleep", {"hold_s": 0.0}),
            ("held", "synthetic.sleep", {"hold_s": hold_s}, {"max_inflight": 1}),
            mrs={"defaults": {"scheduler_policy": policy}},
        )

    return Target(
        config=config,
        request=lambda i: {},
        figures=("ttft", "completion"),
        first=lambda ev: ev.event_type == "segment",
        done=lambda ev: ev.terminal,
        units=lambda ev: len(ev.tokens or []) if ev.event_type == "segment" else 0,
        about={"config": "synthetic.sleep x 2, the second max_inflight 1", "hold_s": hold_s},
    )


# -- one arm ------------------------------------------------------------------------------
async def one(pipe: Pipeline, t: Target, req: dict[str, Any], s: Sample, timeout_s: float) -> None:
    """Run ``req`` to its end, timing it into ``s``."""
    t0 = time.monotonic()
    try:
        async for ev in pipe.astream(req, timeout_s=timeout_s):
            now = time.monotonic() - t0
            s.units += t.units(ev)
            if s.first is None and t.first(ev):
                s.first = now
            if s.done is None and t.done(ev):
                s.done = now
            if ev.terminal:
                s.ended_at = time.monotonic()
                s.outcome = ev.event_type
                if ev.event_type != "completed":
                    s.error = getattr(ev, "message", "") or ev.event_type
    except Exception as e:  # a refused submit, a broken stream: this request's error
        s.ended_at = time.monotonic()
        s.outcome, s.error = "exception", f"{type(e).__name__}: {e}"


async def run_arm(
    pipe: Pipeline, t: Target, args: argparse.Namespace, probes: int, load: bool, priority: int
) -> dict[str, Any]:
    """``probes`` probes (``priority``: theirs), alone or over the load; the arm's
    figures and counts."""
    load_tally, probe_tally = Tally(), Tally()
    stop, saturated = asyncio.Event(), asyncio.Event()
    paused_before = preemptions(pipe)

    async def loader(k: int) -> None:
        i = k
        while not stop.is_set():
            await one(pipe, t, t.request(i), load_tally.new(), args.timeout)
            saturated.set()
            i += args.concurrency

    loaders = [asyncio.create_task(loader(k)) for k in range(args.concurrency if load else 0)]
    if load:  # the queues are full once the first request of the load has ended
        try:
            await asyncio.wait_for(saturated.wait(), args.timeout)
        except TimeoutError:
            raise RuntimeError(f"no load request ended within {args.timeout} s") from None
    start = time.monotonic()
    for k in range(probes):  # one at a time: a probe never waits behind another
        await asyncio.sleep(max(0.0, start + k * args.interval - time.monotonic()))
        req = t.request(1000 + k)
        if priority:
            req[PRIORITY_KEY] = priority
        probe = asyncio.create_task(one(pipe, t, req, probe_tally.new(), args.timeout))
        await asyncio.wait([probe], timeout=args.timeout + GRACE_S)
        probe.cancel()  # lost if it had not ended: its request is cancelled
    end = time.monotonic()
    stop.set()
    if loaders:
        await asyncio.wait(loaders, timeout=args.timeout + GRACE_S)
    for task in loaders:  # what is left is lost; its request is cancelled
        task.cancel()
    await asyncio.gather(*loaders, return_exceptions=True)

    res: dict[str, Any] = {"probe": probe_figures(t, probe_tally)}
    after = preemptions(pipe)
    res["preemptions"] = {k: n - paused_before.get(k, 0) for k, n in after.items() if n}
    if load:
        window = [
            s
            for s in load_tally.samples
            if s.outcome == "completed" and s.ended_at is not None and start <= s.ended_at <= end
        ]
        res["load"] = {
            **load_tally.counts(),
            "requests": len(load_tally.samples),
            "rps": round(len(window) / (end - start), 3),
            f"{'images' if t.figures[1] == 'image' else 'tok'}_per_s": round(
                sum(s.units for s in window) / (end - start), 3
            ),
        }
    return res


def preemptions(pipe: Pipeline) -> dict[str, int]:
    """Per stage, the times it paused a running batch for a better request (so far, as
    the last heartbeats said)."""
    return {name: m.get("preemptions", 0) for name, m in pipe.metrics()["stages"].items()}


def probe_figures(t: Target, tally: Tally) -> dict[str, Any]:
    res = tally.counts()
    ok = [s for s in tally.samples if s.outcome == "completed"]
    for name, get in zip(t.figures, (lambda s: s.first, lambda s: s.done), strict=True):
        xs = [1000 * x for x in map(get, ok) if x is not None]
        res[f"{name}_ms_p50"] = round(percentile(xs, 50), 1)
        res[f"{name}_ms_p95"] = round(percentile(xs, 95), 1)
    return res


def bench_target(t: Target, args: argparse.Namespace) -> dict[str, Any]:
    """The three arms: fcfs on one pipeline, then idle and priority on another."""
    res: dict[str, Any] = {
        **t.about,
        "concurrency": args.concurrency,
        "probes": args.probes,
        "fcfs_probes": args.fcfs_probes,
        "interval_s": args.interval,
        "probes_at_once": 1,
        "load_priority": 0,
        "probe_priority": PROBE_PRIORITY,
    }
    for policy in ("fcfs", "priority"):
        with Pipeline(t.config(policy)) as pipe:
            warm = pipe.generate([t.request(i) for i in range(2)], timeout_s=args.timeout)
            if not all(o.ok for o in warm):
                errors = [o.error or o.finish_reason for o in warm if not o.ok]
                raise RuntimeError(f"{policy} pipeline: warm-up failed: {errors}")
            if policy == "priority":
                n = args.probes
                res["idle"] = asyncio.run(run_arm(pipe, t, args, n, False, PROBE_PRIORITY))
                res["priority"] = asyncio.run(run_arm(pipe, t, args, n, True, PROBE_PRIORITY))
            else:
                res["fcfs"] = asyncio.run(run_arm(pipe, t, args, args.fcfs_probes, True, 0))
    for arm in ("idle", "fcfs", "priority"):  # in reading order
        res[arm] = res.pop(arm)
    idle = res["idle"]["probe"]
    for policy in ("priority", "fcfs"):
        for name in t.figures:
            key = f"{name}_ms_p50"
            ratio = res[policy]["probe"][key] / idle[key] if idle[key] else float("nan")
            res[f"{policy}_probe_{name}_vs_idle"] = round(ratio, 3)
    return res


def targets_met(res: dict[str, Any]) -> dict[str, bool]:
    met: dict[str, bool] = {}
    for name, r in res.items():
        if not isinstance(r, dict) or "idle" not in r:
            continue
        figure = "image" if "priority_probe_image_vs_idle" in r else "ttft"
        key = f"priority_probe_{figure}_vs_idle"
        met[f"{name}.{key} <= {TARGET_RATIO}"] = r[key] <= TARGET_RATIO
        counts = [
            r[a][part]
            for a in ("idle", "fcfs", "priority")
            for part in ("probe", "load")
            if part in r[a]
        ]
        met[f"{name}: lost == 0 and errors == 0"] = all(
            c["lost"] == 0 and c["errors"] == 0 for c in counts
        )
    return met


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench priority", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--configs", default=DEFAULT, help=f"comma-separated, of {', '.join(ALL)}")
    ap.add_argument("--concurrency", type=int, default=32, help="load requests in flight")
    ap.add_argument("--probes", type=int, default=10, help="probes of the idle, priority arms")
    ap.add_argument(
        "--fcfs-probes",
        type=int,
        default=3,
        help="probes of the fcfs arm (each waits behind the whole queue: long on a CPU)",
    )
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between probes")
    ap.add_argument("--max-tokens", type=int, default=48, help="AR: tokens every request asks")
    ap.add_argument("--hold", type=float, default=0.05, help="synthetic: seconds per request")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    ap.add_argument("--quick", action="store_true", help="3 probes 0.25 s apart (for tests)")
    args = ap.parse_args(argv)
    if args.quick:
        args.probes, args.fcfs_probes, args.interval = 3, 3, 0.25
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(ALL))
    if unknown or min(args.concurrency, args.probes, args.fcfs_probes) < 1:
        ap.error(f"--configs: of {', '.join(ALL)} (unknown: {unknown}); counts must be >= 1")
    builders: dict[str, Callable[[], Target]] = {
        "ar": lambda: ar_target("transformers", args.max_tokens),
        "vllm": lambda: ar_target("vllm", args.max_tokens),
        "dit": dit_target,
        "synthetic": lambda: synthetic_target(args.hold),
    }
    res: dict[str, Any] = {}
    for name in names:
        if name == "vllm" and importlib.util.find_spec("vllm") is None:
            res[name] = {"skipped": "vLLM is not installed"}
            continue
        try:
            res[name] = bench_target(builders[name](), args)
        except Exception as e:  # one pipeline's failure is reported; the others still run
            res[name] = {"error": f"{type(e).__name__}: {e}"}
    res["targets_met"] = targets_met(res)
    emit(res, args.json)
    return 0
