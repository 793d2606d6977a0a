"""A stage with replicas on the Ray backend: each replica (``rep#0``, ``rep#1``) is an actor
of its own, with its own endpoints, segment and route, placed by the stage's placement, so
the replicas of one stage run on different nodes; the local backend's outputs; every
request is served by the replica it is bound to; a replica's large arrays for a reader on
another node go through the object store, put by the replica itself; a node that goes
away takes only the requests bound to its replica, the others complete, new requests go
to the replica left, and the lost replica comes back on a replacement node."""

import threading
import time

import ray
from omni_core import Pipeline
from omni_core.client.collector import collect
from omni_core.dataplane.shm import list_segments
from omni_ray.objects import OBJECT_THRESHOLD
from omni_ray.testing import add_node, on, one_per_node, wait_object_store_empty
from omni_ray.testing import summary as reduced
from omni_testing.configs import chain

# rep's placement takes a node's one node_slot: its two replicas land on the two nodes
CFG = chain(
    ("src", "synthetic.source", {"segment": 2}, on("node_a")),
    (
        "rep",
        "synthetic.map",
        {"scale": 3, "delay_s": 0.01},
        {**one_per_node(), "replicas": 2, "client_stream": True, "restart_backoff_s": 0.2},
    ),
    ("sink", "synthetic.map", {"offset": 1}, on("node_a")),
    # windows with overlap: a request's state lives in one replica, and a request whose
    # events reached both would fail (out of order)
    edges=[
        {"from": "src", "to": "rep", "window": {"size": 4, "overlap": 1}},
        {"from": "rep", "to": "sink"},
    ],
    heartbeat_interval_s=0.1,
)


def summary(out):
    return reduced(out, ("edge", "window", "context"))


def tokens(out, stage):
    return [t for e in out.by_stage(stage) for t in e.tokens]


def rep_pids(out):
    return {e.payload["pid"] for e in out.by_stage("rep")}


def wait_until(cond, timeout_s, what):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.1)


def test_a_replica_puts_its_large_arrays_for_another_node_itself(cluster):
    cfg = chain(
        (
            "arrays",
            "synthetic.array_source",
            {"nbytes": OBJECT_THRESHOLD},
            {**one_per_node(), "replicas": 2},
        ),
        ("sink", "synthetic.array_sink", {}, on("node_a")),
        edges=[{"from": "arrays", "to": "sink", "window": {"size": 2}}],
        shm_pool_bytes=64 << 20,
    )
    requests = [{"count": 3}, {"count": 4}, {"count": 2, "nbytes": OBJECT_THRESHOLD + 77}]
    keep = ("bytes", "check", "crc")

    def arrays_summary(out):
        assert out.ok, out.error
        return [(e.stage, e.event_type, {k: e.payload.get(k) for k in keep}) for e in out.events]

    with Pipeline(cfg, backend="local") as pipe:
        local = [arrays_summary(o) for o in pipe.generate(requests)]
    with Pipeline(cfg, backend="ray") as pipe:
        token = pipe.backend.launcher.pipeline_id
        handles = [pipe.submit(r, timeout_s=60) for r in requests]
        bound = [f"arrays#{h.routes['arrays']}" for h in handles]
        assert [arrays_summary(collect(h)) for h in handles] == local
        where = {w: h["where"] for w, h in pipe.health().items()}
        assert where["arrays#0"] != where["arrays#1"]
        far = next(w for w in ("arrays#0", "arrays#1") if where[w] != where["sink"])
        # the replica off the sink's node put its arrays into the object store itself
        # (its writer is known by its worker name, the producer name of its arrays); the
        # one on the sink's node used its slots
        workers = pipe.backend.launcher.workers
        put = {w: ray.get(workers[w].actor.objects_put.remote(), timeout=30) for w in workers}
        expected = sum(r["count"] for r, b in zip(requests, bound, strict=True) if b == far)
        assert expected and put[far] == expected
        assert put["sink"] == 0 and sum(put.values()) == expected
        usage = wait_object_store_empty()  # every array released, the pipeline still up
        assert usage["objects"] == 0, usage
    assert [n for n in list_segments() if f"-{token}-" in n] == []


