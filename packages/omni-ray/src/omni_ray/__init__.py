"""omni's ``ray`` backend (entry point ``ray`` of the ``omni.backends`` group:
:func:`omni_ray.backend.make_backend`)."""

from omni_ray.launcher import RayLauncher

__all__ = ["RayLauncher"]
