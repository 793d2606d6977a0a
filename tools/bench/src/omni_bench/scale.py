"""``omni bench scale``: do stage replicas add throughput, survive a crash, follow the load?

A stage's ``replicas`` runs it as several workers (``STAGE#0``, ``STAGE#1``, ...), each
request bound to one of them. Arms (``--arms``, all by default):

* ``cpu``: ``synthetic.source`` (one token) -> ``work`` (``synthetic.spin``: pure-Python
  work on one thread, about 50 ms a request, ``OMP_NUM_THREADS=1``), with ``replicas: 1``
  then ``replicas: 2``; the same ``--requests`` requests at ``--concurrency`` in flight
  each time, after a warm-up. ``replicas2_vs_1_throughput`` is the ratio of their
  requests/s (completions over the time from the first submit to the last completion);
  target >= 1.7 on 2 cores.
* ``dit``: ``configs/dit_image.yaml`` as shipped (SmolLM2 text encoder, the embedded
  ``tiny-sd3-shapes``), its ``sample`` stage with ``replicas`` 1 then 2, images/s at
  ``--concurrency`` (``--dit-requests`` requests, after a warm-up); reported, no target.
  Skipped (``{"skipped": why}``) where the DiT family, diffusers or either model is missing.
* ``kill``: the ``cpu`` pipeline with ``replicas: 2`` under steady load for
  ``--kill-before-s``; then ``work#1`` is SIGKILLed and the load goes on until its
  restarted worker is ``ready`` again, and ``--kill-after-s`` more. ``restart_s`` is kill
  to ready; ``during_restart_vs_before`` is the completion rate in that window over the
  rate before the kill (target >= 0.4): the other replica takes the load, and the
  killed one's requests are replayed (``synthetic.spin`` is idempotent).
* ``autoscale``: the ``cpu`` pipeline with ``replicas: {min: 1, max: 2, target: 2,
  upscale_delay_s: 0.5, downscale_delay_s: 2}`` and a load step (``--step``: 1 request in
  flight for 3 s, 16 for 8 s, 1 for 8 s), ``metrics()["replicas"]["work"]["live"]``
  and ``["ready"]`` sampled every 100 ms: how long after each step the live count followed
  (``scale_up_after_step_s``, ``scale_down_after_step_s``; ``ready_after_step_s``: until
  the second replica was ready), the changes as ``[s, live, ready]``
  (``timeline_live_ready``), and ``segments_left``, the shared-memory files of this
  process that are in ``/dev/shm`` after the pipeline closed and were not before.

``lost`` counts the requests that did not complete: no terminal event by their deadline
(``--timeout-s``) plus 10 s, an error or timeout, or a rejected submit. Targets:
``lost == 0`` in every arm, ``segments_left == 0``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import signal
import threading
import time
from collections import Counter
from typing import Any

import msgspec
from omni_core import Pipeline
from omni_core.dataplane.shm import list_segments
from omni_testing.configs import chain

from omni_bench.chaos import GRACE_LOST_S, Books
from omni_bench.dit import CONFIGS, staged
from omni_bench.report import emit, run_arms

ARMS = ("cpu", "dit", "kill", "autoscale")
STAGE = "work"  # the replicated stage of the synthetic arms
AUTOSCALE = {"min": 1, "max": 2, "target": 2, "upscale_delay_s": 0.5, "downscale_delay_s": 2}


def cpu_config(replicas: int | dict[str, Any], work: int | None) -> dict[str, Any]:
    """source (one token a request) -> ``work`` (``synthetic.spin``) with ``replicas``."""
    spin: dict[str, Any] = {"extra_env": {"OMP_NUM_THREADS": "1"}}
    if replicas != 1:  # 1 is the default: left out, the config is the plain one
        spin["replicas"] = replicas
    return chain(
        ("src", "synthetic.source", {"tokens": 1, "segment": 1}),
        (STAGE, "synthetic.spin", {} if work is None else {"work": work}, spin),
    )


class Load:
    """``clients`` threads submitting one request after another, of which the first
    ``level`` are active (the others wait): ``level`` requests in flight. With
    ``requests`` set, that many in all, then the threads end. Every request is accounted
    in ``books``; ``done`` holds completion times, ``pids`` which worker served how many."""

    def __init__(
        self, pipe: Pipeline, clients: int, timeout_s: float, requests: int | None = None
    ) -> None:
        self.pipe = pipe
        self.timeout_s = timeout_s
        self.level = clients
        self.left = requests
        self.books = Books()
        self.done: list[float] = []
        self.pids: Counter[int] = Counter()
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)
        ]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def _take(self) -> bool:
        with self.lock:
            if self.left is None:
                return True
            if self.left <= 0:
                return False
            self.left -= 1
            return True

    def _client(self, k: int) -> None:
        while not self.halt.is_set():
            if k >= self.level:
                self.halt.wait(0.01)
            elif not self._take():
                return
            else:
                self._one()

    def _one(self) -> None:
        books = self.books
        i = books.begin(self.timeout_s)
        try:
            h = self.pipe.submit({}, timeout_s=self.timeout_s)
        except Exception as e:  # OverloadedError, or the runtime failed
            books.end(i, "rejected", type(e).__name__, str(e))
            return
        pid = None
        for ev in h:
            pid = (getattr(ev, "payload", None) or {}).get("pid", pid)
            if not ev.terminal:
                continue
            if ev.event_type == "completed":
                with self.lock:
                    self.done.append(time.monotonic())
                    self.pids[pid] += 1
            books.end_with(i, ev)
            return
        books.end(i, "errored", "no_terminal", "the stream ended without a terminal event")

    def join(self) -> None:
        """Wait for a ``requests``-limited load to end."""
        for t in self.threads:
            t.join(self.timeout_s + GRACE_LOST_S)

    def finish(self) -> dict[str, Any]:
        """Stop submitting, wait for what is in flight; the books."""
        self.halt.set()
        end = time.monotonic() + self.timeout_s + GRACE_LOST_S
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        self.books.lost(time.monotonic(), final=True)
        o = self.books.outcomes
        res = {
            "requests": self.books.n,
            "completed": o["completed"],
            "lost": o["lost"] + o["errored"] + o["rejected"],
            "errored": dict(self.books.errors),
            "no_terminal_event": o["lost"],
            "served_by_pids": len([p for p in self.pids if p is not None]),
        }
        if self.books.examples:
            res["error_examples"] = self.books.examples
        return res

    def rate(self, t0: float, t1: float) -> float:
        """Completions per second in [t0, t1)."""
        with self.lock:
            n = sum(1 for t in self.done if t0 <= t < t1)
        return n / (t1 - t0) if t1 > t0 else float("nan")


def worker_pids(pipe: Pipeline) -> dict[str, int | None]:
    """Worker name -> pid: ``Pipeline.pids()`` (the replicas' API), else health's pids."""
    pids = getattr(pipe, "pids", None)
    if pids is not None:
        return dict(pids())
    return {n: h.get("pid") for n, h in pipe.health().items()}


def warm_up(pipe: Pipeline, concurrency: int, timeout_s: float) -> None:
    """``concurrency`` requests at once, so that every replica has served."""
    for out in pipe.generate([{}] * concurrency, timeout_s=timeout_s):
        if not out.ok:
            raise RuntimeError(f"warm-up request {out.finish_reason}: {out.error}")


# -- arms ---------------------------------------------------------------------------------
def cpu_arm(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for n in (1, 2):
        with Pipeline(cpu_config(n, args.work)) as pipe:
            warm_up(pipe, args.concurrency, args.timeout_s)
            load = Load(pipe, args.concurrency, args.timeout_s, requests=args.requests)
            t0 = time.monotonic()
            load.start().join()
            books = load.finish()
        wall = (max(load.done) if load.done else time.monotonic()) - t0
        res[f"rps_replicas{n}"] = round(books["completed"] / wall, 3)
        res[f"replicas{n}"] = books
    ratio = res["rps_replicas2"] / res["rps_replicas1"] if res["rps_replicas1"] else 0.0
    res["replicas2_vs_1_throughput"] = round(ratio, 3)
    res["lost"] = res["replicas1"]["lost"] + res["replicas2"]["lost"]
    res["target_met"] = ratio >= 1.7
    return res


def dit_missing() -> str | None:
    """Why the ``dit`` arm cannot run here, or None."""
    for module in ("diffusers", "omni_dit", "omni_ar"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    from omni_core.models.named_models import installed_models

    ready = {m.name for m in installed_models() if m.locate() is not None}
    for name in ("smollm2", "tiny-sd3-shapes"):
        if name not in ready:
            return f"model {name} is not pulled (omni models pull {name})"
    return None


def dit_arm(args: argparse.Namespace) -> dict[str, Any]:
    why = dit_missing()
    if why is not None:
        return {"skipped": why}
    from omni_core import load_config
    from omni_dit.shapes import HELD_OUT

    reqs = [
        {"prompt": HELD_OUT[i % len(HELD_OUT)].caption(), "image": {"seed": i}}
        for i in range(args.dit_requests)
    ]
    cfg = load_config(CONFIGS / "dit_image.yaml")
    res: dict[str, Any] = {}
    # as shipped (sample batches up to 8 alike requests per forward), then with batching
    # off (max_batch_size 1): where replicas help, and where one batching engine is better
    for label, batch in (("", None), ("batch1_", 1)):
        for n in (1, 2):
            stages = []
            for s in cfg.stages:
                if s.name == "sample":
                    s = msgspec.structs.replace(s, replicas=n)
                    if batch is not None:
                        s = msgspec.structs.replace(s, max_batch_size=batch)
                stages.append(s)
            with Pipeline(msgspec.structs.replace(cfg, stages=stages)) as pipe:
                rate = staged(pipe, reqs, args.concurrency)
            res[f"{label}img_per_s_replicas{n}"] = round(rate, 3)
        one, two = res[f"{label}img_per_s_replicas1"], res[f"{label}img_per_s_replicas2"]
        res[f"{label}replicas2_vs_1_throughput"] = round(two / one, 3)
    res["requests"] = len(reqs)
    return res


def kill_arm(args: argparse.Namespace) -> dict[str, Any]:
    victim = f"{STAGE}#1"
    with Pipeline(cpu_config(2, args.work)) as pipe:
        warm_up(pipe, args.concurrency, args.timeout_s)
        load = Load(pipe, args.concurrency, args.timeout_s).start()
        t_start = time.monotonic()
        time.sleep(args.kill_before_s)
        old = worker_pids(pipe)[victim]
        t_kill = time.monotonic()
        os.kill(old, signal.SIGKILL)
        states: list[str] = []
        t_ready = None
        end = t_kill + args.restart_limit_s
        while time.monotonic() < end:
            h = pipe.health()[victim]
            if not states or states[-1] != h["state"]:
                states.append(h["state"])
            left_ready = len(states) > 1 or h.get("pid") not in (None, old)
            if h["state"] == "ready" and left_ready:
                t_ready = time.monotonic()
                break
            time.sleep(0.02)
        t_after = time.monotonic()
        time.sleep(args.kill_after_s)
        t_end = time.monotonic()
        books = load.finish()
        restarts = {n: h.get("restarts") for n, h in pipe.health().items()}
    warm = min(1.0, args.kill_before_s / 2)  # the load's own ramp, not counted
    before = load.rate(t_start + warm, t_kill)
    during = load.rate(t_kill, t_ready) if t_ready is not None else 0.0
    res = {
        **books,
        "rps_before": round(before, 3),
        "rps_during_restart": round(during, 3),
        "rps_after": round(load.rate(t_after, t_end), 3),
        "during_restart_vs_before": round(during / before, 3) if before else 0.0,
        "restart_s": round(t_ready - t_kill, 3) if t_ready is not None else None,
        "states_seen": states,
        "restarts": restarts,
    }
    res["target_met"] = (
        t_ready is not None and res["lost"] == 0 and res["during_restart_vs_before"] >= 0.4
    )
    return res


def autoscale_arm(args: argparse.Namespace) -> dict[str, Any]:
    low1, high, low2 = args.step
    before = set(list_segments(os.getpid()))
    seen: set[str] = set()
    samples: list[tuple[float, int, int]] = []  # (when, live, ready)
    errors: Counter[str] = Counter()
    stop = threading.Event()
    with Pipeline(cpu_config(dict(AUTOSCALE), args.work)) as pipe:

        def sampler() -> None:
            while not stop.wait(0.1):
                try:
                    r = pipe.metrics()["replicas"][STAGE]
                except Exception as e:  # reported, the run goes on
                    errors[f"{type(e).__name__}: {e}"[:200]] += 1
                    continue
                samples.append((time.monotonic(), int(r["live"]), int(r["ready"])))
                seen.update(set(list_segments(os.getpid())) - before)

        warm_up(pipe, 1, args.timeout_s)
        load = Load(pipe, args.step_clients, args.timeout_s)
        load.level = 1
        probe = threading.Thread(target=sampler, daemon=True)
        t0 = time.monotonic()
        load.start()
        probe.start()
        time.sleep(low1)
        t_up = time.monotonic()
        load.level = args.step_clients
        time.sleep(high)
        t_down = time.monotonic()
        load.level = 1
        time.sleep(low2)
        stop.set()
        probe.join(5)
        books = load.finish()
    left = set(list_segments(os.getpid())) - before

    def first(after: float, count: int, key: int = 1) -> float | None:
        hits = (s[0] - after for s in samples if s[0] >= after and s[key] == count)
        return next((round(dt, 2) for dt in hits), None)

    timeline: list[list[float]] = []  # [seconds since the start, live, ready] at changes
    for t, live, ready in samples:
        if not timeline or timeline[-1][1:] != [live, ready]:
            timeline.append([round(t - t0, 2), live, ready])
    res = {
        **books,
        "scale_up_after_step_s": first(t_up, 2),
        "ready_after_step_s": first(t_up, 2, key=2),
        "scale_down_after_step_s": first(t_down, 1),
        "max_live": max((s[1] for s in samples), default=None),
        "timeline_live_ready": timeline,
        "rps_low": round(load.rate(t0, t_up), 3),
        "rps_high": round(load.rate(t_up + high / 2, t_down), 3),
        "samples": len(samples),
        "segments_seen": len(seen),
        "segments_left": len(left),
        "step_s": [low1, high, low2],
        "step_clients": args.step_clients,
    }
    if errors:
        res["sample_errors"] = dict(errors)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench scale", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--arms", default=",".join(ARMS), help="any of " + ", ".join(ARMS))
    ap.add_argument("--requests", type=int, default=96, help="cpu arm: requests per run")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--work", type=int, default=None, help="synthetic.spin's work per request")
    ap.add_argument("--dit-requests", type=int, default=32, help="dit arm: images per run")
    ap.add_argument("--kill-before-s", type=float, default=4.0, help="kill arm: load first")
    ap.add_argument("--kill-after-s", type=float, default=2.0, help="kill arm: load after")
    ap.add_argument("--restart-limit-s", type=float, default=60.0, help="kill arm: give up")
    ap.add_argument(
        "--step",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[3.0, 8.0, 8.0],
        help="autoscale arm: seconds at 1, at --step-clients, at 1 in flight",
    )
    ap.add_argument("--step-clients", type=int, default=16, help="autoscale arm: the step")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="per-request deadline")
    args = ap.parse_args(argv)
    arm_fns = {"cpu": cpu_arm, "dit": dit_arm, "kill": kill_arm, "autoscale": autoscale_arm}
    run = {name: functools.partial(fn, args) for name, fn in arm_fns.items()}
    res, failed = run_arms(args.arms, run, ap.error)
    targets = {}
    if "cpu" in res and "error" not in res["cpu"]:
        targets["cpu.replicas2_vs_1_throughput >= 1.7"] = res["cpu"]["target_met"]
    if "kill" in res and "error" not in res["kill"]:
        targets["kill.during_restart_vs_before >= 0.4"] = (
            res["kill"]["during_restart_vs_before"] >= 0.4
        )
    if "autoscale" in res and "error" not in res["autoscale"]:
        targets["autoscale.segments_left == 0"] = res["autoscale"]["segments_left"] == 0
    ran = [a for a in ("cpu", "kill", "autoscale") if a in res and "error" not in res[a]]
    if ran:
        targets["lost == 0"] = all(res[a]["lost"] == 0 for a in ran)
    res["targets_met"] = targets
    res["settings"] = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "work": args.work,
        "dit_requests": args.dit_requests,
    }
    emit(res, args.json)
    return 1 if failed else 0
