"""What a stage worker inherits of the environment of the process that runs the pipeline:
its variables, never its secrets. Every launcher builds a worker's environment here: the
local one's spawned workers, the zygote (whose forked workers show its environment in
/proc as it was started) and the Ray backend's actors."""

from __future__ import annotations

import os

SECRET_ENV = ("OMNI_API_KEY",)  # the server's key: the front end's alone


def inherited_env(prefix: str = "") -> dict[str, str]:
    """The environment a worker (or the zygote) starts with: this process's variables
    (those starting with ``prefix``: a Ray actor gets the ``OMNI_`` ones), without
    :data:`SECRET_ENV`."""
    return {k: v for k, v in os.environ.items() if k.startswith(prefix) and k not in SECRET_ENV}
