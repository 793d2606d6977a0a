import pytest

pytest.importorskip("transformers", reason="the transformers engine extra is not installed")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from omni_ar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
