"""The caller's side of a pipeline run over Ray Client (``ray://host:10001``).

The caller is outside the cluster, so the control plane runs there: a
:class:`~omni_ray.control_actor.ControlActor` pinned to the head node (the node of the
client server). :class:`RayClientBackend` stands in for the orchestrator before the
:class:`~omni_core.pipeline.Pipeline`: calls go to the actor, and one pump thread long-polls
it for the events of every open request (a batch per call, never a call per event) and
hands them to the requests' handles, arrays as numpy arrays the caller owns.

If the actor or the connection to the cluster dies, every open request ends with a
``runtime_failed`` error naming it, :attr:`failure` is set and health is unhealthy.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import traceback
import uuid
from typing import Any

import numpy as np
from omni_core.client.backend import Backend
from omni_core.client.collector import Collector, RequestHandle
from omni_core.config import PipelineConfig, split_worker
from omni_core.control.worker_env import inherited_env
from omni_core.dataplane.serial import ArrayCodec, array_from_flat, decode_event_frame
from omni_core.errors import StageStartError
from omni_core.events import InlineArray
from omni_core.health import Failure, Health, Metrics
from omni_core.worker.host import CLIENT

from omni_ray.control_actor import ControlActor, encode_config
from omni_ray.segments import unlink_pipeline_segments

log = logging.getLogger("omni.ray.client")
POLL_S = 0.2  # how long one poll waits for an event when none is ready
CALL_S = 60.0  # the longest a control call may take before the actor counts as gone
HEAD_RESOURCE = "node:__internal_head__"
ACTOR_THREADS = 32
CONNECT_TRIES = 3  # the poll, and callers' submits, cancels, health and metrics


def owned_array(handle: InlineArray, flat: np.ndarray) -> Any:
    """The array ``handle`` describes over ``flat`` (its bytes, as Ray handed them over:
    read-only when Ray mapped them), copied when the caller could not write it."""
    if not flat.flags.writeable:
        flat = flat.copy()
    return array_from_flat(flat, handle.dtype, handle.shape, handle.torch, owned=True)


def why(e: BaseException) -> str:
    """An exception in one line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def gone(e: BaseException) -> bool:
    """``e`` says the actor or the connection to the cluster is gone for good."""
    import ray

    return isinstance(e, (ray.exceptions.RayActorError, ConnectionError))


