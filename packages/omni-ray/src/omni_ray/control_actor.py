"""The control plane as a Ray actor, for callers outside the cluster (Ray Client).

A Ray Client caller cannot bind the head node's sockets nor map its shared memory, so
:class:`ControlActor` runs the usual :class:`~omni_core.orchestrator.Orchestrator` (over a
:class:`~omni_ray.launcher.RayLauncher`, which finds Ray already initialized) on the head
node, and hands the caller its events in batches: every request's events go into one
queue, and :meth:`ControlActor.poll` returns all that is ready (long-poll), encoded as one
frame, with the events' arrays beside it as flat numpy arrays (the collector's own copies:
no shared-memory view leaves the actor), which Ray serializes out of band, unlike bytes
inlined into the frame.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from typing import Any

import msgspec
from omni_core.collector import RequestHandle
from omni_core.config import PipelineConfig
from omni_core.delivery import DONE
from omni_core.events import InlineArray
from omni_core.serial import _as_bytes_view, decode_json, encode_frame

log = logging.getLogger("omni.ray.client")
BATCH_BYTES = 64 << 20  # a poll returns at most about this much (one larger event alone)


class EventQueue:
    """Events of every request, in the order the collector delivered them."""

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.ready = threading.Condition()
        self.closed = False

    def put(self, ev: Any) -> None:
        with self.ready:
            self.items.append(ev)
            self.ready.notify_all()

    def take(self, timeout_s: float, max_bytes: int = BATCH_BYTES) -> list[Any]:
        """What is ready now, else what arrives within ``timeout_s`` (a long poll)."""
        with self.ready:
            if not self.items and not self.closed:
                self.ready.wait(timeout_s)
            out: list[Any] = []
            size = 0
            while self.items and (not out or size < max_bytes):
                ev = self.items.popleft()
                size += sum(a.nbytes for a in ev.__dict__.get("flat", {}).values())
                out.append(ev)
            return out

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify_all()


class ForwardInbox:
    """Stands in for a request's inbox in the actor: events go to the shared queue; each
    array becomes a flat uint8 array (``flat``, beside the frame) and a handle without
    data that says its dtype and shape (the collector already copied it out of shared
    memory)."""

    def __init__(self, queue: EventQueue, sequence: int = 0) -> None:
        self.queue = queue
        self.sequence = sequence

    def put(self, item: Any) -> bool:
        if item is DONE:  # the terminal event, already forwarded, ends the stream
            return True
        item.sequence = self.sequence
        self.sequence += 1
        handles, flats = {}, {}
        for key, value in (item.__dict__.pop("arrays", None) or {}).items():
            flats[key], dtype, shape, torch_ = _as_bytes_view(value)
            handles[key] = InlineArray(b"", dtype, shape, torch_)
        item.device_handles = handles
        if flats:
            item.flat = flats
        self.queue.put(item)
        return True

    def __len__(self) -> int:
        return 0


class ControlActor:
    """Run as a Ray actor (threaded: :meth:`poll` waits while calls go on) on the head node."""

    def __init__(self, cfg_json: bytes) -> None:
        from omni_core.logs import configure_logging
        from omni_core.orchestrator import Orchestrator

        from omni_ray.launcher import RayLauncher

        configure_logging()
        self.cfg = decode_json(cfg_json, PipelineConfig)
        self.queue = EventQueue()
        self.launcher = RayLauncher(self.cfg)
        self.orch = Orchestrator(self.cfg, self.launcher)
        self.polls = 0

    def start(self) -> dict[str, Any]:
        """Start the stages (raises as ``Orchestrator.start``); where the actor runs."""
        import os

        self.orch.start()
        return {"pipeline_id": self.launcher.pipeline_id, "pid": os.getpid()}

    def submit(self, request: dict[str, Any], request_id: str, timeout_s: float | None) -> None:
        h = self.orch.submit(request, request_id, timeout_s)
        self._forward(h)

    def _forward(self, h: RequestHandle) -> None:
        """Point ``h``'s events at the shared queue, with any that arrived already (under
        the request table's lock, as the control loop delivers)."""
        with self.orch.requests.lock:
            old = h._inbox
            fwd = ForwardInbox(self.queue)
            with old.lock:
                early = list(old.items)
            h._inbox = fwd  # type: ignore[assignment]
            for item in early:
                fwd.put(item)

    def cancel(self, request_id: str) -> bool:
        return self.orch.cancel(request_id)

    def poll(self, timeout_s: float) -> tuple[int, bytes, list[Any], dict[str, str] | None]:
        """(batch number, the events ready as one frame, per event its flat arrays by name
        or None, the runtime's failure)."""
        try:
            events = self.queue.take(timeout_s)
            flats = [ev.__dict__.pop("flat", None) for ev in events]
            self.polls += 1
            frame = encode_frame(events) if events else b""
            return self.polls, frame, flats, self.orch.failure
        except Exception:
            log.error("poll failed:\n%s", traceback.format_exc())
            raise

    def health(self) -> dict[str, dict[str, Any]]:
        return self.orch.health()

    def metrics(self) -> dict[str, Any]:
        return self.orch.metrics()

    def close(self, graceful: bool, timeout_s: float) -> None:
        """Stop the stages and gateways; events still queued stay for a last poll."""
        t0 = time.monotonic()
        try:
            self.orch.close(graceful=graceful, timeout_s=timeout_s)
        finally:
            self.queue.close()
            log.info("closed in %.1fs", time.monotonic() - t0)


def encode_config(cfg: PipelineConfig) -> bytes:
    return msgspec.json.encode(cfg)
