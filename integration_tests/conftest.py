import os

import pytest
from omni_core.dataplane.shm import list_segments


@pytest.fixture
def no_leaked_segments():
    """Asserts that the test leaves no shared-memory segment of this process behind."""
    yield
    assert list_segments(os.getpid()) == []