def test_replicas_on_two_nodes_and_a_node_that_goes_away(cluster):
    requests = [{"n": n, "start": n} for n in (1, 6, 13, 20, 27, 34)]
    with Pipeline(CFG, backend="local") as pipe:
        local = [summary(o) for o in pipe.generate(requests)]
    with Pipeline(CFG, backend="ray") as pipe:
        token = pipe.backend.launcher.pipeline_id
        outs = pipe.generate(requests, timeout_s=60)
        assert [summary(o) for o in outs] == local
        health = pipe.health()
        assert set(health) == {"src", "rep#0", "rep#1", "sink"}
        assert health["rep#0"]["stage"] == health["rep#1"]["stage"] == "rep"
        where = {w: h["where"] for w, h in health.items()}
        assert where["rep#0"] != where["rep#1"]  # one replica on each node
        assert where["src"] == where["sink"] in (where["rep#0"], where["rep#1"])
        pid = {w: h["pid"] for w, h in health.items()}
        # both replicas served: each request by one of them, all of it
        served = [rep_pids(o) for o in outs]
        assert all(len(s) == 1 for s in served), served
        assert set().union(*served) == {pid["rep#0"], pid["rep#1"]}

        # the replica off the head node goes with its node
        gone = "rep#0" if where["rep#0"] != where["src"] else "rep#1"
        kept = "rep#1" if gone == "rep#0" else "rep#0"
        node = next(n for n in cluster.worker_nodes if where[gone] == f"node {n.node_id[:12]}")
        handles = [pipe.submit({"n": 900, "start": i}) for i in range(4)]
        bound = [f"rep#{h.routes['rep']}" for h in handles]
        assert sorted(bound) == ["rep#0", "rep#0", "rep#1", "rep#1"]
        # the first request on each replica is under way (each has 300 windows to go)
        first = {}  # request id -> its first event, taken here
        for b in ("rep#0", "rep#1"):
            h = handles[bound.index(b)]
            ev = first[h.request_id] = next(iter(h))
            assert ev.stage == "rep" and ev.payload["pid"] == pid[b]
        remover = threading.Thread(target=cluster.remove_node, args=(node,), daemon=True)
        remover.start()
        for start, (h, b) in enumerate(zip(handles, bound, strict=True)):
            out = collect(h)
            if b == kept:  # bound to the replica left: completes, all of it
                assert out.ok, out.error
                assert rep_pids(out) == {pid[kept]}
                head = first[h.request_id].tokens if h.request_id in first else []
                expected = [3 * t for t in range(start, start + 900)]
                assert head + tokens(out, "rep") == expected
                assert tokens(out, "sink") == [t + 1 for t in expected]
            else:  # bound to the replica that went: fails, naming it
                assert out.finish_reason == "error", out.finish_reason
                assert f"stage 'rep' replica {gone[-1]}" in out.error, out.error
        remover.join(timeout=60)
        stage = pipe.stage_health()["rep"]
        assert stage["state"] == "degraded" and stage["serving"] == 1, stage
        assert pipe.healthy  # a replicated stage with one replica serving still serves
        # new requests go to the replica left (the other waits for a node to offer it)
        more = pipe.generate([{"n": 7}, {"n": 12, "start": 5}, {"n": 3}], timeout_s=60)
        for o, (n, start) in zip(more, [(7, 0), (12, 5), (3, 0)], strict=True):
            assert o.ok, o.error
            assert tokens(o, "rep") == [3 * t for t in range(start, start + n)]
            assert rep_pids(o) == {pid[kept]}
        wait_until(lambda: pipe.health()[gone]["state"] == "starting", 10, pipe.health())
        assert "node_slot" in pipe.backend.launcher.waiting(gone)

        # a replacement node: the lost replica is placed there and serves again
        add_node(cluster, "node_b")
        wait_until(
            lambda: pipe.health()[gone]["state"] == "ready", 60, f"{gone} back: {pipe.health()}"
        )
        back = pipe.health()[gone]
        assert back["restarts"] == 1 and back["where"] not in (where[gone], where[kept])
        outs = pipe.generate(requests, timeout_s=60)
        assert [summary(o) for o in outs] == local
        assert set().union(*(rep_pids(o) for o in outs)) == {pid[kept], back["pid"]}
        assert pipe.stage_health()["rep"]["state"] == "ok"
    assert [n for n in list_segments() if f"-{token}-" in n] == []


def test_each_replica_sees_its_own_devices_entry_and_the_stage_s_extra_env(cluster):
    cfg = chain(
        (
            "env",
            "synthetic.env",
            {},
            {**on("node_a"), "replicas": 2, "devices": ["1,2", "cpu"], "extra_env": {"X": "y"}},
        )
    )
    with Pipeline(cfg, backend="ray") as pipe:
        outs = pipe.generate([{"env": ["CUDA_VISIBLE_DEVICES", "X"]}] * 2, timeout_s=60)
        worker = {h["pid"]: w for w, h in pipe.health().items()}
    seen = {worker[e.payload["pid"]]: e.payload["env"] for o in outs for e in o.by_stage("env")}
    assert seen == {
        "env#0": {"CUDA_VISIBLE_DEVICES": "1,2", "X": "y"},
        "env#1": {"CUDA_VISIBLE_DEVICES": "", "X": "y"},
    }


def test_ray_client_health_lists_every_replica_once_the_actor_is_gone():
    from omni_core.config import parse_config
    from omni_core.control.supervisor import stage_health
    from omni_ray.client import RayClientBackend

    cfg = chain(
        ("src", "synthetic.source", {}),
        ("rep", "synthetic.map", {}, {"replicas": {"min": 2, "max": 4}}),
    )
    backend = RayClientBackend(parse_config(cfg))  # not started: no actor
    health = backend.health()
    assert set(health) == {"src", "rep#0", "rep#1"}  # the replicas the pipeline starts with
    assert {(h["stage"], h["replica"]) for h in health.values()} == {
        ("src", 0),
        ("rep", 0),
        ("rep", 1),
    }
    assert not any(h["healthy"] for h in health.values())
    assert {s: h["state"] for s, h in stage_health(health).items()} == {
        "src": "failed",
        "rep": "failed",
    }
