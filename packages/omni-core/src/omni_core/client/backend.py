"""What a :class:`~omni_core.pipeline.Pipeline` runs on: one :class:`Backend`.

Three implement it: the :class:`~omni_core.control.orchestrator.Orchestrator` (workers
through a launcher), the :class:`~omni_core.client.inline.InlineRunner` (every stage in
this process) and, in ``omni-ray``, the Ray Client backend (the orchestrator in an actor
of the cluster). :func:`~omni_core.pipeline.make_backend` chooses one for a config.
"""

from __future__ import annotations

import asyncio
import uuid
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

from omni_core.client.collector import Collector, RequestHandle
from omni_core.config import PipelineConfig
from omni_core.dataplane.serial import check_request
from omni_core.errors import RuntimeFailedError
from omni_core.health import Failure, Health, Metrics
from omni_core.scheduling import check_priority

ReaderLoop = asyncio.AbstractEventLoop | None  # where an asyncio reader takes the events


class Backend(ABC):
    """Runs one pipeline's requests; the caller's side of them is :attr:`collector`.

    :meth:`submit` is written here once: its checks, the request id, the request's
    handle, and the rollback when sending it fails; a backend supplies how a request is
    opened (:meth:`open_request`) and sent (:meth:`send_request`).
    """

    cfg: PipelineConfig
    collector: Collector  # every open request, by the caller's id and by wire id
    lock: AbstractContextManager[Any]  # the collector's: callers and the I/O thread share it
    # set once a part of the runtime failed for good: {"part": ..., "error": ...}
    failure: Failure | None = None

    # ------------------------------------------------------------------ lifecycle
    @abstractmethod
    def start(self) -> None:
        """Start every stage; raise :class:`~omni_core.errors.StageStartError` when one
        does not come up."""

    @abstractmethod
    def running(self) -> bool:
        """Started, and not closed."""

    @abstractmethod
    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        """Stop every stage (``graceful``: queued work first) and end the open requests."""

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        request: dict[str, Any],
        request_id: str | None = None,
        timeout_s: float | None = None,
        loop: ReaderLoop = None,
    ) -> RequestHandle:
        """Start a request (``timeout_s`` None: the config's ``request_timeout_s``); its
        events come through the handle (to ``loop`` for an asyncio reader)."""
        self.check_serving()
        rid = request_id or uuid.uuid4().hex
        timeout_s = timeout_s if timeout_s is not None else self.cfg.request_timeout_s
        check_priority(request, self.cfg)  # first: its error names the field
        check_request(request, rid)
        h = self.open_request(rid, request, timeout_s, loop)
        try:
            self.send_request(h, request, timeout_s)
        except BaseException:
            self.abandon(h)
            raise
        return h

    def abandon(self, h: RequestHandle) -> None:
        """``h``'s request could not be sent (its send raised): it leaves no trace."""
        with self.lock:
            self.collector.forget(h)

    def check_serving(self) -> None:
        """Raise when no request can be taken now."""
        if self.failure is not None:
            raise RuntimeFailedError.of(self.failure)
        if not self.running():
            raise RuntimeError("pipeline is not running")

    def open_request(
        self, request_id: str, request: dict[str, Any], timeout_s: float | None, loop: ReaderLoop
    ) -> RequestHandle:
        """The new request's handle, open in the collector."""
        with self.lock:
            return self.collector.open(request_id, loop)

    @abstractmethod
    def send_request(
        self, h: RequestHandle, request: dict[str, Any], timeout_s: float | None
    ) -> None:
        """Send ``request``, opened as ``h``, to the stages."""

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """End an open request as cancelled; False when it is not open."""

    def open_requests(self) -> int:
        """How many requests are open."""
        return len(self.collector.handles)

    # ------------------------------------------------------------------ state
    @abstractmethod
    def health(self) -> Health:
        """Per worker (a stage's name, or ``STAGE#i`` for a replica): its state."""

    @abstractmethod
    def metrics(self) -> Metrics:
        """Per stage counters, per request latencies, counts of outcomes."""

    def zygote(self) -> dict[str, Any] | None:
        """How the workers start (see :meth:`Pipeline.zygote`); None where that does not
        apply."""
        return None

    def chrome_trace(self) -> dict[str, Any]:
        """The run so far as Chrome trace JSON; only an orchestrator in this process
        records one."""
        raise RuntimeError(
            "traces are recorded by an orchestrator in this process (mrs.enabled: true, "
            f"not {type(self).__name__})"
        )
