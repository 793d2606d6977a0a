import os

import pytest
from omni_core.dataplane.shm import list_segments

# dtype auto runs text models in float32 here, as the tests' references are, whatever the
# CPU (its workers inherit this); OMNI_CPU_BF16=1 runs them as a BF16 CPU would
os.environ.setdefault("OMNI_CPU_BF16", "0")


@pytest.fixture
def no_leaked_segments():
    """Asserts that the test leaves no shared-memory segment of this process behind."""
    yield
    assert list_segments(os.getpid()) == []


@pytest.fixture(scope="session")
def llm(tmp_path_factory):
    """A tiny Llama checkpoint (random weights), built once for the session."""
    from omni_ar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def dit(tmp_path_factory):
    """A tiny SD3 checkpoint conditioned at the tiny Llama's hidden size (64)."""
    from omni_dit import embedded

    path = tmp_path_factory.mktemp("tiny-sd3")
    embedded.build_tiny_sd3(path, conditioning_width=64)
    return str(path)
