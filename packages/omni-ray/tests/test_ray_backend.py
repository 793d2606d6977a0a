"""The ray backend on a simulated two-node cluster: same outputs as the local backend,
shared memory on a node and Ray between nodes, cancel, timeouts, backpressure, and a node
that goes away mid-request."""

import threading
import time

import pytest
import ray
from omni_core import Pipeline
from omni_core.dataplane.shm import list_segments
from omni_ray.testing import add_node, on
from omni_testing.configs import chain

DAG = chain(
    ("src", "synthetic.source", {"segment": 3}, on("node_a")),
    ("up", "synthetic.map", {"scale": 2}, on("node_b")),
    ("down", "synthetic.map", {"offset": 100}, on("node_a")),
    ("join", "synthetic.join", {}, on("node_b")),
    edges=[
        {"from": "src", "to": "up", "window": {"size": 4, "overlap": 1}},
        {"from": "src", "to": "down", "window": {"size": 2}},
        {"from": "up", "to": "join"},
        {"from": "down", "to": "join"},
    ],
    heartbeat_interval_s=0.1,
)
# one 256 KiB array per segment: to sink_b across nodes (inlined, through Ray) and to
# sink_a on the same node (shared memory); a pool of 4 MiB runs dry unless both readers
# release every slot
ARRAYS = chain(
    ("arrays", "synthetic.array_source", {"nbytes": 256 << 10, "count": 40}, on("node_a")),
    ("sink_b", "synthetic.array_sink", {}, on("node_b")),
    ("sink_a", "synthetic.array_sink", {}, on("node_a")),
    edges=[
        {"from": "arrays", "to": "sink_b", "window": {"size": 1}},
        {"from": "arrays", "to": "sink_a", "window": {"size": 1}},
    ],
    shm_pool_bytes=4 << 20,
)


def summary(out):
    """What must not depend on the backend: per stage in order, the tokens and window
    facts (how two sinks' streams interleave does depend on timing)."""
    assert out.ok, out.error
    keep = ("edge", "window", "context", "edges", "bytes", "check", "crc")
    events = sorted(out.events, key=lambda e: (e.terminal, e.stage))  # stable sort
    return [
        (e.stage, e.event_type, e.tokens, {k: e.payload[k] for k in keep if k in e.payload})
        for e in events
    ]


def run(cfg, requests, backend):
    with Pipeline(cfg, backend=backend) as pipe:
        outs = pipe.generate(requests)
        token = getattr(pipe.backend.launcher, "pipeline_id", None)
        where = {n: h["where"] for n, h in pipe.backend.health().items()}
    return [summary(o) for o in outs], where, token


def assert_no_segments_of(token):
    assert [n for n in list_segments() if f"-{token}-" in n] == []


def test_dag_with_windows_fan_out_and_fan_in_equals_the_local_backend(cluster):
    requests = [{"n": n, "start": n} for n in (1, 7, 20, 33)]
    local, _, _ = run(DAG, requests, "local")
    remote, where, token = run(DAG, requests, "ray")
    assert remote == local
    assert where["src"] == where["down"] != where["up"] == where["join"]  # two nodes
    assert_no_segments_of(token)


def test_arrays_cross_nodes_through_ray_and_stay_in_shared_memory_on_a_node(cluster):
    requests = [{"count": 40}, {"count": 3, "nbytes": 100_000}]
    local, _, _ = run(ARRAYS, requests, "local")
    remote, where, token = run(ARRAYS, requests, "ray")
    assert remote == local
    for sink in ("sink_a", "sink_b"):
        assert sum(p.get("bytes", 0) for s, _, _, p in remote[0] if s == sink) == 40 << 18
    assert where["arrays"] == where["sink_a"] != where["sink_b"]
    assert_no_segments_of(token)


def test_backpressure_and_order_hold_across_nodes(cluster):
    cfg = chain(
        ("burst", "synthetic.burst", {}, on("node_a")),
        ("count", "synthetic.count", {}, {**on("node_b"), "queue_capacity": 2}),
        edges=[{"from": "burst", "to": "count", "window": {"size": 1}}],
    )
    with Pipeline(cfg, backend="ray") as pipe:
        outs = pipe.generate([{"count": 20_000, "nbytes": 1024, "chunk": 64}] * 2)
        gateways = pipe.backend.launcher.gateways.values()
        infos = ray.get([gw.info.remote() for gw in gateways], timeout=30)
    # the events went over the burst's node's channel to count's, batched (not one call
    # or one write per event)
    sent = sum(i["channel_frames"] for i in infos)
    assert 0 < sent < 40_000 / 8
    for out in outs:
        assert out.ok, out.error  # a lost or reordered event fails the request
        assert out.events[-1].payload["count"] == 20_000


