"""An AR stage's ``threads`` option: a count of torch (and, on vLLM, OpenMP) threads,
``all`` for every core the worker may run on, read on the machine where it runs (a config
that travels between machines need not name their core counts), or None for the
library's own default."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from omni_core.plugin import usable_cores

Threads = Annotated[int, msgspec.Meta(ge=1)] | Literal["all"] | None


def thread_count(threads: int | Literal["all"] | None) -> int | None:
    """``threads`` as a count (``all``: :func:`~omni_core.plugin.usable_cores` now)."""
    return usable_cores() if threads == "all" else threads
