"""``omni bench start`` runs small: the demo arm, each way started once after a warm-up;
the keys and their sanity, not the figures (shared machines are noisy)."""

import json
import subprocess
import sys

OMNI = [sys.executable, "-c", "import sys; from omni_core.cli import main; sys.exit(main())"]


def test_start_bench_demo_arm_starts_both_ways():
    out = subprocess.run(
        [*OMNI, "bench", "start", "--arms", "demo", "--starts", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    demo = r["demo"]
    assert demo["ready_s_zygote"] > 0 and demo["ready_s_spawn"] > 0
    assert demo["zygote_vs_spawn_ready"] == round(demo["ready_s_zygote"] / demo["ready_s_spawn"], 3)
    assert set(r["targets"]) == {"ready", "restart", "pss"}
