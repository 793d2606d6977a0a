"""``omni bench start``: how long a pipeline takes to start and a stage to restart, and the
memory its workers hold, with workers forked from the zygote against spawned ones.

Each arm runs both ways (``backend.start: zygote`` and ``spawn``) in one run, alternating,
after one warm-up start of each (models converted, files in the page cache):

* ``mixed``: ``configs/mixed_ar_dit.yaml`` (nine workers: SmolLM2 three times, the
  embedded DiT) started ``--starts`` times each way; ``ready_s`` is the median time from
  ``Pipeline(config)`` to its return (every worker ready), ``zygote_vs_spawn_ready`` their
  ratio (target <= 0.35). Once started, ``pss_mib`` sums the proportional set size
  (``Pss`` of ``/proc/PID/smaps_rollup``: a page shared by n processes counts 1/n in
  each) of every worker, and of the zygote when there is one; ``zygote_vs_spawn_pss``
  is their ratio (target <= 0.6). A run answers one request first, so that the figures
  are those of a pipeline that served.
* ``restart``: ``configs/ar_chat.yaml``; its ``generate`` worker (the one that decodes)
  is SIGKILLed ``--starts`` times, each time waiting until it is ``ready`` again;
  ``restart_ready_s`` is the median kill-to-ready time (it includes the stage's
  ``restart_backoff_s``, 0.5 s by default, on both sides: each kill is made a first
  crash, so the back-off does not double), ``zygote_vs_spawn_restart`` their ratio
  (target <= 0.3).
* ``demo``: the synthetic ``configs/demo.yaml`` (four stages, no model): ``ready_s``, the
  runtime's own floor.

Skipped (``{"skipped": why}``) where a config's stage families or models are missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import statistics
import time
from typing import Any

import msgspec
from omni_core import Pipeline, load_config
from omni_core.config import PipelineConfig

from omni_bench.report import emit, run_arms

ARMS = ("mixed", "restart", "demo")
MIXED, CHAT, DEMO = "configs/mixed_ar_dit.yaml", "configs/ar_chat.yaml", "configs/demo.yaml"
METHODS = ("zygote", "spawn")
TARGETS = {"ready": 0.35, "restart": 0.3, "pss": 0.6}


def configured(path: str, method: str, **stage_fields: Any) -> PipelineConfig:
    """``path`` with ``backend.start: method`` (and ``stage_fields`` on every stage)."""
    cfg = load_config(path)
    cfg = msgspec.structs.replace(cfg, backend=msgspec.structs.replace(cfg.backend, start=method))
    if stage_fields:
        stages = [msgspec.structs.replace(s, **stage_fields) for s in cfg.stages]
        cfg = msgspec.structs.replace(cfg, stages=stages)
    return cfg


def pss_mib(pids: list[int]) -> float:
    """Summed ``Pss`` of these processes, MiB."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
    return total / 1024


def missing(*modules: str) -> str:
    """Why an arm cannot run: a family not installed, or SmolLM2 not pulled."""
    gone = [m for m in modules if importlib.util.find_spec(m) is None]
    if gone:
        return f"not installed: {', '.join(gone)}"
    from omni_ar.models import packaged_model_ready

    return (
        ""
        if packaged_model_ready("smollm2")
        else "SmolLM2 is not pulled (omni models pull smollm2)"
    )


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def started(cfg: PipelineConfig, request: dict[str, Any] | None) -> tuple[float, float]:
    """(seconds to start, summed PSS MiB of its processes after one request)."""
    t0 = time.monotonic()
    with Pipeline(cfg) as pipe:
        ready = time.monotonic() - t0
        if request is not None:
            out = pipe.generate([request])[0]
            if out.finish_reason != "completed":
                raise RuntimeError(f"the request failed: {out.finish_reason}: {out.error}")
        pids = [p for p in pipe.pids().values() if p]
        z = pipe.zygote()
        if z is not None and z.get("pid"):
            pids.append(z["pid"])
        return ready, pss_mib(pids)


