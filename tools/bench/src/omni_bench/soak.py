"""``omni bench soak``: does the runtime stay whole under a long, messy load?

A bounded soak over a three-stage synthetic pipeline: a ``synthetic.source`` streams
``n`` tokens in segments of 4, each with a 128 KiB array (over the shared-memory threshold,
so every segment rents a slot, read by the next stage and by the caller, who sees the
source's segments too); a ``synthetic.map`` takes them in windows of 8; a second
``synthetic.map`` (the sink, ``+1``) streams the result to the caller. ``--concurrency``
client threads keep that many requests in flight, each bounded by ``--timeout-s``, until
``--requests`` have been tried or ``--duration-s`` has passed. ``--cancel-fraction`` of
them are cancelled at a random point (after a short random sleep, or on their first
event), and every ``--kill-interval-s`` a random stage worker gets SIGKILL. Stages get
``max_restarts``/``restart_backoff_s`` when the runtime knows those keys.

Every request tried is accounted once: ``completed``, ``cancelled`` (cancelled or timed out;
``timeouts`` counts the latter), ``errored`` (an error terminal, e.g. its stage died),
``rejected`` (``submit`` raised) or ``lost`` (no terminal event by ``--lost-grace-s`` after
the last submit). ``mismatched`` counts completed requests whose tokens or arrays were
wrong. ``rss_growth_pct`` is this process's (the orchestrator's) resident memory at the
end against after the first 10% of requests, both after ``gc.collect()``;
``shm_segments_left`` counts the shared-memory segments of this process still present
after the pipeline closed.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from omni_core import Pipeline
from omni_core.dataplane.shm import list_segments
from omni_testing.configs import chain

from omni_bench.report import emit

KIB = 1 << 10
MB = 1 << 20


def config(delay_s: float, array_bytes: int, max_restarts: int, backoff_s: float) -> dict[str, Any]:
    """The soak pipeline: source -> map -> sink, each allowed ``max_restarts``."""
    extra: dict[str, Any] = {"max_restarts": max_restarts, "restart_backoff_s": backoff_s}
    return chain(
        (
            "src",
            "synthetic.source",
            {"segment": 4, "delay_s": delay_s, "array_bytes": array_bytes},
            {"client_stream": True, **extra},
        ),
        ("map", "synthetic.map", {}, dict(extra)),
        ("sink", "synthetic.map", {"offset": 1}, dict(extra)),
        edges=[
            {"from": "src", "to": "map", "window": {"size": 8}},
            {"from": "map", "to": "sink", "window": {"size": 8}},
        ],
        shm_pool_bytes=256 * MB,
    )


def rss_bytes() -> int:
    """Resident memory of this process (psutil if installed, else /proc/self/statm)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


