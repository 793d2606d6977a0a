"""The open requests of one pipeline: admission control (the ``max_queued_requests`` cap
on open requests), deadlines, and what a stage's death does to them.

Caller threads open and cancel requests; the orchestrator's I/O loop delivers events,
expires deadlines and ends requests. Everything goes through :attr:`RequestTable.lock`,
which also guards the collector.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import threading
import time
from typing import Any

from omni_core.client.collector import Collector, RequestHandle
from omni_core.config import PipelineConfig
from omni_core.errors import OverloadedError
from omni_core.events import Cancelled, Error


class RequestTable:
    def __init__(self, cfg: PipelineConfig, collector: Collector) -> None:
        self.cfg = cfg
        self.collector = collector
        self.lock = threading.RLock()
        self.deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id)

    def open(
        self,
        request_id: str,
        request: dict[str, Any],
        timeout_s: float | None,
        loop: asyncio.AbstractEventLoop | None,
    ) -> RequestHandle:
        """Open a request once admitted (see :meth:`_admit`)."""
        if timeout_s is not None and not (0 < timeout_s < math.inf):
            raise ValueError(f"request {request_id}: timeout_s must be a positive finite number")
        with self.lock:
            self._admit()
            h = self.collector.open(request_id, loop)
            h.request = request
            if timeout_s is not None:
                h.deadline = h.submitted + timeout_s
                h.deadline_wall = time.time() + timeout_s
                heapq.heappush(self.deadlines, (h.deadline, request_id))
        return h

    def _admit(self) -> None:
        """(Lock held.) Admission control of requests: raise :class:`OverloadedError`
        while ``max_queued_requests`` are open."""
        cap = self.cfg.max_queued_requests
        n = len(self.collector.handles)
        if cap is not None and n >= cap:
            raise OverloadedError(
                f"{n} requests are open (max_queued_requests={cap}); retry later",
                retry_after_s=1.0,
            )

    def cancel(self, request_id: str) -> str | None:
        """End a request as cancelled; its wire id (None: not open)."""
        with self.lock:
            h = self.collector.handles.get(request_id)
            if h is None:
                return None
            self.collector.finish(h, Cancelled(request_id=request_id, reason="cancelled"))
            return h.wire_id

    def expire(self) -> list[str]:
        """End the requests whose deadline passed (a heap: no scan); their wire ids."""
        now = time.monotonic()
        if not self.deadlines or self.deadlines[0][0] > now:
            return []
        expired = []
        with self.lock:
            while self.deadlines and self.deadlines[0][0] <= now:
                _, rid = heapq.heappop(self.deadlines)
                h = self.collector.handles.get(rid)
                if h is not None:  # else it ended already
                    self.collector.finish(h, Cancelled(request_id=h.request_id, reason="timeout"))
                    expired.append(h.wire_id)
        return expired

    def on_stage_death(
        self,
        stage: str,
        replica: int | None,
        downstream: list[str],
        replayable: bool,
        why: str,
        code: str,
    ) -> tuple[list[str], list[RequestHandle]]:
        """A stage's worker ended (``replica`` of a replicated stage, else None): every
        request it may have held fails (or, when ``replayable``, starts a new attempt);
        a replica's death touches only the requests bound to it. Returns (wire ids to
        cancel everywhere, handles to submit again)."""
        cancel: list[str] = []
        replay: list[RequestHandle] = []
        with self.lock:
            for h in list(self.collector.handles.values()):
                if replica is not None and (h.routes or {}).get(stage) != replica:
                    continue  # bound to another replica
                if self._past(h, stage, downstream):
                    continue
                cancel.append(h.wire_id)
                if replayable and self.collector.replay(h):
                    replay.append(h)
                else:
                    err = Error(request_id=h.request_id, stage=stage, message=why, code=code)
                    self.collector.finish(h, err)
        return cancel, replay

    @staticmethod
    def _past(h: RequestHandle, stage: str, downstream: list[str]) -> bool:
        """``h`` went past ``stage``, and its output arrived downstream: the stage's worker
        may go away without touching it."""
        return stage in h.stages_done and all(
            (stage, d) in h.edges_done or d in h.stages_done for d in downstream
        )

    def holds(self, stage: str, replica: int, downstream: list[str]) -> bool:
        """Some open request bound to ``replica`` of ``stage`` still needs that worker."""
        with self.lock:
            return any(
                (h.routes or {}).get(stage) == replica and not self._past(h, stage, downstream)
                for h in self.collector.handles.values()
            )

    def wire_ids(self) -> set[str]:
        with self.lock:
            return set(self.collector.wire)

    def fail_all(self, message: str, code: str, stage: str = "") -> None:
        with self.lock:
            self.collector.fail_all(message, code=code, stage=stage)
