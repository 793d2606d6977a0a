import importlib.metadata

import omni_dit


def test_installed_with_core_dependency():
    dist = importlib.metadata.distribution("omni-dit-stages")
    assert dist.version == omni_dit.__version__
    assert any(r.startswith("omni-core") for r in dist.requires or [])