def rss_shmem_bytes() -> int | None:
    """The part of the resident memory that is mapped shared memory (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * KIB
    except OSError:
        pass
    return None


def _mb(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / MB, 1)


def restarts(pipe: Pipeline) -> dict[str, int]:
    """Worker restarts per stage."""
    return {n: v["restarts"] for n, v in pipe.metrics()["stages"].items()}


@dataclass
class Plan:
    n: int
    start: int
    cancel: str | None  # None, "sleep" or "first_event"
    sleep_s: float


class Soak:
    def __init__(self, pipe: Pipeline, args: argparse.Namespace) -> None:
        self.pipe = pipe
        self.args = args
        rng = random.Random(args.seed)
        self.plans = []
        for _ in range(args.requests):
            mode = None
            if rng.random() < args.cancel_fraction:
                mode = rng.choice(("sleep", "first_event"))
            self.plans.append(
                Plan(rng.randint(4, 64), rng.randrange(1 << 20), mode, rng.uniform(0.0, 0.5))
            )
        self.kill_rng = random.Random(args.seed + 1)
        self.lock = threading.Lock()
        self.taken = 0
        self.exhausted = False
        self.last_submit = time.monotonic()
        self.outcomes: dict[int, str] = {}
        self.final = False  # set when the books close; later outcomes are not counted
        self.error_codes: Counter[str] = Counter()
        self.reject_reasons: Counter[str] = Counter()
        self.examples: dict[str, str] = {}  # the first message of each kind of failure
        self.timeouts = 0
        self.cancels_sent = 0
        self.mismatched = 0
        self.latencies: list[float] = []
        self.kills: Counter[str] = Counter()
        self.stop_kills = threading.Event()

    # -- client threads ----------------------------------------------------------
    def _next(self) -> int | None:
        with self.lock:
            if self.exhausted:
                return None
            if self.taken >= self.args.requests or time.monotonic() >= self.end_submit:
                self.exhausted = True
                return None
            i = self.taken
            self.taken += 1
            self.last_submit = time.monotonic()
            return i

    def _record(self, i: int, outcome: str) -> None:
        with self.lock:
            if not self.final:
                self.outcomes[i] = outcome

    def _await_healthy(self) -> None:
        """After a rejected submit, give a restarting stage a moment (bounded)."""
        end = time.monotonic() + self.args.recover_wait_s
        while time.monotonic() < end and not self.exhausted:
            try:
                if all(h.get("alive") for h in self.pipe.health().values()):
                    return
            except Exception:
                pass
            time.sleep(0.05)

    def client(self) -> None:
        while (i := self._next()) is not None:
            self._one(i, self.plans[i])

    def _one(self, i: int, plan: Plan) -> None:
        pipe, rid = self.pipe, f"soak-{i}"
        t0 = time.monotonic()
        try:
            h = pipe.submit({"n": plan.n, "start": plan.start}, rid, self.args.timeout_s)
        except Exception as e:
            with self.lock:
                self.reject_reasons[type(e).__name__] += 1
                self.examples.setdefault("rejected", f"{type(e).__name__}: {e}"[:300])
            self._record(i, "rejected")
            self._await_healthy()
            return
        if plan.cancel == "sleep":
            time.sleep(plan.sleep_s)
            self._cancel(rid)
        sink: list[int] = []
        src_ok = True
        first = True
        for ev in h:
            if ev.terminal:
                self._terminal(i, ev, plan, sink, src_ok, time.monotonic() - t0)
                return
            if first and plan.cancel == "first_event":
                self._cancel(rid)
            first = False
            if ev.stage == "sink":
                sink.extend(ev.tokens or [])
            elif ev.stage == "src":
                src_ok = src_ok and _source_ok(ev, plan)

    def _cancel(self, rid: str) -> None:
        if self.pipe.cancel(rid):
            with self.lock:
                self.cancels_sent += 1

    def _terminal(
        self, i: int, ev: Any, plan: Plan, sink: list[int], src_ok: bool, latency: float
    ) -> None:
        kind = ev.event_type
        with self.lock:
            if self.final:
                return
            if kind == "completed":
                expected = list(range(plan.start + 1, plan.start + plan.n + 1))
                if sink != expected or not src_ok:
                    self.mismatched += 1
                self.latencies.append(latency)
                self.outcomes[i] = "completed"
            elif kind == "cancelled":
                if getattr(ev, "reason", "") == "timeout":
                    self.timeouts += 1
                self.outcomes[i] = "cancelled"
            else:
                self.error_codes[getattr(ev, "code", kind)] += 1
                self.examples.setdefault("errored", str(getattr(ev, "message", ev))[:300])
                self.outcomes[i] = "errored"

    # -- the killer --------------------------------------------------------------
    def killer(self) -> None:
        while not self.stop_kills.wait(self.args.kill_interval_s):
            try:
                alive = sorted(n for n, h in self.pipe.health().items() if h.get("alive"))
                if not alive:
                    continue
                name = self.kill_rng.choice(alive)
                os.kill(self.pipe.backend.pids()[name], signal.SIGKILL)
            except (ProcessLookupError, KeyError):
                continue
            with self.lock:
                self.kills[name] += 1

    # -- the run -----------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        args = self.args
        t0 = time.monotonic()
        self.end_submit = t0 + args.duration_s
        threads = [
            threading.Thread(target=self.client, name=f"soak-client-{k}", daemon=True)
            for k in range(args.concurrency)
        ]
        for t in threads:
            t.start()
        killer = None
        if args.kill_interval_s > 0:
            killer = threading.Thread(target=self.killer, name="soak-killer", daemon=True)
            killer.start()
        warm_at = max(1, args.requests // 10)
        rss_warm = shm_warm = None
        while any(t.is_alive() for t in threads):
            if time.monotonic() >= self.end_submit:
                with self.lock:
                    self.exhausted = True
            if self.exhausted:
                self.stop_kills.set()
                if time.monotonic() > self.last_submit + args.lost_grace_s:
                    break  # whatever is still open is lost
            if rss_warm is None and len(self.outcomes) >= warm_at:
                gc.collect()
                rss_warm, shm_warm = rss_bytes(), rss_shmem_bytes()
            time.sleep(0.05)
        self.stop_kills.set()
        if killer is not None:
            killer.join()
        wall = time.monotonic() - t0
        with self.lock:
            self.final = True
            outcomes = Counter(self.outcomes.values())
            requests = self.taken
        gc.collect()
        rss_end, shm_end = rss_bytes(), rss_shmem_bytes()
        health = self.pipe.health()
        restarted = restarts(self.pipe)
        lat = sorted(self.latencies)
        return {
            "requests": requests,
            "completed": outcomes["completed"],
            "cancelled": outcomes["cancelled"],
            "errored": outcomes["errored"],
            "rejected": outcomes["rejected"],
            "lost": requests - sum(outcomes.values()),
            "timeouts": self.timeouts,
            "cancels_sent": self.cancels_sent,
            "mismatched": self.mismatched,
            "error_codes": dict(self.error_codes),
            "reject_reasons": dict(self.reject_reasons),
            "examples": dict(self.examples),
            "kills": sum(self.kills.values()),
            "kills_by_stage": dict(self.kills),
            "restarts": sum(restarted.values()),
            "restarts_by_stage": restarted,
            "dead_stages_at_end": sorted(n for n, h in health.items() if not h.get("alive")),
            "rss_warm_mb": _mb(rss_warm),
            "rss_end_mb": _mb(rss_end),
            "rss_shmem_warm_mb": _mb(shm_warm),  # of which mapped shared memory
            "rss_shmem_end_mb": _mb(shm_end),
            "rss_growth_pct": (
                None if rss_warm is None else round(100 * (rss_end - rss_warm) / rss_warm, 2)
            ),
            "latency_p50_s": round(lat[len(lat) // 2], 4) if lat else None,
            "latency_p99_s": round(lat[min(len(lat) - 1, len(lat) * 99 // 100)], 4)
            if lat
            else None,
            "completed_per_s": round(outcomes["completed"] / wall, 2),
            "wall_s": round(wall, 2),
        }


def _source_ok(ev: Any, plan: Plan) -> bool:
    """A source segment's tokens are the next run of the request, its array their fill."""
    toks = ev.tokens or []
    if not toks:
        return True
    lo = toks[0] - plan.start
    data = ev.arrays.get("data")
    return (
        toks == list(range(toks[0], toks[0] + len(toks)))
        and data is not None
        and bool((data[::4096] == lo % 251).all())
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench soak", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ap.add_argument("--cancel-fraction", type=float, default=0.2)
    ap.add_argument(
        "--kill-interval-s", type=float, default=60.0, help="SIGKILL a stage worker; 0: never"
    )
    ap.add_argument(
        "--duration-s", type=float, default=300.0, help="no new requests after this long"
    )
    ap.add_argument("--timeout-s", type=float, default=30.0, help="per-request timeout")
    ap.add_argument(
        "--lost-grace-s", type=float, default=60.0, help="after the last submit: still open = lost"
    )
    ap.add_argument(
        "--recover-wait-s",
        type=float,
        default=5.0,
        help="after a rejected submit, wait up to this long for every stage to be alive",
    )
    ap.add_argument("--delay-s", type=float, default=0.008, help="source's sleep per segment")
    ap.add_argument("--array-kib", type=int, default=128, help="array per source segment")
    ap.add_argument("--max-restarts", type=int, default=1000)
    ap.add_argument("--restart-backoff-s", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = config(args.delay_s, args.array_kib * KIB, args.max_restarts, args.restart_backoff_s)
    with Pipeline(cfg) as pipe:
        res = Soak(pipe, args).run()
    res["shm_segments_left"] = len(list_segments(os.getpid()))
    growth = res["rss_growth_pct"]
    res["targets_met"] = {
        "lost == 0": res["lost"] == 0,
        "shm_segments_left == 0": res["shm_segments_left"] == 0,
        "rss_growth_pct <= 5": growth is not None and growth <= 5,
    }
    emit(res, args.json)
    return 0
