"""What a pipeline says of itself: :meth:`~omni_core.Pipeline.health`,
:meth:`~omni_core.Pipeline.stage_health`, :meth:`~omni_core.Pipeline.metrics` and
:attr:`~omni_core.Pipeline.failure`, typed.

They are ``TypedDict``\\ s: plain dicts at run time (what ``/health`` and ``/metrics``
serve as JSON, and what crosses a Ray actor call), with their keys checked by the type
checker where they are made. Every backend fills the required keys; the local one the
rest.
"""

# no ``from __future__ import annotations``: Python 3.11 reads ``NotRequired`` only from
# evaluated annotations (``__required_keys__``, which the tests check against)
from typing import Any, Literal, NotRequired, TypedDict

StageState = Literal["ok", "degraded", "failed"]


class Failure(TypedDict):
    """The part of the runtime that failed for good, and why; every open request then
    ends with ``runtime_failed`` and ``submit`` raises until the pipeline is started
    anew."""

    part: str
    """e.g. ``orchestrator control loop``, ``gateway on node n1: b.data``."""
    error: str


class WorkerHealth(TypedDict):
    """One worker's entry of :meth:`~omni_core.Pipeline.health` (a stage's name, or
    ``STAGE#i`` for each replica)."""

    alive: bool
    """Its process runs."""
    healthy: bool
    """It serves: ready (or draining, stopping), not dead, heartbeats on time, and the
    runtime has not failed."""
    state: str
    """starting | ready | unresponsive | draining | stopping | stopped | hung |
    restarting | dead | failed (``inline`` in the caller's process)."""
    stage: NotRequired[str]
    replica: NotRequired[int]
    pid: NotRequired[int | None]
    where: NotRequired[str | None]
    """Where it runs (a node), or why it failed."""
    restarts: NotRequired[int]
    exit: NotRequired[str | None]
    """Why it last ended (an exit status, a signal, hung)."""
    heartbeat_age_s: NotRequired[float | None]
    busy_s: NotRequired[float]
    load_s: NotRequired[float | None]
    started: NotRequired[str | None]
    """How it started: ``forked`` (from the zygote) or ``spawned``."""


Health = dict[str, WorkerHealth]
"""Per worker, its :class:`WorkerHealth`."""


class StageHealth(TypedDict):
    """One stage's replicas together (:meth:`~omni_core.Pipeline.stage_health`)."""

    state: StageState
    """``ok`` (every replica serves), ``degraded`` (one does not, another does) or
    ``failed`` (none serves)."""
    replicas: int
    """Running, not being scaled down."""
    serving: int


class Metrics(TypedDict):
    """:meth:`~omni_core.Pipeline.metrics`."""

    stages: dict[str, dict[str, Any]]
    """Per worker: its heartbeat's counters (:class:`~omni_core.events.StageStats`), with
    restarts, state and rates on the local backend."""
    requests: dict[str, Any]
    """Latency percentiles of the requests that ended."""
    counts: dict[str, int]
    """How requests ended, by outcome."""
    in_flight: int
    replicas: NotRequired[dict[str, Any]]
    """The autoscaler's view (local backend)."""
    cancel_acks: NotRequired[int]
