"""``omni bench revisions``: one benchmark at an earlier commit and at the working tree,
in one run, side by side (for a refactor whose figures must hold).

``omni bench revisions --before REV [--rounds N] -- NAME [ARGS...]`` checks ``REV`` out
in a temporary git worktree, installs its distributions (``packages/*``, ``tools/bench``)
editable, without dependencies, into a virtual environment that shares this
environment's installed packages (a path entry to this interpreter's site-packages, after
its own: the earlier code wins, every dependency is the same build), and runs ``omni bench
NAME ARGS --json`` there and here in turn, ``--rounds`` times each (the earlier first in
each round, so that a shared machine's drifting load weighs on both alike). It prints one
JSON object: each side's commit and its rounds' results. The worktree and the environment
are removed afterwards (``--keep`` leaves them, and says where).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import venv
from typing import Any


def _git(*args: str, cwd: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def earlier_environment(repo: str, rev: str, where: str) -> str:
    """``rev`` of ``repo`` checked out and installed under ``where``: its Python."""
    src = os.path.join(where, "src")
    _git("worktree", "add", "--detach", src, rev, cwd=repo)
    env_dir = os.path.join(where, "venv")
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = os.path.join(env_dir, "bin", "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # after the environment's own site-packages: the earlier distributions win
    with open(os.path.join(purelib, "zz_shared_site.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    members = sorted(glob.glob(os.path.join(src, "packages", "*", "pyproject.toml")))
    members.append(os.path.join(src, "tools", "bench", "pyproject.toml"))
    editable = [a for m in members for a in ("-e", os.path.dirname(m))]
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", *editable],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return python


def run_bench(python: str, bench: list[str]) -> dict[str, Any]:
    """One run of ``omni bench BENCH... --json`` by ``python``'s environment: its last JSON
    line, or the error."""
    omni = [python, "-c", "import sys; from omni_core.cli import main; sys.exit(main())"]
    cmd = [*omni, "bench", *bench, *([] if "--json" in bench else ["--json"])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench revisions", description=__doc__)
    ap.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the worktree and environment")
    ap.add_argument("--json", action="store_true", help="(the result is always JSON)")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- NAME [ARGS...]")
    args = ap.parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench or bench[0] == "revisions":
        ap.error("name the benchmark to run after --")
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    repo = _git("rev-parse", "--show-toplevel", cwd=os.getcwd())
    where = tempfile.mkdtemp(prefix="omni-bench-revisions-")
    try:
        before = earlier_environment(repo, args.before, where)
        res: dict[str, Any] = {
            "bench": bench,
            "before": {"commit": _git("rev-parse", args.before, cwd=repo), "runs": []},
            "after": {
                "commit": _git("rev-parse", "HEAD", cwd=repo),
                "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", cwd=repo)),
                "runs": [],
            },
        }
        for _ in range(args.rounds):
            res["before"]["runs"].append(run_bench(before, bench))
            res["after"]["runs"].append(run_bench(sys.executable, bench))
    finally:
        if args.keep:
            print(f"kept: {where}", file=sys.stderr)
        else:
            subprocess.run(
                ["git", "worktree", "remove", "--force", os.path.join(where, "src")],
                cwd=repo,
                capture_output=True,
            )
            shutil.rmtree(where, ignore_errors=True)
    print(json.dumps(res))
    failed = any("error" in r for side in ("before", "after") for r in res[side]["runs"])
    return 1 if failed else 0