def test_cancel_and_timeout_reach_a_stage_on_another_node(cluster):
    cfg = chain(
        ("src", "synthetic.source", {"segment": 1, "delay_s": 0.02}, on("node_a")),
        ("map", "synthetic.map", {"delay_s": 0.02}, on("node_b")),
        edges=[{"from": "src", "to": "map", "window": {"size": 1}}],
        heartbeat_interval_s=0.1,
    )
    with Pipeline(cfg, backend="ray") as pipe:
        handle = pipe.submit({"n": 500})
        first = next(iter(handle))
        assert first.stage == "map"
        acks = pipe.backend.metrics()["cancel_acks"]
        assert pipe.cancel(handle.request_id)
        events = list(handle)
        assert events[-1].event_type == "cancelled"
        deadline = time.monotonic() + 10
        while pipe.backend.metrics()["cancel_acks"] < acks + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pipe.backend.metrics()["cancel_acks"] >= acks + 2  # both stages acknowledged
        out = pipe.generate([{"n": 500}], timeout_s=0.5)[0]
        assert out.finish_reason == "timeout"
        ok = pipe.generate([{"n": 6}])[0]
        assert [t for e in ok.by_stage("map") for t in e.tokens] == list(range(6))


def test_a_node_that_goes_away_errors_its_requests_and_the_stage_comes_back(cluster):
    node_c = add_node(cluster, "node_c")
    cfg = chain(
        ("src", "synthetic.source", {"segment": 1, "delay_s": 0.02}, on("node_a")),
        ("map", "synthetic.map", {}, {**on("node_c"), "restart_backoff_s": 0.2}),
        edges=[{"from": "src", "to": "map", "window": {"size": 1}}],
        heartbeat_interval_s=0.1,
    )
    with Pipeline(cfg, backend="ray") as pipe:
        token = pipe.backend.launcher.pipeline_id
        handle = pipe.submit({"n": 2000})
        other = pipe.submit({"n": 3})
        first = next(iter(handle))
        assert first.stage == "map"
        threading.Thread(target=cluster.remove_node, args=(node_c,), daemon=True).start()
        events = list(handle)
        assert events[-1].event_type == "error", events[-1]
        assert events[-1].stage == "map"
        assert "map" in events[-1].message
        assert list(other)[-1].event_type in ("completed", "error")
        add_node(cluster, "node_c")  # a replacement node: the stage restarts there
        deadline = time.monotonic() + 60
        while pipe.backend.health()["map"]["state"] != "ready":
            assert time.monotonic() < deadline, pipe.backend.health()["map"]
            time.sleep(0.1)
        assert pipe.backend.health()["map"]["restarts"] == 1
        out = pipe.generate([{"n": 5}], timeout_s=60)[0]
        assert out.ok, out.error
        assert [t for e in out.by_stage("map") for t in e.tokens] == list(range(5))
    assert_no_segments_of(token)


def test_devices_and_extra_env_keep_their_meaning_in_an_actor(cluster):
    cfg = chain(
        ("gpu", "synthetic.env", {}, {**on("node_b"), "devices": "1,2", "extra_env": {"X": "y"}}),
        ("cpu", "synthetic.env", {}, {**on("node_a"), "devices": "cpu"}),
        edges=[],
    )
    with Pipeline(cfg, backend="ray") as pipe:
        out = pipe.generate([{"env": ["CUDA_VISIBLE_DEVICES", "X"]}])[0]
    env = {e.stage: e.payload["env"] for e in out.events if e.stage}
    assert env["gpu"] == {"CUDA_VISIBLE_DEVICES": "1,2", "X": "y"}
    assert env["cpu"] == {"CUDA_VISIBLE_DEVICES": "", "X": None}


def test_a_placement_no_node_offers_fails_the_start_and_says_why(cluster):
    from omni_core.errors import StageStartError

    cfg = chain(("src", "synthetic.source", {}, on("node_z")), ready_timeout_s=3)
    with pytest.raises(StageStartError, match=r"src: Ray has not placed.*'node_z': 1"):
        Pipeline(cfg, backend="ray").start()


def test_a_gateway_that_does_not_start_in_time_fails_the_start_and_says_why(cluster, monkeypatch):
    """The head node's gateway gets at least ``GATEWAY_START_S`` (a Ray worker process has
    to start for it: far more than a stage's few-second ready timeout on a loaded node);
    past its bound, the start fails with an error that names it, not Ray's bare timeout,
    and the cluster serves the next pipeline."""
    from omni_core.errors import StageStartError
    from omni_ray import launcher

    monkeypatch.setattr(launcher, "GATEWAY_START_S", 0.0)
    cfg = chain(("src", "synthetic.source", {}), ready_timeout_s=0.001)
    with pytest.raises(StageStartError, match=r"head node's gateway .* within 0.001 s"):
        Pipeline(cfg, backend="ray")
    monkeypatch.undo()
    with Pipeline(chain(("src", "synthetic.source", {})), backend="ray") as pipe:
        assert pipe.generate([{}])[0].ok


def test_a_node_label_selector_places_a_stage(cluster):
    labelled = cluster.add_node(num_cpus=2, labels={"omni-zone": "b"})
    cluster.wait_for_nodes()
    cfg = chain(("env", "synthetic.env", {}, {"placement": {"node_labels": {"omni-zone": "b"}}}))
    with Pipeline(cfg, backend="ray") as pipe:
        assert pipe.backend.health()["env"]["where"] == f"node {labelled.node_id[:12]}"
        assert pipe.generate([{}])[0].ok
