import os

import pytest

# dtype auto runs text models in float32 here, as the tests' references are, whatever the
# CPU (its workers inherit this); OMNI_CPU_BF16=1 runs them as a BF16 CPU would
os.environ.setdefault("OMNI_CPU_BF16", "0")

pytest.importorskip("transformers", reason="the transformers engine extra is not installed")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from omni_ar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory):
    """The tiny Llama with ``head_dim`` 32 (vLLM's CPU attention needs >= 32); the test
    is skipped where vLLM is not installed, except under CI (env ``CI`` set)."""
    if os.environ.get("CI") is None:
        pytest.importorskip("vllm", reason="vLLM is not installed")
    from omni_ar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-32"), head_dim=32))


@pytest.fixture(scope="module")
def restore_environment():
    """In-process vLLM engines set vLLM's environment in this process: undo it for the
    tests that follow (their workers would inherit it)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def engine(tiny_model):
    """The transformers engine on the tiny Llama, tokenizer and model loaded (a module
    that needs another engine defines its own ``engine``)."""
    from omni_ar.engines.transformers_engine import TransformersEngine

    e = TransformersEngine(tiny_model)
    e.load_tokenizer()
    e.load_model()
    return e
