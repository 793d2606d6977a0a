"""``omni bench ipc``: stage-to-stage throughput of the runtime next to its baselines.

The runtime figures go through the real path: a ``synthetic.burst`` worker emits events
(``events_per_s_1k``: 64 per yield, as one step of a batched stage; ``_single_yield``: one
per yield); they leave through its sender and socket (small payloads inline, large arrays
written once into a shared-memory slot), and a ``synthetic.count`` worker takes them in
through its windows. Time runs from the burst's start to the last unit's arrival at the counter.
Baselines in the same run: ``multiprocessing.Queue`` between two processes (its 1 KB runs
interleaved with the runtime's, best of each kept, so a shared machine's drifting load
weighs on both alike), and a plain numpy copy of the same size (what one write into shared
memory costs at best).

``--backend ray`` measures the same figures on the Ray backend, on a cluster of two
simulated nodes started for the run (or ``--address``'s cluster, whose nodes must offer the
custom resources ``node_a`` and ``node_b``): both stages on one node (``ray_same_node``) and
one on each (``ray_cross_node``), next to the local backend's (``local``), and what Ray
itself achieves: a 64 MB numpy array as the argument of an actor call between two actors
(``ray_call_gbps_64m_same_node`` / ``_cross_node``, best of ``--repeat`` runs as the
runtime's; the cross-node runs interleaved with the runtime's, one after each of its 64
MB runs, so that a shared machine's drifting load weighs on both alike). Arrays from 4
MiB cross nodes through Ray's object store (put by the producer itself when every reader
is on another node);
``ray_objects_left`` counts the objects (and ``ray_object_bytes_left`` their bytes) still
in any node's object store after the cross-node runs, with the pipeline still up (Ray frees
asynchronously: up to 20 s are allowed for it), as ``ray memory --stats-only`` reports it.

What reaches the caller, from a ``synthetic.burst`` stage on the head node: 1 KB events
(``events_per_s_1k``, from the burst's start to the last event's arrival), 64 MB arrays
(``gbps_64m``; ``ray_get_gbps_64m``: what ``ray.get`` of a 64 MB array an actor returns
achieves, Ray's own figure for that caller) and a one-event request's round trip
(``rtt_ms``, the median), measured by
a driver in the cluster (``ray_driver``: the orchestrator in the caller's process) and by
a Ray Client driver in another process (``ray_client``: the orchestrator in an actor on
the head, events polled in batches over the client connection; the simulated head runs a
Ray Client server, or ``--client-address``), and ``ray_client_vs_driver``, their ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from omni_core import Pipeline
from omni_testing.configs import chain

from omni_bench.report import emit

MB = 1 << 20
CHUNK = 64  # events the producing stage yields per step (as a batched decode step does)


def _runtime_run(pipe: Pipeline, count: int, nbytes: int, chunk: int = 1) -> tuple[float, int]:
    out = pipe.generate([{"count": count, "nbytes": nbytes, "chunk": chunk}])[0]
    if not out.ok:
        raise RuntimeError(f"bench request failed: {out.error}")
    p = out.events[-1].payload
    if p["count"] != count or p["bytes"] != count * nbytes:
        raise RuntimeError(f"bench lost data: {p}")
    return p["t_end"] - p["t0"], p["bytes"]


def runtime_figures(
    events_1k: int,
    count_1m: int,
    count_64m: int,
    repeat: int,
    backend: str = "local",
    placement: tuple[dict[str, Any], dict[str, Any]] = ({}, {}),
    between: Callable[[], object] | None = None,
    after: Callable[[], dict[str, Any]] | None = None,
    between_64m: Callable[[], object] | None = None,
) -> dict[str, float]:
    """The runtime's figures; ``placement``: each stage's extra config (where it runs);
    ``between``: a baseline run after each round of event runs, so that both see the same
    machine (its load drifts on a shared host); ``between_64m``: the same after each run
    of 64 MB arrays; ``after``: what to measure once the array runs are done, the
    pipeline still up (merged into the figures)."""
    stages = (
        ("burst", "synthetic.burst", {}, placement[0]),
        ("count", "synthetic.count", {}, placement[1]),
    )
    cfg = chain(
        *stages,
        edges=[{"from": "burst", "to": "count", "window": {"size": 256}}],
        shm_pool_bytes=1 << 30,
    )

    res: dict[str, float] = {}
    with Pipeline(cfg, backend=backend) as pipe:
        _runtime_run(pipe, 2000, 1024)  # warm up
        chunked, single = [], []
        for _ in range(repeat):
            chunked.append(_runtime_run(pipe, events_1k, 1024, CHUNK)[0])
            single.append(_runtime_run(pipe, events_1k, 1024, 1)[0])
            if between is not None:
                between()
        res["events_per_s_1k"] = events_1k / min(chunked)
        res["events_per_s_1k_single_yield"] = events_1k / min(single)
    arrays = chain(
        *stages,
        edges=[{"from": "burst", "to": "count", "window": {"size": 1}}],
        shm_pool_bytes=1 << 30,
    )
    with Pipeline(arrays, backend=backend) as pipe:
        for key, count, nbytes in (("gbps_1m", count_1m, MB), ("gbps_64m", count_64m, 64 * MB)):
            _runtime_run(pipe, max(2, count // 4), nbytes)  # warm the slots' pages
            runs = []
            for _ in range(repeat):
                runs.append(_runtime_run(pipe, count, nbytes)[0])
                if between_64m is not None and nbytes == 64 * MB:
                    between_64m()
            res[key] = count * nbytes / min(runs) / 1e9
        if after is not None:
            res.update(after())
    return res


def _mp_producer(q: mp.Queue, count: int, nbytes: int) -> None:
    blob = bytes(nbytes)
    q.put(time.time())
    for _ in range(count):
        q.put(blob)
    q.put(None)


def mpqueue_seconds(count: int, nbytes: int) -> float:
    """Seconds ``count`` items of ``nbytes`` bytes take through a multiprocessing.Queue
    (from the spawned producer's first put to the last get)."""
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_mp_producer, args=(q, count, nbytes))
    p.start()
    t0 = q.get()
    while q.get() is not None:
        pass
    elapsed = time.time() - t0
    p.join()
    return elapsed


