"""The ``ray`` backend's factory (entry point ``ray`` of the ``omni.backends`` group):
for a Ray Client address (``ray://``) the control plane runs in the cluster
(:class:`~omni_ray.client.RayClientBackend`); else the orchestrator runs in the caller's
process over a :class:`~omni_ray.launcher.RayLauncher`."""

from __future__ import annotations

from omni_core.client.backend import Backend
from omni_core.config import PipelineConfig
from omni_core.control.orchestrator import Orchestrator

from omni_ray.client import RayClientBackend
from omni_ray.launcher import RayLauncher


def is_client_address(address: str | None) -> bool:
    return bool(address) and address.startswith("ray://")  # type: ignore[union-attr]


def make_backend(cfg: PipelineConfig) -> Backend:
    """The backend that runs ``cfg`` on Ray."""
    if is_client_address(cfg.backend.address):
        return RayClientBackend(cfg)
    return Orchestrator(cfg, RayLauncher(cfg))
