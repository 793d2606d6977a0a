"""A worker's life as the orchestrator sees it: its states and the moves between them.

The supervisor (:class:`~omni_core.control.supervisor.Supervisor`) is the one owner: every
change of :attr:`WorkerRecord.state <omni_core.control.supervisor.WorkerRecord.state>`
goes through :func:`move`, which holds it to :data:`TRANSITIONS`. A move the table does
not list is a bug in the runtime: it raises :class:`LifecycleError`, which fails the
control loop, and with it the runtime, loudly.

::

    starting -> ready -> draining -> stopping -> stopped       (scaled down)
        |         |          |           |
        +---------+----------+-----------+-> hung -> restarting | dead | stopped
        |         |                                  (killed; its end as any death)
        +---------+-> restarting -> (a new life: starting) | dead (the restart failed)
        +---------+-> dead          (max_restarts within restart_window_s)
    starting -> stopping            (an added replica let go: not placed, not ready in time)
    starting -> stopped             (an added replica that died before it was ready)
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol


class Life(StrEnum):
    """A worker's state; the string is what ``health()`` reports."""

    STARTING = "starting"
    """Spawned, not ready yet."""
    READY = "ready"
    """Serving."""
    DRAINING = "draining"
    """Scaled down: no new requests; those bound to it finish."""
    STOPPING = "stopping"
    """Told to shut down (drained), or let go before it was ready."""
    STOPPED = "stopped"
    """Ended after it was scaled down or let go: never restarted."""
    HUNG = "hung"
    """Silent or stuck past its stall timeout: killed; its end follows."""
    RESTARTING = "restarting"
    """Ended; a new life starts after the back-off."""
    DEAD = "dead"
    """Ended for good (``max_restarts`` restarts within ``restart_window_s``, or a
    restart that could not start)."""


TRANSITIONS: dict[Life, frozenset[Life]] = {
    Life.STARTING: frozenset(
        {Life.READY, Life.STOPPING, Life.HUNG, Life.STOPPED, Life.RESTARTING, Life.DEAD}
    ),
    Life.READY: frozenset({Life.DRAINING, Life.HUNG, Life.RESTARTING, Life.DEAD}),
    Life.DRAINING: frozenset({Life.STOPPING, Life.HUNG, Life.STOPPED}),
    Life.STOPPING: frozenset({Life.HUNG, Life.STOPPED}),
    Life.HUNG: frozenset({Life.STOPPED, Life.RESTARTING, Life.DEAD}),
    Life.RESTARTING: frozenset({Life.DEAD}),
    Life.STOPPED: frozenset(),
    Life.DEAD: frozenset(),
}
"""From each state, the states a worker may move to."""

SERVING = frozenset({Life.READY, Life.DRAINING, Life.STOPPING})
"""States in which a live worker counts as healthy (a draining one still finishes its
requests)."""
GONE = frozenset({Life.DEAD, Life.STOPPED, Life.DRAINING, Life.STOPPING})
"""States no new request is bound to."""


class LifecycleError(RuntimeError):
    """A move :data:`TRANSITIONS` does not list: a bug in the runtime."""


class _Record(Protocol):
    name: str
    state: Life


def move(record: _Record, to: Life) -> None:
    """Set ``record``'s state to ``to``, if the table allows it."""
    if to not in TRANSITIONS[record.state]:
        raise LifecycleError(f"worker {record.name}: {record.state} -> {to} is not a transition")
    record.state = to
