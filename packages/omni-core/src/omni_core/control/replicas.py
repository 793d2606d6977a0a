"""Replicas of a stage: which one a request is bound to, and how many run.

A stage with ``replicas`` runs several workers (``STAGE#0``, ``STAGE#1``, ...); to its
neighbours and the caller it is still one stage. The orchestrator binds each request, when
it is submitted, to one replica of every replicated stage (:class:`Router`), and the
binding travels with the request (``Submit.routes``, then the request's first event on each
edge), so every upstream sender routes the request's events to the same replica, and
windows, KV and per-request state stay in that replica. Cancel and deadlines go to every
replica (a replica that does not know the request ignores them).

The choice is load-aware: the serving replica with the fewest outstanding requests (bound
to it and not yet past it), ties taken in turn; never one that is dead, hung or being
scaled down. One that is late with its heartbeats, then one starting or restarting, is
taken only when no serving one has room; a full one (its outstanding requests reach its
``queue_capacity``) only when every replica that can take the request is full.

:class:`Autoscaler` sizes a stage with ``replicas: {min, max, target}``: it adds a replica
once the stage's outstanding requests stayed above ``target`` per replica for
``upscale_delay_s``, and drains one (no new bindings; its requests finish; then it shuts
down) after ``downscale_delay_s`` of low load. The supervisor and the orchestrator's loop
carry its decisions out.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from omni_core.client.collector import Collector
from omni_core.config import PipelineConfig, ReplicaSpec, replica_name
from omni_core.control.lifecycle import GONE, Life
from omni_core.control.supervisor import Supervisor, WorkerRecord
from omni_core.errors import StageDeadError

log = logging.getLogger("omni.replicas")
PLACE_RETRY_S = 10.0  # a replica that could not be placed is tried again after this


class Router:
    """Binds requests to replicas (the orchestrator's loop and submit, under the request
    table's lock)."""

    def __init__(self, cfg: PipelineConfig, supervisor: Supervisor, collector: Collector):
        self.cfg = cfg
        self.sup = supervisor
        self.collector = collector
        self.stages = [s.name for s in cfg.stages if cfg.replicated(s.name)]
        self.capacity = {n: cfg.setting(cfg.stage(n), "queue_capacity") for n in self.stages}
        self.turn: dict[str, int] = dict.fromkeys(self.stages, 0)

    def bind(self) -> dict[str, int] | None:
        """A replica of each replicated stage for a new request (None: there are none);
        :class:`StageDeadError` when a stage has no replica that can take it."""
        if not self.stages:
            return None
        return {stage: self.pick(stage) for stage in self.stages}

    def pick(self, stage: str) -> int:
        best: tuple[Any, ...] | None = None
        chosen = -1
        n = len(self.cfg.workers(stage))
        turn = self.turn[stage]
        for p in self.sup.procs.values():
            if p.stage != stage:
                continue
            rank = self.rank(p)
            if rank is None:
                continue
            load = self.collector.outstanding.get((stage, p.replica), 0)
            full = load >= self.capacity[stage]
            key = (full, rank, load, (p.replica - turn) % n)
            if best is None or key < best:
                best, chosen = key, p.replica
        if best is None:
            why = "; ".join(
                f"{p.name}: {p.state} ({p.exit_reason or p.hung or 'no reason'})"
                for p in self.sup.procs.values()
                if p.stage == stage
            )
            raise StageDeadError(
                f"stage {stage!r} has no replica that can take requests ({why}); "
                "the pipeline cannot serve requests"
            )
        self.turn[stage] = (chosen + 1) % n
        return chosen

    def rank(self, p: WorkerRecord) -> int | None:
        """0: serving; 1: late with its heartbeats; 2: starting or restarting (requests
        wait for it); None: never (dead, hung, being scaled down). Ranked within the
        replicas with room: a full one is taken only when every other is full too."""
        if p.state in GONE or p.state == Life.HUNG or p.retiring:
            return None
        if p.state == Life.READY and not p.dead:
            return 1 if self.sup.late(p, self.sup.clock()) else 0
        return 2


class Autoscaler:
    """Decides when an autoscaled stage gains or drains a replica."""

    def __init__(
        self,
        cfg: PipelineConfig,
        supervisor: Supervisor,
        collector: Collector,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.sup = supervisor
        self.collector = collector
        self.clock = clock
        self.specs: dict[str, ReplicaSpec] = {
            s.name: s.replicas for s in cfg.stages if isinstance(s.replicas, ReplicaSpec)
        }
        self.above: dict[str, float | None] = dict.fromkeys(self.specs)  # since when
        self.below: dict[str, float | None] = dict.fromkeys(self.specs)
        self.unplaced: dict[str, tuple[float, str]] = {}  # stage -> (when, why)
        self.events: list[dict[str, Any]] = []  # what it did, for metrics and tests

    def load(self, stage: str) -> int:
        """Requests bound to the stage's replicas and not yet past it."""
        return sum(v for (s, _), v in self.collector.outstanding.items() if s == stage)

    def live(self, stage: str) -> list[WorkerRecord]:
        return [
            p
            for p in self.sup.procs.values()
            if p.stage == stage and p.state not in GONE and not p.retiring
        ]

    def desired(self, stage: str) -> int:
        spec = self.specs[stage]
        want = math.ceil(self.load(stage) / spec.target) if spec.target else spec.max
        return max(spec.min, min(spec.max, want))

    def tick(self) -> tuple[list[str], list[WorkerRecord]]:
        """(workers to start, replicas to drain) now; the caller carries them out."""
        start: list[str] = []
        drain: list[WorkerRecord] = []
        now = self.clock()
        for stage, spec in self.specs.items():
            live = self.live(stage)
            want = self.desired(stage)
            if want > len(live):
                self.below[stage] = None
                since = self.above[stage] = self.above[stage] or now
                if now - since >= spec.upscale_delay_s and self._may_place(stage, now):
                    name = self._free_name(stage)
                    if name is not None:
                        start.append(name)
                        self.above[stage] = None
            elif want < len(live):
                self.above[stage] = None
                since = self.below[stage] = self.below[stage] or now
                if now - since >= spec.downscale_delay_s:
                    victim = self._victim(live)
                    if victim is not None:
                        drain.append(victim)
                        self.below[stage] = None
            else:
                self.above[stage] = self.below[stage] = None
        return start, drain

    def _may_place(self, stage: str, now: float) -> bool:
        last = self.unplaced.get(stage)
        return last is None or now - last[0] >= PLACE_RETRY_S

    def cannot_place(self, stage: str, why: str) -> None:
        """A replica of ``stage`` could not be started: reported, and not tried again for
        ``PLACE_RETRY_S``."""
        self.unplaced[stage] = (self.clock(), why)
        self.record("unplaced", stage, why=why)
        log.warning(
            "stage %s: a replica could not be placed (%s); next try in %.0f s",
            stage,
            why,
            PLACE_RETRY_S,
            extra={"stage": stage},
        )

    def _free_name(self, stage: str) -> str | None:
        used = {p.replica for p in self.sup.procs.values() if p.stage == stage}
        for i in range(self.specs[stage].max):
            if i not in used:
                return replica_name(stage, i)
        return None  # every name is taken (some still draining)

    def _victim(self, live: list[WorkerRecord]) -> WorkerRecord | None:
        """The replica to drain: the one with the fewest outstanding requests (the
        highest index among equals), never the last serving one."""
        serving = [p for p in live if p.state == Life.READY]
        if len(serving) <= 1:
            return None
        return min(
            serving,
            key=lambda p: (self.collector.outstanding.get((p.stage, p.replica), 0), -p.replica),
        )

    def record(self, what: str, stage: str, **detail: Any) -> None:
        self.events.append({"ts": time.time(), "event": what, "stage": stage, **detail})
        del self.events[:-256]

    def report(self) -> dict[str, dict[str, Any]]:
        """Per stage: replicas running and serving, outstanding requests, the bounds."""
        out = {}
        for st in self.cfg.stages:
            live = self.live(st.name)
            lo, hi = self.cfg.replica_range(st.name)
            spec = self.specs.get(st.name)
            unplaced = self.unplaced.get(st.name)
            out[st.name] = {
                "live": len(live),
                "ready": sum(p.state == Life.READY for p in live),
                "draining": sum(
                    p.stage == st.name and p.state in (Life.DRAINING, Life.STOPPING)
                    for p in self.sup.procs.values()
                ),
                "bound": self.load(st.name),
                "min": lo,
                "max": hi,
                "target": spec.target if spec is not None else None,
                "unplaced": unplaced[1] if unplaced is not None else None,
            }
        return out
