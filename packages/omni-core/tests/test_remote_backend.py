"""The ``remote_backend`` hook: a backend class may host the control plane elsewhere for a
config (Ray Client, say); the Pipeline then talks to the object it returns."""

from __future__ import annotations

from typing import Any

import pytest
from omni_core import Pipeline
from omni_core.control.orchestrator import Orchestrator
from omni_core.registry import backend_registry
from omni_testing.configs import chain

CFG = chain(("src", "synthetic.source", {}, {}))


class FakeRemote:
    """Stands in for the orchestrator; records what the Pipeline asks of it."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.calls: list[str] = []
        self.collector = type("C", (), {"handles": {}})()
        self.failure = None

    def start(self) -> None:
        self.calls.append("start")

    def submit(self, request, request_id=None, timeout_s=None, loop=None):
        self.calls.append(f"submit {request_id}")
        return iter(())

    def cancel(self, request_id: str) -> bool:
        self.calls.append(f"cancel {request_id}")
        return True

    def health(self) -> dict[str, dict[str, Any]]:
        return {"src": {"healthy": True}}

    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        self.calls.append("close")


class FakeBackend:
    """A launcher class with the hook: remote only when the address says so."""

    made: list[str] = []

    def __init__(self, cfg: Any) -> None:
        FakeBackend.made.append("launcher")
        raise RuntimeError("the in-process path must not be taken in this test")

    @classmethod
    def remote_backend(cls, cfg: Any) -> FakeRemote | None:
        return FakeRemote(cfg) if (cfg.backend.address or "").startswith("fake://") else None


@pytest.fixture
def fake_backend(monkeypatch):
    monkeypatch.setitem(backend_registry()._loaded, "fake", FakeBackend)
    FakeBackend.made.clear()


def test_a_backend_that_hosts_the_control_plane_remotely_gets_the_pipelines_calls(fake_backend):
    pipe = Pipeline(CFG, backend="fake", address="fake://host:1")
    remote = pipe.backend
    assert isinstance(remote, FakeRemote) and FakeBackend.made == []
    with pipe:
        pipe.submit({"n": 1}, request_id="r1")
        assert pipe.cancel("r1") and pipe.healthy
    assert remote.calls == ["start", "submit r1", "cancel r1", "close"]
    with pytest.raises(RuntimeError, match="not FakeRemote"):
        Pipeline({**CFG, "trace": True}, backend="fake", address="fake://h").trace()


def test_without_the_hooks_object_the_orchestrator_runs_here_over_the_launcher(fake_backend):
    with pytest.raises(RuntimeError, match="in-process path"):
        Pipeline(CFG, backend="fake", address="auto")
    assert FakeBackend.made == ["launcher"]
    local = Pipeline(CFG).backend  # local: unchanged
    assert isinstance(local, Orchestrator)
    local.close(graceful=False)
