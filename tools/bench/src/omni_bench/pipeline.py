"""``omni bench pipeline``: do stages work on different requests at the same time?

Four ``synthetic.sleep`` stages in a chain each hold a request for ``t`` seconds. With
perfect pipelining, requests complete at one per ``t`` once the pipe is full
(``ideal_rps = 1/t``); run serially (``mrs.enabled: false``, the same stages in one
process) they complete at one per ``4t``. ``throughput_rps`` is the steady-state completion
rate, (N-1) over the time between the first and the last completion; ``makespan_rps`` is
N over the whole run, including filling and draining the pipe.
"""

from __future__ import annotations

import argparse
import time

from omni_core import Pipeline
from omni_testing.configs import chain

from omni_bench.report import emit


def _config(hold_s: float, stages: int, enabled: bool) -> dict:
    return chain(
        *[(f"s{i}", "synthetic.sleep", {"hold_s": hold_s}) for i in range(stages)],
        mrs={"enabled": enabled},
    )


def run(hold_s: float, stages: int, requests: int, enabled: bool) -> tuple[float, float]:
    with Pipeline(_config(hold_s, stages, enabled)) as pipe:
        pipe.generate([{}])  # warm up
        t0 = time.monotonic()
        handles = [pipe.submit({}) for _ in range(requests)]
        done = []
        for h in handles:
            for ev in h:
                if ev.terminal:
                    if ev.event_type != "completed":
                        raise RuntimeError(f"bench request failed: {ev}")
                    done.append(time.monotonic())
        total = time.monotonic() - t0
    done.sort()
    steady = (len(done) - 1) / (done[-1] - done[0]) if len(done) > 1 else float("nan")
    return steady, requests / total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench pipeline", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hold", type=float, default=0.05, help="seconds each stage holds a request")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--serial-requests", type=int, default=16)
    args = ap.parse_args(argv)
    throughput, makespan = run(args.hold, args.stages, args.requests, True)
    _, serial = run(args.hold, args.stages, args.serial_requests, False)
    ideal = 1.0 / args.hold
    res = {
        "throughput_rps": round(throughput, 3),
        "makespan_rps": round(makespan, 3),
        "ideal_rps": round(ideal, 3),
        "serial_rps": round(serial, 3),
        "throughput_vs_ideal": round(throughput / ideal, 3),
        "stages": args.stages,
        "hold_s": args.hold,
        "requests": args.requests,
        "targets_met": {"throughput_rps >= 0.95 x ideal_rps": throughput >= 0.95 * ideal},
    }
    emit(res, args.json)
    return 0
