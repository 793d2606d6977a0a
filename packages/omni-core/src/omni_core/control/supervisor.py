"""The lives of a pipeline's stage workers: spawn, ready, death, restart, liveness.

The supervisor decides; it touches no socket and no request. The orchestrator's I/O loop
feeds it what it sees (status messages, exit fds, the clock) and acts on what it returns:
which workers ended, which to restart, which are hung. So every rule here (the restart
budget over a window, back-off, the stall timeout) is testable with a fake launcher.

Liveness is the stage's progress, not only its process: heartbeats carry how long the
stage thread has been inside its current step. A stage silent (no heartbeat: stopped,
frozen) or busy on one step for longer than its ``stall_timeout_s`` is hung: the
supervisor kills it, and its end goes down the crash path (requests fail with
``stage_hung``, the stage restarts).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omni_core.config import PipelineConfig, split_worker
from omni_core.control.launcher import Launcher, WorkerHandle, report
from omni_core.control.lifecycle import SERVING, Life, move
from omni_core.events import Heartbeat, LoadFailed, Ready, StageStats
from omni_core.health import Health, StageHealth
from omni_core.registry import load_stage_class

log = logging.getLogger("omni.supervisor")
MAX_BACKOFF_S = 10.0
LATE_HEARTBEATS = 3  # heartbeats missed before health calls a stage unresponsive
MIN_LATE_S = 1.0


@dataclass
class WorkerRecord:
    """One stage's worker: the current process, and the stage's life across restarts.
    Written by the :class:`Supervisor` alone (others read it)."""

    name: str  # the worker's: the stage's, or STAGE#i for a replica
    kind: str
    worker: WorkerHandle
    idempotent: bool = False
    stage: str = ""  # the stage it runs
    replica: int = 0  # its index among the stage's replicas
    ready: bool = False
    dead: bool = False  # this process has exited
    # its life (omni_core.control.lifecycle): changed by the supervisor alone, through
    # lifecycle.move; only a starting worker becomes ready (a late ready leaves a stopping
    # or hung one as it is)
    state: Life = Life.STARTING
    scaled: bool = False  # started by the autoscaler (not with the pipeline)
    retiring: bool = False  # being scaled down (or never came up): never restarted
    restarts: int = 0  # over the stage's whole life (metrics)
    recent: deque[float] = field(default_factory=deque)  # restart times within the window
    spawned_at: float = 0.0
    restart_at: float = 0.0
    exit_reason: str = ""
    hung: str = ""  # why it was declared hung (then killed)
    load_error: str = ""
    load_s: float = 0.0
    last_heartbeat: float = 0.0
    stats: StageStats = field(default_factory=StageStats)
    rates: dict[str, float] = field(default_factory=dict)


class Supervisor:
    def __init__(
        self,
        cfg: PipelineConfig,
        launcher: Launcher,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.launcher = launcher
        self.clock = clock
        self.procs: dict[str, WorkerRecord] = {}
        self.on_message: dict[type, Callable[[WorkerRecord, Any, float], None]] = {
            Heartbeat: self._heartbeat,
            Ready: self._ready,
            LoadFailed: self._load_failed,
        }
        """The status messages the supervisor reads, by type, and what each does."""

    def spawn(self, name: str, scaled: bool = False) -> WorkerRecord:
        """Start (or restart) worker ``name`` (a stage's, or ``STAGE#i``); the restart
        history carries over. ``scaled``: an added replica (the autoscaler's)."""
        stage, replica = split_worker(name)
        st = self.cfg.stage(stage)
        worker = self.launcher.spawn(name)
        idempotent = bool(getattr(load_stage_class(st.kind), "idempotent", False))
        p = WorkerRecord(
            name,
            st.kind,
            worker,
            idempotent,
            stage,
            replica,
            spawned_at=self.clock(),
            scaled=scaled,
        )
        old = self.procs.get(name)
        if old is not None:
            p.restarts, p.recent = old.restarts, old.recent
        self.procs[name] = p
        return p

    # -- what the loop sees ----------------------------------------------------
    def on_status(self, msg: Any) -> None:
        """A worker's ready, load failure or heartbeat (an ack is the orchestrator's)."""
        p = self.procs.get(msg.stage)
        handler = self.on_message.get(type(msg))
        if p is None or handler is None:
            return
        handler(p, msg, self.clock())

    def _heartbeat(self, p: WorkerRecord, msg: Heartbeat, now: float) -> None:
        if p.last_heartbeat and now > p.last_heartbeat:
            dt = now - p.last_heartbeat
            p.rates = {
                "enqueue_per_s": (msg.stats.received - p.stats.received) / dt,
                "dequeue_per_s": (msg.stats.dequeued - p.stats.dequeued) / dt,
            }
        p.last_heartbeat = now
        p.stats = msg.stats

    def _ready(self, p: WorkerRecord, msg: Ready, now: float) -> None:
        p.load_s = msg.load_s
        if p.retiring or p.state != Life.STARTING:  # scaled down, hung or ended: it stays so
            log.info(
                "stage %s: ready too late, already %s", p.name, p.state, extra={"stage": p.name}
            )
            return
        p.ready = True
        move(p, Life.READY)
        p.last_heartbeat = now
        report(f"{p.name}: ready, loaded in {msg.load_s:.1f} s")

    def _load_failed(self, p: WorkerRecord, msg: LoadFailed, now: float) -> None:
        p.load_error = msg.message

    def ended(self, readable: dict[Any, int]) -> list[WorkerRecord]:
        """Live workers that ended: their exit fd is in ``readable``, or (no fd) they say so."""
        self.launcher.tick()
        out = []
        for p in self.procs.values():
            if p.dead:
                continue
            fd = p.worker.fileno()
            if (fd in readable) if fd is not None else p.worker.exited():
                out.append(p)
        return out

    def on_death(self, p: WorkerRecord, restart: bool = True) -> None:
        """Reap an ended worker and decide: restart after a back-off, or dead for good
        (``max_restarts`` restarts within ``restart_window_s`` already). ``restart``
        False (an added replica that never came up) or a retiring one: stopped."""
        p.exit_reason = p.worker.reap()
        p.dead = True
        p.ready = False
        if not restart:
            p.retiring = True  # the autoscaler tries again later
        if p.retiring:  # scaled down (a crash or hang while draining too): not restarted
            move(p, Life.STOPPED)
            return
        st = self.cfg.stage(p.stage)
        now = self.clock()
        while p.recent and now - p.recent[0] > st.restart_window_s:
            p.recent.popleft()
        if len(p.recent) < st.max_restarts:
            move(p, Life.RESTARTING)
            backoff = min(MAX_BACKOFF_S, st.restart_backoff_s * (2 ** len(p.recent)))
            p.restart_at = now + backoff
        else:
            move(p, Life.DEAD)

    def reaped(self, p: WorkerRecord) -> str:
        """An ended worker whose end decides nothing (the pipeline is closing, or failed
        to start): reaped and marked dead, never restarted; why it ended."""
        p.exit_reason = p.worker.reap()
        p.dead = True
        p.ready = False
        return p.exit_reason

    def stop_now(self, p: WorkerRecord, timeout_s: float) -> None:
        """The pipeline closing: ``p``'s worker told to stop, killed past ``timeout_s``."""
        p.worker.stop(timeout_s)
        p.dead = True
        p.ready = False

    def why(self, p: WorkerRecord) -> tuple[str, str]:
        """(message, code) for the requests an ended worker takes down."""
        replica = f" replica {p.replica}" if p.name != p.stage else ""
        where = f"stage {p.stage!r}{replica} worker (pid {p.worker.pid}, {p.worker.where})"
        if p.hung:
            return f"{where} {p.hung}; it was killed", "stage_hung"
        return f"{where} {p.exit_reason}", "stage_died"

    def due_restarts(self) -> list[WorkerRecord]:
        """Restart the stages whose back-off is over; the new lives."""
        now = self.clock()
        out = []
        for p in list(self.procs.values()):
            if p.state != Life.RESTARTING or now < p.restart_at:
                continue
            p.restarts += 1
            p.recent.append(now)
            log.warning(
                "restarting stage %s (restart %d)", p.name, p.restarts, extra={"stage": p.name}
            )
            try:
                out.append(self.spawn(p.name))
            except Exception as e:  # cannot even start a process: the stage is dead
                move(p, Life.DEAD)
                p.exit_reason = f"restart failed: {e}"
                log.error("stage %s: %s", p.name, p.exit_reason, extra={"stage": p.name})
        return out

    def check_liveness(self) -> list[WorkerRecord]:
        """Kill every stage that is hung (silent or stuck on one step past its stall
        timeout) or a restart that did not come up within ``ready_timeout_s``; their ends
        are then seen by :meth:`ended` like any death."""
        now = self.clock()
        killed = []
        for p in self.procs.values():
            if p.dead or p.hung:
                continue
            reason = self._stalled(p, now)
            if reason:
                p.hung = reason
                move(p, Life.HUNG)
                log.error("stage %s %s: killing it", p.name, reason, extra={"stage": p.name})
                p.worker.kill()
                killed.append(p)
        return killed

    def _stalled(self, p: WorkerRecord, now: float) -> str:
        if not p.ready:
            waited = now - p.spawned_at
            if p.restarts and waited > self.cfg.ready_timeout_s:
                return f"was not ready {waited:.1f} s after its restart (ready_timeout_s)"
            return ""
        limit = self.cfg.stage(p.stage).stall_timeout_s
        if limit is None:
            return ""
        silent = now - p.last_heartbeat
        if silent > limit:
            return f"sent no heartbeat for {silent:.1f} s (stall_timeout_s={limit:g})"
        busy = p.stats.busy_s + silent if p.stats.busy_s else 0.0
        if busy > limit:
            return f"was busy on one step for {busy:.1f} s (stall_timeout_s={limit:g})"
        return ""

    # -- scaling down (the autoscaler decides, the orchestrator asks) -------------
    def drain(self, p: WorkerRecord) -> None:
        """A replica scaled down: no new requests from now on; it is never restarted."""
        p.retiring = True
        move(p, Life.DRAINING)

    def stop(self, p: WorkerRecord) -> None:
        """A drained replica (its requests are past it) is told to shut down, or an added
        one is let go before it was ready (the caller kills it): never restarted."""
        p.retiring = True
        move(p, Life.STOPPING)

    # -- what callers see ------------------------------------------------------
    def late(self, p: WorkerRecord, now: float) -> bool:
        """Its heartbeats stopped (a few intervals missed): not healthy, even before the
        stall timeout has it killed."""
        limit = max(MIN_LATE_S, LATE_HEARTBEATS * self.cfg.heartbeat_interval_s)
        return p.ready and not p.dead and now - p.last_heartbeat > limit

    def health(self) -> Health:
        """Per stage: alive, healthy, state, pid, restarts, why it last ended."""
        now = self.clock()
        out: Health = {}
        for n, p in list(self.procs.items()):
            late = self.late(p, now)
            out[n] = {
                "stage": p.stage,
                "replica": p.replica,
                "alive": not p.dead and not p.worker.exited(),
                "healthy": p.state in SERVING and not p.dead and not late,
                "state": "unresponsive" if late and p.state == Life.READY else str(p.state),
                "pid": p.worker.pid,
                "where": p.worker.where,
                "restarts": p.restarts,
                "exit": p.hung or p.exit_reason,
                "heartbeat_age_s": now - p.last_heartbeat if p.last_heartbeat else None,
                "busy_s": p.stats.busy_s,
                "load_s": p.load_s,
                "started": getattr(p.worker, "started", None),
            }
        return out


def stage_health(workers: Health) -> dict[str, StageHealth]:
    """Per stage, from :meth:`Supervisor.health`'s per-worker entries: ``ok`` (every
    replica healthy), ``degraded`` (one is not, but another serves: the stage still takes
    requests) or ``failed`` (none serves); with its replicas running and serving. A
    replica being scaled down (draining, stopping) counts as neither."""
    out: dict[str, StageHealth] = {}
    for name, h in workers.items():
        s = out.setdefault(h.get("stage", name), {"state": "failed", "replicas": 0, "serving": 0})
        if h.get("state") in ("draining", "stopping", "stopped"):
            continue
        s["replicas"] += 1
        s["serving"] += bool(h.get("healthy"))
    for s in out.values():
        n, ok = s["replicas"], s["serving"]
        s["state"] = "ok" if n and ok == n else "degraded" if ok else "failed"
    return out
