"""The benchmarks run through ``omni bench`` and print one JSON object with their keys.

Figures are not asserted (shared machines are noisy); the keys and their sanity are.
"""

import json
import subprocess
import sys

import pytest

OMNI = [sys.executable, "-c", "import sys; from omni_core.cli import main; sys.exit(main())"]


def bench(*args):
    out = subprocess.run(
        [*OMNI, "bench", *args, "--json"], capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ipc_keys():
    r = bench("ipc", "--events", "2000", "--count-1m", "8", "--count-64m", "2", "--repeat", "1")
    for key in (
        "events_per_s_1k",
        "mpqueue_events_per_s_1k",
        "gbps_1m",
        "gbps_64m",
        "mpqueue_gbps_64m",
        "memcpy_gbps",
    ):
        assert r[key] > 0, key


def test_pipeline_keys():
    r = bench("pipeline", "--hold", "0.02", "--requests", "8", "--serial-requests", "4")
    assert r["ideal_rps"] == 50.0
    assert r["throughput_rps"] > r["serial_rps"] > 0


def test_unknown_benchmark_is_an_error():
    out = subprocess.run([*OMNI, "bench", "nope"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown benchmark 'nope'" in out.stderr


def test_dit_keys(tmp_path, monkeypatch):
    """A small run of `omni bench dit` (tiny models built into a private cache), its
    full-layout arms included (the quality arm runs in integration_tests/test_shapes_model.py)."""
    pytest.importorskip("diffusers")
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    r = bench(
        "dit",
        "--width",
        "32",
        "--size",
        "64",
        "--steps",
        "2",
        "--requests",
        "3",
        "--concurrency",
        "2",
        "--batch",
        "2",
        "--rounds",
        "1",
        "--arms",
        "embeds,full,second",
    )
    for key in (
        "staged_img_per_s_c2",
        "staged_unbatched_img_per_s_c2",
        "stock_img_per_s",
        "preview_every_step_img_per_s",
        "preview_every_4_img_per_s",
        "no_preview_img_per_s",
        "full_layout_vs_stock",
        "second_arch_vs_stock",
    ):
        assert r[key] > 0, key
    assert r["full_layout"]["staged_img_per_s_c2"] > 0 and r["second_arch"]["stock_img_per_s"] > 0
    assert all(isinstance(r[k], float) for k in ("preview_cost_pct", "preview_every_4_cost_pct"))


def test_ipc_through_ray_keys():
    """`omni bench ipc --backend ray` (two simulated nodes) gives the local keys per path."""
    pytest.importorskip("ray")
    r = bench(
        "ipc",
        "--backend",
        "ray",
        "--events",
        "2000",
        "--count-1m",
        "4",
        "--count-64m",
        "1",
        "--repeat",
        "1",
    )
    for path in ("local", "ray_same_node", "ray_cross_node"):
        for key in ("events_per_s_1k", "gbps_1m", "gbps_64m"):
            assert r[path][key] > 0, (path, key)
    assert r["ray_call_gbps_64m_cross_node"] > 0 and r["mpqueue_events_per_s_1k"] > 0
    # what reaches the caller: a driver in the cluster, and a Ray Client driver
    for path in ("ray_driver", "ray_client", "ray_client_vs_driver"):
        for key in ("events_per_s_1k", "gbps_64m", "ray_get_gbps_64m", "rtt_ms"):
            assert r[path][key] > 0, (path, key)
    # the 64 MB arrays crossed through the object store; none is left there
    assert r["ray_objects_left"] == 0 and r["ray_object_bytes_left"] == 0
    assert set(r["targets_met"]) == {
        "ray_cross_node.gbps_64m >= 0.9 x ray_call_gbps_64m_cross_node",
        "ray_cross_node_vs_local.events_per_s_1k >= 0.5",
        "ray_objects_left == 0",
    }


def test_revisions_runs_a_bench_at_an_earlier_commit_and_here():
    """``omni bench revisions``: the earlier commit's code really runs (its own checkout,
    installed apart), and nothing of it is left behind."""
    import glob
    import tempfile

    left_before = set(glob.glob(f"{tempfile.gettempdir()}/omni-bench-revisions-*"))
    args = ["pipeline", "--hold", "0.02", "--requests", "6", "--serial-requests", "3"]
    r = bench("revisions", "--before", "HEAD~1", "--", *args)
    assert r["bench"][:1] == ["pipeline"]
    head = subprocess.run(["git", "rev-parse", "HEAD~1"], capture_output=True, text=True)
    assert r["before"]["commit"] == head.stdout.strip() != r["after"]["commit"]
    for side in ("before", "after"):
        (run,) = r[side]["runs"]
        assert run["ideal_rps"] == 50.0 and run["throughput_rps"] > 0, run
    assert set(glob.glob(f"{tempfile.gettempdir()}/omni-bench-revisions-*")) == left_before
    worktrees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True)
    assert "omni-bench-revisions-" not in worktrees.stdout


def test_revisions_refuses_a_missing_bench_and_an_unknown_commit():
    out = subprocess.run([*OMNI, "bench", "revisions", "--before", "HEAD"], capture_output=True)
    assert out.returncode == 2 and b"name the benchmark" in out.stderr
    out = subprocess.run(
        [*OMNI, "bench", "revisions", "--before", "no-such-rev-x", "--", "pipeline"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "no-such-rev-x" in out.stderr
