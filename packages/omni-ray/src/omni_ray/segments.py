"""A pipeline's shared-memory segments on this node, found by the pipeline id in their
names: what the launcher and the Ray Client backend unlink once their gateways are gone."""

from __future__ import annotations

import logging
import os

from omni_core.dataplane.shm import SHM_DIR, list_segments

log = logging.getLogger("omni.ray")


def unlink_pipeline_segments(pipeline_id: str, directory: str = SHM_DIR) -> list[str]:
    """Unlink every segment of ``pipeline_id`` on this node; their names. A file of
    another user under such a name (planted), or one this process may not unlink, is
    logged and left in place: the sweep goes on with the rest."""
    gone = []
    uid = os.geteuid()
    for name in list_segments(directory=directory):
        if f"-{pipeline_id}-" not in name:
            continue
        path = os.path.join(directory, name)
        try:
            owner = os.lstat(path).st_uid
            if owner != uid:
                log.warning("%s is not this user's (uid %d): left in place", path, owner)
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as e:  # EPERM, EACCES
            log.warning("%s left in place: %s", path, e)
            continue
        gone.append(name)
    return gone
