import pytest

pytest.importorskip("ray", reason="ray is not installed")


@pytest.fixture(scope="module")
def cluster():
    """Two simulated Ray nodes on this machine (custom resources node_a, node_b)."""
    from omni_ray.testing import simulated_cluster

    with simulated_cluster(nodes=2) as c:
        yield c
