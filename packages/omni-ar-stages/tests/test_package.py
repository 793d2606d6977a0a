import importlib.metadata

import omni_ar


def test_installed_with_core_dependency():
    dist = importlib.metadata.distribution("omni-ar-stages")
    assert dist.version == omni_ar.__version__
    assert any(r.startswith("omni-core") for r in dist.requires or [])
