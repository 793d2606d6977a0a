"""A Ray Client driver for test_ray_client.py: ``python ray_client_driver.py ray://HOST:PORT
GCS_ADDRESS``.

It must be a process of its own (a Ray Client driver cannot share one with a normal
driver). It runs each scenario against the ``ray://`` address (and, for comparison, the
local backend) and prints one line ``RESULT <json>`` that the test checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import traceback

import numpy as np
from omni_core import Pipeline
from omni_core.errors import RuntimeFailedError
from omni_ray.testing import on
from omni_testing.configs import chain
from test_ray_backend import ARRAYS, DAG, summary

ADDRESS, GCS = sys.argv[1:3]  # ray://host:port, the cluster's GCS address
SLOW = chain(
    ("src", "synthetic.source", {"segment": 1, "delay_s": 0.02}, on("node_a")),
    ("map", "synthetic.map", {"delay_s": 0.02}, {**on("node_b"), "restart_backoff_s": 0.2}),
    edges=[{"from": "src", "to": "map", "window": {"size": 1}}],
    heartbeat_interval_s=0.1,
)
TO_CALLER = chain(("arrays", "synthetic.array_source", {}, on("node_b")))
FAULTY = chain(
    ("src", "synthetic.source", {}, on("node_a")),
    ("f", "synthetic.faulty", {}, on("node_b")),
)


def remote(cfg):
    return Pipeline(cfg, backend="ray", address=ADDRESS)


def wait(cond, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.05)
    return cond()


def same_outputs():
    out = {}
    for name, cfg, requests in (
        ("dag", DAG, [{"n": n, "start": n} for n in (1, 7, 20, 33)]),
        ("arrays", ARRAYS, [{"count": 40}, {"count": 3, "nbytes": 100_000}]),
    ):
        with Pipeline(cfg, backend="local") as pipe:
            local = [summary(o) for o in pipe.generate(requests)]
        with remote(cfg) as pipe:
            got = [summary(o) for o in pipe.generate(requests)]
        out[name] = json.loads(json.dumps(got)) == json.loads(json.dumps(local))
    return out


def arrays_arrive():
    checks = []
    with remote(TO_CALLER) as pipe:
        for nbytes, count in ((256 << 10, 3), (5 << 20, 2)):  # in frames; the object store
            out = pipe.generate([{"nbytes": nbytes, "count": count}])[0]
            assert out.ok, out.error
            for ev in out.events:
                a = ev.arrays["data"]
                checks.append(
                    isinstance(a, np.ndarray)
                    and a.flags.writeable  # a copy: a shared-memory view is read-only
                    and np.array_equal(a, np.arange(nbytes, dtype=np.uint8))
                )
        pipeline_id = pipe.backend.info["pipeline_id"]

        async def via_asyncio():
            return [ev.event_type async for ev in pipe.astream({"nbytes": 10, "count": 2})]

        types = asyncio.run(via_asyncio())
    return {"checks": checks, "astream": types, "pipeline_id": pipeline_id}


def cancel_and_timeout():
    with remote(SLOW) as pipe:
        handle = pipe.submit({"n": 500})
        first = next(iter(handle))
        acks = pipe.metrics()["cancel_acks"]
        cancelled = pipe.cancel(handle.request_id)
        events = list(handle)
        acked = wait(lambda: pipe.metrics()["cancel_acks"] >= acks + 2, 10)
        timeout = pipe.generate([{"n": 500}], timeout_s=0.5)[0].finish_reason
        ok = pipe.generate([{"n": 6}])[0]
        return {
            "first": first.stage,
            "cancelled": cancelled,
            "terminal": [e.event_type for e in events if e.terminal],
            "acked": acked,
            "timeout": timeout,
            "after": [t for e in ok.by_stage("map") for t in e.tokens],
            "metrics_in_flight": pipe.metrics()["in_flight"],
        }


def bad_request_fails_alone():
    with remote(FAULTY) as pipe:
        outs = pipe.generate([{"n": 3}, {"n": 3, "fail": True}, {"n": 3}])
        try:
            pipe.submit({"x": object()})
            unserializable = "accepted"
        except TypeError as e:
            unserializable = str(e)
        return {
            "reasons": [o.finish_reason for o in outs],
            "error": outs[1].error,
            "unserializable": unserializable,
            "healthy": pipe.healthy,
        }


def stage_worker_killed():
    with remote(SLOW) as pipe:
        handle = pipe.submit({"n": 500})
        next(iter(handle))
        os.kill(pipe.health()["map"]["pid"], signal.SIGKILL)  # the simulated nodes are here
        last = list(handle)[-1]
        back = wait(lambda: pipe.healthy, 30)
        ok = pipe.generate([{"n": 4}])[0]
        return {
            "last": [last.event_type, last.stage],
            "back": back,
            "after": ok.ok,
            "restarts": pipe.health()["map"]["restarts"],
        }


def orchestrator_actor_killed():
    import ray

    pipe = remote(SLOW).start()
    handle = pipe.submit({"n": 500})
    next(iter(handle))
    t0 = time.monotonic()
    ray.kill(pipe.backend.actor, no_restart=True)
    last = list(handle)[-1]  # never hangs: the pump sees the actor die
    failed_in = time.monotonic() - t0
    try:
        pipe.submit({"n": 1})
        refused = ""
    except RuntimeFailedError as e:
        refused = str(e)
    res = {
        "last": [last.event_type, last.code, last.message],
        "failed_in_s": failed_in,
        "healthy": pipe.healthy,
        "failure": pipe.failure,
        "refused": refused,
        "pipeline_id": pipe.backend.info["pipeline_id"],
    }
    t0 = time.monotonic()
    pipe.close()
    res["close_s"] = time.monotonic() - t0
    return res


def connection_lost():
    """The client server's process for this client dies (what a lost connection comes to
    once Ray Client's reconnect grace period passed): the open request fails."""
    import psutil

    started = time.time() - 1
    pipe = remote(SLOW).start()
    handle = pipe.submit({"n": 5000})
    next(iter(handle))
    servers = [  # the one for this client: of this cluster, made since (earlier ones linger)
        p
        for p in psutil.process_iter(["cmdline", "create_time"])
        if any("specific-server" in c for c in p.info["cmdline"] or [])
        and any(GCS in c for c in p.info["cmdline"])
        and p.info["create_time"] >= started
    ]
    for p in servers:
        p.kill()
    t0 = time.monotonic()
    last = list(handle)[-1]
    res = {
        "servers": len(servers),
        "last": [last.event_type, last.code, last.message],
        "failed_in_s": time.monotonic() - t0,
        "healthy": pipe.healthy,
        "pipeline_id": pipe.backend.info["pipeline_id"],
    }
    t0 = time.monotonic()
    pipe.close()
    res["close_s"] = time.monotonic() - t0
    return res


def main():
    results = {}
    only = sys.argv[3:]  # scenario names to run (default: all)
    for fn in (
        same_outputs,
        arrays_arrive,
        cancel_and_timeout,
        bad_request_fails_alone,
        stage_worker_killed,
        orchestrator_actor_killed,
        connection_lost,  # last: it kills the client server's process for this client
    ):
        if only and fn.__name__ not in only:
            continue
        t0 = time.monotonic()
        try:
            results[fn.__name__] = fn()
        except Exception:
            results[fn.__name__] = {"exception": traceback.format_exc()}
        print(f"{fn.__name__}: {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
