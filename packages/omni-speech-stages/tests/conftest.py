import os

import pytest

# dtype auto runs text models in float32 here, as the tests' references are, whatever the
# CPU (its workers inherit this); OMNI_CPU_BF16=1 runs them as a BF16 CPU would
os.environ.setdefault("OMNI_CPU_BF16", "0")


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory):
    """A tiny Qwen2.5-Omni checkpoint directory (seeded random weights, two voices)."""
    from omni_speech.testing import build_tiny_omni

    return str(build_tiny_omni(tmp_path_factory.mktemp("tiny-omni")))


@pytest.fixture(scope="session")
def reference(tiny_omni):
    """The model whole, as a user of transformers runs it (``generate``)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_omni).eval()


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """Named models are built under OMNI_CACHE_DIR: keep tests out of ~/.cache."""
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "omni-cache"))