class RayClientBackend(Backend):
    """A :class:`Backend` served by a :class:`ControlActor` in the cluster."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        # the caller's side of the requests: the events arrive checked and in order (the
        # actor's own collector did that), so this one only ends and hands them over
        self.collector = Collector([], [], ArrayCodec(CLIENT))
        self.lock = threading.Lock()  # the collector's: the pump and callers share it
        self.failure: Failure | None = None
        self.actor: Any = None
        # what every call to the actor carries: only this process may drive it
        self._token = secrets.token_hex(32)
        self.info: dict[str, Any] = {}
        self.owns_ray = False
        self.closing = False
        self._pump: threading.Thread | None = None
        # the workers the actor last reported (a stage's, or each replica's): what health
        # lists once the actor is gone; at first those the pipeline starts with
        self._workers = [
            w for s in cfg.stages for w in cfg.workers(s.name)[: cfg.replica_range(s.name)[0]]
        ]
        self._metrics: dict[str, Any] = {
            "stages": {},
            "requests": {},
            "counts": {},
            "in_flight": 0,
            "cancel_acks": 0,
        }

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        import ray

        if not ray.is_initialized():
            self._connect()
            self.owns_ray = True
        try:
            self.actor = self._make_actor()
            self.info = self._call(self.actor.start, timeout_s=self.cfg.ready_timeout_s + CALL_S)
        except BaseException:
            self._release()
            raise
        self._pump = threading.Thread(target=self._run_pump, name="omni-ray-client", daemon=True)
        self._pump.start()

    def _connect(self) -> None:
        """Connect to the client server; again when it failed to start this client's
        server process (Ray's proxier does that now and then: "Starting Ray client server
        failed")."""
        import ray

        for attempt in range(CONNECT_TRIES):
            try:
                ray.init(address=self.cfg.backend.address, namespace=self.cfg.backend.namespace)
                return
            except ConnectionError as e:
                if attempt == CONNECT_TRIES - 1:
                    raise ConnectionError(
                        f"Ray Client at {self.cfg.backend.address}: {why(e)} "
                        f"({CONNECT_TRIES} tries)"
                    ) from e
                log.warning("Ray Client at %s: %s; trying again", self.cfg.backend.address, why(e))
                time.sleep(1.0)

    def _make_actor(self) -> Any:

        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        head = [
            n["NodeID"] for n in ray.nodes() if n.get("Alive") and HEAD_RESOURCE in n["Resources"]
        ]
        if not head:
            raise StageStartError(
                f"Ray Client at {self.cfg.backend.address}: no alive head node in the cluster"
            )
        env = inherited_env("OMNI_")
        return (
            ray.remote(ControlActor)
            .options(
                name=f"omni-control-{uuid.uuid4().hex[:10]}",
                num_cpus=0,
                max_concurrency=ACTOR_THREADS,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(head[0], soft=False),
                runtime_env={"env_vars": env} if env else None,
            )
            .remote(encode_config(self.cfg), self._token)
        )

    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the actor and everything it started; open requests end."""
        self.closing = True
        if self.actor is not None and self.failure is None:
            try:
                self._call(self.actor.close, graceful, timeout_s, timeout_s=timeout_s + CALL_S)
            except Exception as e:  # the actor is gone already: Ray ends what it started
                log.warning("closing the orchestrator actor: %s", e)
        if self._pump is not None:
            self._pump.join(timeout=POLL_S + CALL_S)
        self._fail_all("pipeline closed before the request finished", "pipeline_closed")
        if self.failure is not None and self.info:
            self._sweep_segments(self.info["pipeline_id"])
        self._release()

    def _sweep_segments(self, pipeline_id: str) -> None:
        """The actor died with its gateways: unlink their segments on every node."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        try:
            refs = [
                ray.remote(unlink_pipeline_segments)
                .options(
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                )
                .remote(pipeline_id)
                for n in ray.nodes()
                if n.get("Alive")
            ]
            ray.get(refs, timeout=CALL_S)
        except Exception as e:  # the cluster is out of reach: nothing more to do from here
            log.warning("could not unlink the segments of pipeline %s: %s", pipeline_id, e)

    def _release(self) -> None:
        import ray

        if self.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)
            self.actor = None
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False

    # ------------------------------------------------------------------ requests
    def running(self) -> bool:
        return not self.closing and self._pump is not None

    def send_request(
        self, h: RequestHandle, request: dict[str, Any], timeout_s: float | None
    ) -> None:
        self._call(self.actor.submit, request, h.request_id, timeout_s)

    def cancel(self, request_id: str) -> bool:
        if request_id not in self.collector.handles or self.failure is not None:
            return False
        return bool(self._call(self.actor.cancel, request_id))

    def health(self) -> Health:
        if self.failure is None and self.actor is not None:
            try:
                health = self._call(self.actor.health, timeout_s=10.0)
                self._workers = list(health)
                return health
            except Exception as e:
                if not gone(e):  # slow, not gone: unhealthy this time
                    return self._unhealthy({"part": "the orchestrator actor", "error": why(e)})
                self._fail(why(e), e)
        return self._unhealthy(self.failure or {"part": "the pipeline", "error": "not running"})

    def _unhealthy(self, f: Failure) -> Health:
        """Every worker failed (per worker, as the actor's health: a stage's, or each
        replica's, with its stage and replica index)."""
        out: Health = {}
        for w in self._workers:
            stage, replica = split_worker(w)
            out[w] = {
                "stage": stage,
                "replica": replica,
                "alive": False,
                "healthy": False,
                "state": "failed",
                "where": f"{f['part']}: {f['error']}",
            }
        return out

    def metrics(self) -> Metrics:
        """The actor's metrics; once it is gone, the last it gave (nothing in flight)."""
        if self.failure is None and self.actor is not None:
            try:
                self._metrics = self._call(self.actor.metrics, timeout_s=10.0)
            except Exception as e:
                if gone(e):
                    self._fail(why(e), e)
        return {**self._metrics, "in_flight": self.open_requests()}

    def pids(self) -> dict[str, int]:
        raise RuntimeError("worker pids are not available over Ray Client (ray:// address)")

    # ------------------------------------------------------------------ internals
    def _call(self, method: Any, *args: Any, timeout_s: float = CALL_S) -> Any:
        """``method.remote(*args)``'s result; an error the actor raised is raised as is."""
        import ray

        try:
            return ray.get(method.remote(self._token, *args), timeout=timeout_s)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else None
            if cause is not None and not isinstance(cause, ray.exceptions.RayError):
                raise cause from None
            raise

    def _run_pump(self) -> None:
        import ray

        last = 0
        while True:
            try:
                n, frame, flats, failure = ray.get(
                    self.actor.poll.remote(self._token, POLL_S), timeout=POLL_S + CALL_S
                )
            except Exception as e:
                if self.closing and isinstance(e, ray.exceptions.RayActorError):
                    return  # the actor ended as asked
                log.error("polling the orchestrator actor failed:\n%s", traceback.format_exc())
                self._fail(why(e), e)
                return
            if n != last + 1:
                self._fail(f"event batch {n} arrived where {last + 1} was expected")
                return
            last = n
            try:
                if frame:
                    self._deliver(decode_event_frame(frame), flats)
            except Exception:
                log.error("delivering a batch of events failed:\n%s", traceback.format_exc())
                self._fail("a batch of events could not be delivered")
                return
            if failure is not None and self.failure is None:
                self.failure = failure
            if self.closing and not frame:
                return

    def _deliver(self, events: list[Any], flats: list[dict[str, np.ndarray] | None]) -> None:
        with self.lock:
            for ev, flat in zip(events, flats, strict=True):
                h = self.collector.handles.get(ev.request_id)
                if h is None:
                    continue
                ev.arrays = {k: owned_array(h_, flat[k]) for k, h_ in ev.device_handles.items()}
                ev.device_handles = {}
                if ev.terminal:
                    self.collector.finish(h, ev)
                else:
                    self.collector.deliver(h, ev)
            orphans = self.collector.take_orphans()  # their readers went away
        for rid in orphans:
            with contextlib.suppress(Exception):
                self._call(self.actor.cancel, rid)

    def _fail(self, error: str, cause: BaseException | None = None) -> None:
        """The actor or the connection is gone: fail loudly, never hang."""
        if self.failure is not None:
            return
        address = self.cfg.backend.address
        if isinstance(cause, ConnectionError):
            part = f"the Ray Client connection to {address} (and the orchestrator actor with it)"
            error = "the connection was lost: " + error
        else:
            part = f"the orchestrator actor (Ray Client {address})"
        self.failure = {"part": part, "error": error}
        log.critical("the runtime failed: %s: %s; every open request ends", part, error)
        self._fail_all(
            f"the runtime failed ({part}: {error}); restart the pipeline", "runtime_failed"
        )

    def _fail_all(self, message: str, code: str) -> None:
        with self.lock:
            self.collector.fail_all(message, code)
