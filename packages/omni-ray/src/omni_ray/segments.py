"""A pipeline's shared-memory segments on this node, found by the pipeline id in their
names: what the launcher and the Ray Client backend unlink once their gateways are gone."""

from __future__ import annotations

import contextlib
import os

from omni_core.dataplane.shm import SHM_DIR, list_segments


def unlink_pipeline_segments(pipeline_id: str) -> list[str]:
    """Unlink every segment of ``pipeline_id`` on this node; their names."""
    gone = []
    for name in list_segments():
        if f"-{pipeline_id}-" in name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                gone.append(name)
    return gone
