"""The control plane as a Ray actor, for callers outside the cluster (Ray Client).

A Ray Client caller cannot bind the head node's sockets nor map its shared memory, so
:class:`ControlActor` runs the usual :class:`~omni_core.control.orchestrator.Orchestrator` (over a
:class:`~omni_ray.launcher.RayLauncher`, which finds Ray already initialized) on the head
node, and hands the caller its events in batches: each request's events wait in its own
inbox (merged, for a caller that polls slower than the stages produce, as the caller's own
inbox would merge them), one queue lists the requests that have some, and
:meth:`ControlActor.poll` returns all that is ready (long-poll), encoded as one frame,
with the events' arrays beside it as flat numpy arrays (the collector's own copies: no
shared-memory view leaves the actor), which Ray serializes out of band, unlike bytes
inlined into the frame.

Ray names no caller, and the actor has a name any process of the cluster may look up, so
every call carries the token its creator (:class:`~omni_ray.client.RayClientBackend`)
made and gave it at creation (``secrets.token_hex(32)``), checked with
:func:`hmac.compare_digest`: without it no one else can submit, cancel, poll the events,
read health or metrics, or close the pipeline (``PermissionError``, counted in
``refused``).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import traceback
from typing import Any

import msgspec
from omni_core.client.collector import RequestHandle
from omni_core.client.delivery import DONE, Inbox
from omni_core.config import PipelineConfig
from omni_core.control.orchestrator import Orchestrator
from omni_core.dataplane.serial import array_to_flat, decode_json, encode_frame
from omni_core.events import InlineArray
from omni_core.observability.logs import configure_logging

from omni_ray.launcher import RayLauncher

log = logging.getLogger("omni.ray.client")
BATCH_BYTES = 64 << 20  # a poll returns at most about this much (one larger event alone)


class EventQueue:
    """The requests whose inboxes hold events for the caller, in the order they got them
    (each request's own events stay in its inbox, in order, until a poll takes them)."""

    def __init__(self) -> None:
        self.waiting: dict[int, ForwardInbox] = {}  # insertion-ordered
        self.ready = threading.Condition()
        self.closed = False

    def notify(self, inbox: ForwardInbox) -> None:
        with self.ready:
            self.waiting.setdefault(id(inbox), inbox)
            self.ready.notify_all()

    def take(self, timeout_s: float, max_bytes: int = BATCH_BYTES) -> list[Any]:
        """What is ready now, else what arrives within ``timeout_s`` (a long poll)."""
        with self.ready:
            if not self.waiting and not self.closed:
                self.ready.wait(timeout_s)
            out: list[Any] = []
            size = 0
            while self.waiting and (not out or size < max_bytes):
                key, inbox = next(iter(self.waiting.items()))
                size += inbox.drain(out, max_bytes - size)
                if not len(inbox):  # (a put after this finds it gone and adds it again)
                    del self.waiting[key]
            return out

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify_all()


class ForwardInbox(Inbox):
    """A request's inbox in the actor: it numbers and, for a caller that polls slower than
    the stages produce, merges its events as the caller's own inbox would (so what waits
    is bounded by the request's output, not by its event count), and tells the shared
    queue it has some. A poll turns each event's arrays into flat uint8 arrays (``flat``,
    beside the frame) and handles without data that say their dtype and shape (the
    collector already copied them out of shared memory)."""

    def __init__(self, queue: EventQueue) -> None:
        super().__init__(None)
        self.queue = queue

    def put(self, item: Any) -> bool:
        if item is DONE:  # the terminal event, already forwarded, ends the stream
            return True
        super().put(item)
        self.queue.notify(self)
        return True

    def drain(self, out: list[Any], max_bytes: int) -> int:
        """Move waiting events into ``out`` (at least one) up to about ``max_bytes`` of
        arrays; returns their bytes."""
        size = 0
        with self.lock:
            while self.items and (size < max_bytes or not out):
                item = self.items.popleft()
                handles, flats = {}, {}
                for key, value in (item.__dict__.pop("arrays", None) or {}).items():
                    flats[key], dtype, shape, torch_ = array_to_flat(value)
                    handles[key] = InlineArray(b"", dtype, shape, torch_)
                    size += flats[key].nbytes
                item.device_handles = handles
                if flats:
                    item.flat = flats
                out.append(item)
        return size


class ControlActor:
    """Run as a Ray actor (threaded: :meth:`poll` waits while calls go on) on the head node."""

    def __init__(self, cfg_json: bytes, token: str) -> None:
        """``token``: what every call must carry (its creator's)."""
        configure_logging()
        self._token = token
        self.refused = 0  # calls without the token
        self.cfg = decode_json(cfg_json, PipelineConfig)
        self.queue = EventQueue()
        self.launcher = RayLauncher(self.cfg)
        self.orch = Orchestrator(self.cfg, self.launcher)
        self.polls = 0

    def _check(self, method: str, token: Any) -> None:
        """Refuse (count, log, :class:`PermissionError`) a call without the token."""
        if isinstance(token, str) and hmac.compare_digest(token.encode(), self._token.encode()):
            return
        self.refused += 1
        log.warning("refused a call of %s without the caller's token (%d)", method, self.refused)
        raise PermissionError(f"the control actor: {method} refused: not its caller's token")

    def start(self, token: str) -> dict[str, Any]:
        """Start the stages (raises as ``Orchestrator.start``); where the actor runs."""
        import os

        self._check("start", token)
        self.orch.start()
        return {"pipeline_id": self.launcher.pipeline_id, "pid": os.getpid()}

    def submit(
        self, token: str, request: dict[str, Any], request_id: str, timeout_s: float | None
    ) -> None:
        self._check("submit", token)
        h = self.orch.submit(request, request_id, timeout_s)
        self._forward(h)

    def _forward(self, h: RequestHandle) -> None:
        """Point ``h``'s events at the shared queue, with any that arrived already (under
        the request table's lock, as the control loop delivers)."""
        with self.orch.requests.lock:
            old = h._inbox
            fwd = ForwardInbox(self.queue)
            with old.lock:
                early = [item for item in old.items if item is not DONE]
            h._inbox = fwd  # type: ignore[assignment]
            for item in early:
                fwd.put(item)

    def cancel(self, token: str, request_id: str) -> bool:
        self._check("cancel", token)
        return self.orch.cancel(request_id)

    def poll(
        self, token: str, timeout_s: float
    ) -> tuple[int, bytes, list[Any], dict[str, str] | None]:
        """(batch number, the events ready as one frame, per event its flat arrays by name
        or None, the runtime's failure)."""
        self._check("poll", token)
        try:
            events = self.queue.take(timeout_s)
            flats = [ev.__dict__.pop("flat", None) for ev in events]
            self.polls += 1
            frame = encode_frame(events) if events else b""
            return self.polls, frame, flats, self.orch.failure
        except Exception:
            log.error("poll failed:\n%s", traceback.format_exc())
            raise

    def health(self, token: str) -> dict[str, dict[str, Any]]:
        self._check("health", token)
        return self.orch.health()

    def metrics(self, token: str) -> dict[str, Any]:
        self._check("metrics", token)
        return self.orch.metrics()

    def close(self, token: str, graceful: bool, timeout_s: float) -> None:
        """Stop the stages and gateways; events still queued stay for a last poll."""
        self._check("close", token)
        t0 = time.monotonic()
        try:
            self.orch.close(graceful=graceful, timeout_s=timeout_s)
        finally:
            self.queue.close()
            log.info("closed in %.1fs", time.monotonic() - t0)


def encode_config(cfg: PipelineConfig) -> bytes:
    return msgspec.json.encode(cfg)