def mpqueue_figure(count: int, nbytes: int, repeat: int) -> float:
    """Items per second through a multiprocessing.Queue, best of ``repeat`` runs."""
    return count / min(mpqueue_seconds(count, nbytes) for _ in range(repeat))


def memcpy_figure(nbytes: int, repeat: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench ipc", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--events", type=int, default=100_000, help="1 KB events per run")
    ap.add_argument("--count-1m", type=int, default=400)
    ap.add_argument("--count-64m", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    ap.add_argument("--backend", choices=["local", "ray"], default="local")
    ap.add_argument("--address", help="ray: a cluster to use instead of two simulated nodes")
    ap.add_argument(
        "--client-address",
        help="ray: that cluster's Ray Client address (ray://HOST:10001) for the ray_client keys",
    )
    args = ap.parse_args(argv)
    figures = (args.events, args.count_1m, args.count_64m, args.repeat)
    if args.backend == "ray":
        return _main_ray(args, figures)
    mpq: list[float] = []  # interleaved with the runtime's event runs
    res = runtime_figures(*figures, between=lambda: mpq.append(mpqueue_seconds(args.events, 1024)))
    res["mpqueue_events_per_s_1k"] = args.events / min(mpq)
    res["mpqueue_gbps_64m"] = mpqueue_figure(args.count_64m, 64 * MB, args.repeat) * 64 * MB / 1e9
    res["memcpy_gbps"] = memcpy_figure(64 * MB, 5)
    res["events_ratio"] = res["events_per_s_1k"] / res["mpqueue_events_per_s_1k"]
    res["events_ratio_single_yield"] = (
        res["events_per_s_1k_single_yield"] / res["mpqueue_events_per_s_1k"]
    )
    res["gbps_64m_vs_memcpy"] = res["gbps_64m"] / res["memcpy_gbps"]
    res = {k: round(v, 3) for k, v in res.items()}
    res["targets_met"] = {
        "events_per_s_1k >= 3 x mpqueue": res["events_ratio"] >= 3,
        "gbps_64m >= 0.6 x memcpy": res["gbps_64m_vs_memcpy"] >= 0.6,
    }
    emit(res, args.json)
    return 0


class _Sink:
    def take(self, arr: np.ndarray) -> int:
        return arr.nbytes


class _Source:
    def send(self, sink: Any, nbytes: int, count: int) -> float:
        import ray

        arr = np.ones(nbytes, np.uint8)
        ray.get(sink.take.remote(arr))  # warm up
        t0 = time.perf_counter()
        for _ in range(count):
            ray.get(sink.take.remote(arr))
        return count * nbytes / (time.perf_counter() - t0) / 1e9


def ray_call_figure(node: str, count: int, repeat: int = 1) -> float:
    """GB/s of 64 MB arrays passed by Ray alone, an actor on node_a calling one on ``node``
    (best of ``repeat`` runs)."""
    import ray

    sink = ray.remote(_Sink).options(resources={node: 1}, num_cpus=0).remote()
    source = ray.remote(_Source).options(resources={"node_a": 1}, num_cpus=0).remote()
    try:
        return max(ray.get(source.send.remote(sink, 64 * MB, count)) for _ in range(repeat))
    finally:
        ray.kill(sink)
        ray.kill(source)


def caller_figures(
    events: int, count_64m: int, repeat: int, address: str | None = None
) -> dict[str, float]:
    """What reaches the caller on the ``ray`` backend at ``address`` (see the module doc)."""
    import ray
    from omni_ray.testing import on

    for attempt in range(3):  # one connection for every pipeline and ray_get_figure
        if address is None or ray.is_initialized():
            break
        try:
            ray.init(address=address)
        except ConnectionError:  # Ray's client server failed to start ours: again
            if attempt == 2:
                raise
            time.sleep(1.0)
    burst = chain(("burst", "synthetic.burst", {}, on("node_a")), shm_pool_bytes=1 << 30)
    res: dict[str, float] = {}
    with Pipeline(burst, backend="ray", address=address) as pipe:
        for key, count, nbytes in (
            ("events_per_s_1k", events, 1024),
            ("gbps_64m", count_64m, 64 * MB),
        ):
            _caller_run(pipe, 2, nbytes)  # warm up
            best = min(_caller_run(pipe, count, nbytes) for _ in range(repeat))
            res[key] = count / best if nbytes == 1024 else count * nbytes / best / 1e9
    res["ray_get_gbps_64m"] = ray_get_figure(count_64m, repeat)
    small = chain(("src", "synthetic.source", {}, on("node_a")))
    with Pipeline(small, backend="ray", address=address) as pipe:
        rtts = []
        for _ in range(30):
            t0 = time.perf_counter()
            if not pipe.generate([{"n": 1}])[0].ok:
                raise RuntimeError("bench request failed")
            rtts.append(time.perf_counter() - t0)
        res["rtt_ms"] = sorted(rtts)[len(rtts) // 2] * 1e3
    return res


class _Maker:
    def make(self, nbytes: int) -> np.ndarray:
        return np.ones(nbytes, np.uint8)


def ray_get_figure(count: int, repeat: int = 1) -> float:
    """GB/s of 64 MB arrays that Ray alone brings to this caller: ``ray.get`` of an actor
    call's result, the actor on node_a (best of ``repeat`` runs of ``count``)."""
    import ray

    maker = ray.remote(_Maker).options(resources={"node_a": 1}, num_cpus=0).remote()
    try:
        ray.get(maker.make.remote(64 * MB))  # warm up
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(count):
                ray.get(maker.make.remote(64 * MB))
            best = min(best, time.perf_counter() - t0)
        return count * 64 * MB / best / 1e9
    finally:
        ray.kill(maker)


def _caller_run(pipe: Pipeline, count: int, nbytes: int) -> float:
    """Seconds from the burst's start to its last event at the caller."""
    t0, last, n = 0.0, 0.0, 0
    for ev in pipe.stream({"count": count, "nbytes": nbytes, "chunk": CHUNK}):
        if ev.terminal:
            if ev.event_type != "completed":
                raise RuntimeError(f"bench request failed: {ev}")
            break
        last = time.time()
        t0 = t0 or ev.payload["t0"]
        n += 1
    if n == 0:
        raise RuntimeError("bench request gave no event")
    return last - t0


def client_figures(address: str, events: int, count_64m: int, repeat: int) -> dict[str, float]:
    """:func:`caller_figures` from a Ray Client driver (a process of its own)."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys; from omni_bench.ipc import caller_figures; "
        "print('RESULT ' + json.dumps(caller_figures(*map(int, sys.argv[2:]), sys.argv[1])))"
    )
    argv = [sys.executable, "-c", code, address, str(events), str(count_64m), str(repeat)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the Ray Client driver failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _main_ray(args: argparse.Namespace, figures: tuple[int, int, int, int]) -> int:
    import contextlib

    import ray
    from omni_ray.testing import free_port, on, simulated_cluster, wait_object_store_empty

    res: dict[str, Any] = {"local": runtime_figures(*figures)}
    client = args.client_address
    if args.address:
        cluster = contextlib.nullcontext(ray.init(address=args.address))
    else:
        port = free_port()
        client = client or f"ray://127.0.0.1:{port}"
        cluster = simulated_cluster(nodes=2, object_store_bytes=2 << 30, client_port=port)
    caller = (args.events, args.count_64m, args.repeat)
    with cluster:
        res["ray_same_node"] = runtime_figures(*figures, "ray", (on("node_a"), on("node_a")))
        calls: list[float] = []  # Ray's own, interleaved with the runtime's 64 MB runs
        res["ray_cross_node"] = runtime_figures(
            *figures,
            "ray",
            (on("node_a"), on("node_b")),
            after=lambda: {"_left": wait_object_store_empty()},
            between_64m=lambda: calls.append(ray_call_figure("node_b", args.count_64m)),
        )
        res["ray_call_gbps_64m_cross_node"] = max(calls)
        res["ray_call_gbps_64m_same_node"] = ray_call_figure("node_a", args.count_64m, args.repeat)
        res["ray_driver"] = caller_figures(*caller)
        if client:
            res["ray_client"] = client_figures(client, *caller)
            res["ray_client_vs_driver"] = {
                k: v / res["ray_driver"][k] for k, v in res["ray_client"].items()
            }
    left = res["ray_cross_node"].pop("_left")
    res["mpqueue_events_per_s_1k"] = mpqueue_figure(args.events, 1024, args.repeat)
    res["mpqueue_gbps_64m"] = mpqueue_figure(args.count_64m, 64 * MB, args.repeat) * 64 * MB / 1e9
    res["memcpy_gbps"] = memcpy_figure(64 * MB, 5)
    for key in ("ray_same_node", "ray_cross_node"):
        res[f"{key}_vs_local"] = {
            k: round(v / res["local"][k], 3) for k, v in res[key].items() if res["local"][k]
        }
    res = {
        k: ({kk: round(vv, 3) for kk, vv in v.items()} if isinstance(v, dict) else round(v, 3))
        for k, v in res.items()
    }
    res["ray_objects_left"] = left["objects"]
    res["ray_object_bytes_left"] = left["bytes"]
    cross, call = res["ray_cross_node"]["gbps_64m"], res["ray_call_gbps_64m_cross_node"]
    events = res["ray_cross_node_vs_local"]["events_per_s_1k"]
    res["targets_met"] = {
        "ray_cross_node.gbps_64m >= 0.9 x ray_call_gbps_64m_cross_node": cross >= 0.9 * call,
        "ray_cross_node_vs_local.events_per_s_1k >= 0.5": events >= 0.5,
        "ray_objects_left == 0": left["objects"] == 0,
    }
    emit(res, args.json)
    return 0
