"""``omni bench chaos`` runs small: every fault injected, every request accounted for."""

import json
import subprocess
import sys

OMNI = [sys.executable, "-c", "import sys; from omni_core.cli import main; sys.exit(main())"]


def test_chaos_injects_every_fault_and_loses_nothing():
    args = ["--phase-s", "1.5", "--stall-timeout-s", "1.5", "--max-queued-requests", "8"]
    out = subprocess.run(
        [*OMNI, "bench", "chaos", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["faults"] == dict.fromkeys(
        ("sigkill", "sigstop", "bad_frame", "bad_payload", "slow_reader", "burst"), 1
    )
    accounted = r["completed"] + sum(r["errored"].values()) + r["rejected_429"]
    assert accounted + r["rejected_other"] + r["lost"] == r["requests"]
    assert r["errored"].get("stage_hung", 0) >= 1  # the SIGSTOP was caught
    assert r["errored"].get("bad_message", 0) >= 3  # each undecodable payload failed its own
    assert r["rejected_429"] >= 8 * 10 - 8  # the burst past the cap
    assert r["targets_met"] == {
        "lost == 0": True,
        "health_lies == 0": True,
        "shm_segments_left == 0": True,
    }
