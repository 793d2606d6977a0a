import pytest


@pytest.fixture(scope="session")
def tiny_dit(tmp_path_factory):
    """A small SD3-layout model (seeded random weights, conditioning width 32)."""
    from omni_dit.embedded import build_tiny_sd3

    path = tmp_path_factory.mktemp("tiny-sd3")
    build_tiny_sd3(path, conditioning_width=32)
    return str(path)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """Preview projections are cached under OMNI_CACHE_DIR: keep tests out of ~/.cache."""
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "omni-cache"))