def start_arm(path: str, starts: int, request: dict[str, Any] | None) -> dict[str, Any]:
    for method in METHODS:  # warm-up
        started(configured(path, method), None)
    ready: dict[str, list[float]] = {m: [] for m in METHODS}
    pss: dict[str, float] = {}
    for i in range(starts):
        for method in METHODS:
            r, p = started(configured(path, method), request if i == 0 else None)
            ready[method].append(r)
            if i == 0:
                pss[method] = p
    res: dict[str, Any] = {"config": path, "starts": starts}
    for m in METHODS:
        res[f"ready_s_{m}"] = round(statistics.median(ready[m]), 3)
        res[f"ready_s_{m}_all"] = [round(x, 3) for x in ready[m]]
    res["zygote_vs_spawn_ready"] = ratio(res["ready_s_zygote"], res["ready_s_spawn"])
    if request is not None:
        for m in METHODS:
            res[f"pss_mib_{m}"] = round(pss[m], 1)
        res["zygote_vs_spawn_pss"] = ratio(pss["zygote"], pss["spawn"])
    return res


def restarts(path: str, stage: str, kills: int, method: str, limit_s: float) -> list[float]:
    """Kill-to-ready seconds of ``kills`` SIGKILLs of ``stage``'s worker."""
    # each kill is a first crash: the back-off (doubling per restart within the window)
    # is the stage's first, restart_backoff_s, every time
    cfg = configured(path, method, restart_window_s=0.01)
    out = []
    with Pipeline(cfg) as pipe:
        for _ in range(kills):
            pid = pipe.pids()[stage]
            assert pid is not None
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while True:
                h = pipe.health()[stage]
                if h["pid"] != pid and h["state"] == "ready":
                    break
                if time.monotonic() - t0 > limit_s:
                    raise RuntimeError(f"{stage} was not ready {limit_s:g} s after its kill: {h}")
                time.sleep(0.01)
            out.append(time.monotonic() - t0)
    return out


def restart_arm(path: str, kills: int, limit_s: float) -> dict[str, Any]:
    backoff = load_config(path).stage("generate").restart_backoff_s
    res: dict[str, Any] = {"config": path, "stage": "generate", "kills": kills}
    res["restart_backoff_s"] = backoff
    for method in METHODS:
        times = restarts(path, "generate", kills, method, limit_s)
        res[f"restart_ready_s_{method}"] = round(statistics.median(times), 3)
        res[f"restart_ready_s_{method}_all"] = [round(x, 3) for x in times]
    res["zygote_vs_spawn_restart"] = ratio(
        res["restart_ready_s_zygote"], res["restart_ready_s_spawn"]
    )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench start", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--arms", default=",".join(ARMS), help="any of " + ", ".join(ARMS))
    ap.add_argument("--starts", type=int, default=3, help="starts (kills) per way")
    ap.add_argument("--restart-limit-s", type=float, default=120.0)
    args = ap.parse_args(argv)

    def mixed() -> dict[str, Any]:
        why = missing("omni_ar", "omni_dit", "diffusers")
        prompt = {"prompt": "draw me a red square on green"}
        return {"skipped": why} if why else start_arm(MIXED, args.starts, prompt)

    def restart() -> dict[str, Any]:
        why = missing("omni_ar")
        return {"skipped": why} if why else restart_arm(CHAT, args.starts, args.restart_limit_s)

    def demo() -> dict[str, Any]:
        return start_arm(DEMO, args.starts, None)

    res, failed = run_arms(args.arms, {"mixed": mixed, "restart": restart, "demo": demo}, ap.error)
    met = {
        "ready": res.get("mixed", {}).get("zygote_vs_spawn_ready"),
        "restart": res.get("restart", {}).get("zygote_vs_spawn_restart"),
        "pss": res.get("mixed", {}).get("zygote_vs_spawn_pss"),
    }
    res["targets"] = {
        k: {"ratio": v, "target": TARGETS[k], "met": v is not None and v <= TARGETS[k]}
        for k, v in met.items()
    }
    emit(res, args.json)
    return 1 if failed else 0
