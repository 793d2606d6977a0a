"""The on-disk cache of models that stage families build or convert once.

Several workers of one pipeline may start at the same time and all ask for the same
model: one builds it (under a file lock) into a temporary directory that is renamed into
place, the others wait and then load the finished directory. Nothing here downloads, and
nothing here knows a model format or hub (the Hugging Face helpers the families share are
``omni_hf``'s, in the ``omni-hf`` distribution).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """``$OMNI_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/omni/models`` (``~/.cache``)."""
    root = os.environ.get("OMNI_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "omni"
    )
    return Path(root) / "models"


def cached(name: str, marker: str) -> Path | None:
    """The cached directory ``name`` if it is built (``marker``, a file inside it, is
    there), else None."""
    target = cache_dir() / name
    return target if (target / marker).exists() else None


def build_once(name: str, build: Callable[[Path], None], marker: str) -> Path:
    """The cached directory ``name``, made by ``build(tmp_dir)`` if ``marker`` (a file
    inside it) is missing; concurrent callers build it once."""
    if (done := cached(name, marker)) is not None:
        return done
    target = cache_dir() / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds; the others wait for it
        if (target / marker).exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            build(tmp)
            if target.exists():  # a broken earlier attempt
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
