"""omni's ``ray`` backend (entry point ``ray`` of the ``omni.backends`` group)."""

from omni_ray.launcher import RayLauncher

__all__ = ["RayLauncher"]
