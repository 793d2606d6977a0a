"""Ray Client (``ray://``): a caller outside the cluster, its control plane in an actor on
the head node. The cluster runs here with a Ray Client server; the client is another
process (``ray_client_driver.py``: a Ray Client driver cannot share a process with a
normal driver), which runs every scenario once and reports; each test checks one."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from omni_core.dataplane.shm import list_segments
from omni_ray.testing import free_port, simulated_cluster, wait_object_store_empty

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
# The first test's set-up runs every scenario (``results``): 3-4 minutes alone, over 5
# beside another test run on 2 cores; its budget covers the driver's own timeout.
pytestmark = pytest.mark.timeout(720)


@pytest.fixture(scope="module")
def addresses():
    port = free_port()
    with simulated_cluster(nodes=2, client_port=port) as cluster:
        yield f"ray://127.0.0.1:{port}", cluster.address


def client_env():
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


@pytest.fixture(scope="module")
def results(addresses):
    proc = subprocess.run(
        [sys.executable, str(HERE / "ray_client_driver.py"), *addresses],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE,
        env=client_env(),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    res = json.loads(lines[-1].removeprefix("RESULT "))
    for name, r in res.items():
        assert "exception" not in r, f"{name}:\n{r['exception']}"
    return res


def test_requests_give_the_local_backends_outputs(results):
    assert results["same_outputs"] == {"dag": True, "arrays": True}


def test_arrays_reach_the_caller_as_numpy_arrays_it_owns(results):
    r = results["arrays_arrive"]
    assert r["checks"] == [True] * 5  # 3 x 256 KiB in frames, 2 x 5 MiB via object store
    assert r["astream"] == ["segment", "segment", "completed"]


def test_cancel_is_acknowledged_and_timeouts_end_requests(results):
    r = results["cancel_and_timeout"]
    assert r["first"] == "map" and r["cancelled"]
    assert r["terminal"] == ["cancelled"]  # exactly one terminal event
    assert r["acked"]  # both stages acknowledged the cancel
    assert r["timeout"] == "timeout"
    assert r["after"] == list(range(6)) and r["metrics_in_flight"] == 0


def test_a_bad_request_fails_alone(results):
    r = results["bad_request_fails_alone"]
    assert r["reasons"] == ["completed", "error", "completed"]
    assert "stage 'f'" in r["error"] and "synthetic failure" in r["error"]
    assert "cannot be serialized" in r["unserializable"]
    assert r["healthy"]


def test_a_killed_stage_worker_errors_its_request_and_restarts(results):
    r = results["stage_worker_killed"]
    assert r["last"] == ["error", "map"]
    assert r["back"] and r["after"] and r["restarts"] == 1


def test_a_killed_orchestrator_actor_fails_open_requests_and_leaves_nothing(results):
    r = results["orchestrator_actor_killed"]
    event, code, message = r["last"]
    assert event == "error" and code == "runtime_failed"
    assert "orchestrator actor" in message and "ActorDiedError" in message
    assert r["failed_in_s"] < 10 and r["close_s"] < 30
    assert not r["healthy"] and "orchestrator actor" in r["failure"]["part"]
    assert "orchestrator actor" in r["refused"]
    # nothing outlives the pipelines: actors (killed with their owner, or closed),
    # segments on the (simulated, so local) nodes, objects in the stores
    ids = [r["pipeline_id"], results["arrays_arrive"]["pipeline_id"]]
    end = time.monotonic() + 20
    while time.monotonic() < end and omni_actors():
        time.sleep(0.2)
    assert omni_actors() == []
    assert [n for n in list_segments() if any(f"-{i}-" in n for i in ids)] == []
    assert wait_object_store_empty()["objects"] == 0


def test_a_lost_connection_fails_open_requests_without_hanging(results):
    r = results["connection_lost"]
    assert r["servers"] == 1
    event, code, message = r["last"]
    assert event == "error" and code == "runtime_failed"
    assert "Ray Client connection" in message and "connection was lost" in message
    assert r["failed_in_s"] < 90 and r["close_s"] < 30 and not r["healthy"]
    # the orchestrator actor went with its driver, and its stages and gateways with it
    end = time.monotonic() + 20
    while time.monotonic() < end and omni_actors():
        time.sleep(0.2)
    assert omni_actors() == []
    # their segments stay until the next pipeline on the node sweeps them (shm.sweep_stale)


def omni_actors():
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("omni-")
    ]


def test_omni_run_over_ray_client(addresses, results):
    proc = subprocess.run(
        [sys.executable, "-m", "omni_core.cli", "run", str(ROOT / "configs/demo.yaml")]
        + ["--backend", "ray", "--address", addresses[0], "--input", '{"n": 10}', "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        env=client_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert events[-1]["event_type"] == "completed"
    joined = [t for e in events if e.get("stage") == "join" for t in e.get("tokens") or []]
    assert joined == [3 * t + 1000 for t in range(10)]
