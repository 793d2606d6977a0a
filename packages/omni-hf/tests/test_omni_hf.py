"""omni_hf: the Hugging Face settings and hub-error wording both stage families use."""

from __future__ import annotations

import os

import omni_hf
import pytest

_VARS = (
    "HF_HUB_OFFLINE",
    omni_hf.OFFLINE_MARKER,
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "TRANSFORMERS_VERBOSITY",
    "DIFFUSERS_VERBOSITY",
    "HF_HUB_CACHE",
    "HF_HOME",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)


def test_quiet_hub_sets_defaults_and_keeps_the_users(monkeypatch):
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    omni_hf.quiet_hub()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert os.environ["DIFFUSERS_VERBOSITY"] == "error"
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"  # the user's, kept
    assert "HF_HUB_OFFLINE" not in os.environ


def test_quiet_offline_marks_who_set_it():
    omni_hf.quiet_offline()
    assert omni_hf.hub_offline()
    assert os.environ[omni_hf.OFFLINE_MARKER] == "1"
    msg = omni_hf.hub_failure("org/model", FileNotFoundError("nope"))
    assert "HF_HUB_OFFLINE is set" in msg and "AR stages" in msg
    assert "'org/model'" in msg and "FileNotFoundError: nope" in msg


def test_offline_set_by_the_user_is_kept_and_not_blamed_on_omni(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    omni_hf.quiet_offline()
    assert os.environ["HF_HUB_OFFLINE"] == "0" and not omni_hf.hub_offline()
    assert omni_hf.OFFLINE_MARKER not in os.environ
    monkeypatch.setenv("HF_HUB_OFFLINE", "yes")
    msg = omni_hf.hub_failure("org/model", OSError("x"))
    assert "HF_HUB_OFFLINE is set" in msg and "AR stages" not in msg


def test_download_failure_names_the_cache(monkeypatch):
    monkeypatch.setenv("HF_HOME", "/somewhere/hf")
    msg = omni_hf.hub_failure("org/model", OSError("timeout"))
    assert "download failed" in msg and "cache /somewhere/hf" in msg
    monkeypatch.setenv("HF_HUB_CACHE", "/elsewhere")
    assert omni_hf.hub_cache() == "/elsewhere"


@pytest.mark.parametrize(
    ("model", "hub"),
    [
        ("stabilityai/stable-diffusion-3.5-medium", True),
        ("tiny-sd3", False),
        ("./a/b", False),
        ("~/a", False),
        ("a/b/c", False),
        ("a/", False),
    ],
)
def test_looks_like_hub_id(model, hub):
    assert omni_hf.looks_like_hub_id(model) is hub


@pytest.mark.parametrize("family", ["omni-ar-stages", "omni-dit-stages"])
def test_both_families_declare_it(family):
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(family)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{family} is not installed")
    assert any(r.split(";")[0].strip() == "omni-hf" for r in dist.requires or [])
