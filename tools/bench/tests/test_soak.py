"""``omni bench soak`` runs small and accounts for every request (no kills here)."""

import json
import subprocess
import sys

OMNI = [sys.executable, "-c", "import sys; from omni_core.cli import main; sys.exit(main())"]

KEYS = (
    "requests",
    "completed",
    "cancelled",
    "errored",
    "rejected",
    "lost",
    "rss_growth_pct",
    "shm_segments_left",
    "kills",
    "restarts",
    "wall_s",
    "targets_met",
)


def test_soak_accounts_for_every_request():
    args = ["--requests", "60", "--concurrency", "8", "--kill-interval-s", "0"]
    out = subprocess.run(
        [*OMNI, "bench", "soak", *args, "--duration-s", "60", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in KEYS:
        assert key in r, key
    assert r["requests"] == 60
    assert r["lost"] == 0
    assert r["shm_segments_left"] == 0
    assert r["completed"] + r["cancelled"] + r["errored"] + r["rejected"] == r["requests"]
    assert r["kills"] == 0 and r["completed"] > 0
    assert r["mismatched"] == 0
