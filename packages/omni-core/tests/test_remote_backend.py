"""A plug-in backend (``omni.backends``) is a factory of :class:`Backend`: it may host the
control plane elsewhere for a config (Ray Client, say), and the Pipeline then talks to what
it made; or run the orchestrator here over a launcher of its own."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from omni_core import Pipeline
from omni_core.client.backend import Backend
from omni_core.client.collector import Collector
from omni_core.control.orchestrator import Orchestrator
from omni_core.dataplane.serial import ArrayCodec
from omni_core.registry import backend_registry
from omni_testing.configs import chain

CFG = chain(("src", "synthetic.source", {}, {}))


class FakeRemote(Backend):
    """Stands in for the orchestrator; records what the Pipeline asks of it."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.calls: list[str] = []
        self.collector = Collector([], [], ArrayCodec("client"))
        self.lock = threading.Lock()
        self.started = False

    def start(self) -> None:
        self.calls.append("start")
        self.started = True

    def running(self) -> bool:
        return self.started

    def send_request(self, h, request, timeout_s) -> None:
        self.calls.append(f"submit {h.request_id}")

    def cancel(self, request_id: str) -> bool:
        self.calls.append(f"cancel {request_id}")
        return True

    def health(self) -> dict[str, dict[str, Any]]:
        return {"src": {"healthy": True, "state": "ready"}}

    def metrics(self) -> dict[str, Any]:
        return {}

    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        self.calls.append("close")
        self.collector.fail_all("pipeline closed before the request finished")


made: list[str] = []


class FakeLauncher:
    def __init__(self, cfg: Any) -> None:
        made.append("launcher")
        raise RuntimeError("the in-process path must not be taken in this test")


def fake_backend(cfg: Any) -> Backend:
    """Remote only when the address says so; else the orchestrator over its launcher."""
    if (cfg.backend.address or "").startswith("fake://"):
        return FakeRemote(cfg)
    return Orchestrator(cfg, FakeLauncher(cfg))


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(backend_registry()._loaded, "fake", fake_backend)
    made.clear()


def test_a_backend_that_hosts_the_control_plane_remotely_gets_the_pipelines_calls(fake):
    pipe = Pipeline(CFG, backend="fake", address="fake://host:1")
    remote = pipe.backend
    assert isinstance(remote, FakeRemote) and made == []
    with pipe:
        pipe.submit({"n": 1}, request_id="r1")
        assert pipe.cancel("r1") and pipe.healthy
    assert remote.calls == ["start", "submit r1", "cancel r1", "close"]
    with pytest.raises(RuntimeError, match="not FakeRemote"):
        Pipeline({**CFG, "trace": True}, backend="fake", address="fake://h").trace()


def test_otherwise_the_orchestrator_runs_here_over_the_backends_launcher(fake):
    with pytest.raises(RuntimeError, match="in-process path"):
        Pipeline(CFG, backend="fake", address="auto")
    assert made == ["launcher"]
    local = Pipeline(CFG).backend  # local: unchanged
    assert isinstance(local, Orchestrator)
    local.close(graceful=False)


def test_a_factory_that_makes_no_backend_is_refused(monkeypatch):
    monkeypatch.setitem(backend_registry()._loaded, "fake", lambda cfg: object())
    with pytest.raises(TypeError, match="made a object, not a Backend"):
        Pipeline(CFG, backend="fake", address="auto")
