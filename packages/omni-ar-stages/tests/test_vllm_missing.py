"""Choosing the vLLM engine without vLLM installed is a clear error naming the install."""

import sys

import pytest
from omni_core import Pipeline


def test_vllm_engine_without_vllm_says_what_to_install(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without it sees
    opts = {"model": tiny_model, "engine": "vllm"}
    cfg = {
        "mrs": {"enabled": False},
        "stages": [{"name": "prefill", "kind": "ar.prefill", "options": opts}],
    }
    with pytest.raises(RuntimeError, match=r"needs vLLM: `pip install 'omni-ar-stages\[vllm\]'"):
        Pipeline(cfg).start()
