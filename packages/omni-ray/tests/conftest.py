import os

import pytest

# dtype auto runs text models in float32 here, as the tests' references are, whatever the
# CPU (its workers inherit this); OMNI_CPU_BF16=1 runs them as a BF16 CPU would
os.environ.setdefault("OMNI_CPU_BF16", "0")

pytest.importorskip("ray", reason="ray is not installed")


@pytest.fixture(scope="module")
def cluster():
    """Two simulated Ray nodes on this machine (custom resources node_a, node_b)."""
    from omni_ray.testing import simulated_cluster

    with simulated_cluster(nodes=2) as c:
        yield c
