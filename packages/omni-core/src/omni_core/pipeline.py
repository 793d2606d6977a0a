"""The user-facing pipeline: a context manager over one execution backend.

``Pipeline(config)`` runs one worker per stage through the config's backend (``local``
processes, or a plug-in backend such as ``ray``) or, with ``mrs.enabled: false``, every
stage in-process; all take the same requests and give the same events.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from omni_core.client.backend import Backend
from omni_core.client.collector import RequestHandle, RequestOutput, collect
from omni_core.client.inline import InlineRunner
from omni_core.config import PipelineConfig, load_config, parse_config
from omni_core.control.launcher import ProcessLauncher
from omni_core.control.orchestrator import Orchestrator
from omni_core.control.supervisor import stage_health
from omni_core.events import AnyEvent
from omni_core.health import Failure, Health, Metrics, StageHealth
from omni_core.registry import RegistryError, backend_registry


def make_backend(cfg: PipelineConfig) -> Backend:
    """What runs the pipeline: the in-process runner (``mrs.enabled: false``), the
    orchestrator over local processes (backend ``local``), or what the factory registered
    under ``omni.backends`` for ``cfg.backend.kind`` makes for the config (a callable
    taking the config and returning a :class:`Backend`)."""
    if not cfg.mrs.enabled:
        return InlineRunner(cfg)
    if cfg.backend.kind == "local":
        return Orchestrator(cfg, ProcessLauncher(cfg))
    kind = cfg.backend.kind
    try:
        factory = backend_registry().load(kind)
    except RegistryError as e:
        hint = " (install omni-ray: pip install packages/omni-ray)" if kind == "ray" else ""
        raise RegistryError(f"backend {kind!r}: {e}{hint}") from None
    backend = factory(cfg)
    if not isinstance(backend, Backend):
        raise TypeError(f"backend {kind!r} made a {type(backend).__name__}, not a Backend")
    return backend


class Pipeline:
    """Run requests through a pipeline of stages.

    ``config`` is a YAML file's path, a parsed config, or the config as a dict. The
    workers start with :meth:`start` or on entering the ``with`` block, and stop with
    :meth:`close` or on leaving it::

        with Pipeline("configs/demo.yaml") as pipe:
            for event in pipe.stream({"n": 16}):
                print(event.event_type, event.stage, event.sequence)
    """

    def __init__(
        self,
        config: PipelineConfig | str | os.PathLike[str] | dict[str, Any],
        backend: str | None = None,
        address: str | None = None,
    ) -> None:
        """``backend`` / ``address`` override the config's ``backend:`` block."""
        if isinstance(config, PipelineConfig):
            cfg = config
        elif isinstance(config, dict):
            cfg = parse_config(config)
        else:
            cfg = load_config(config)
        cfg = cfg.with_backend(backend, address)
        self.config = cfg
        self.backend = make_backend(cfg)
        self._started = False

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> Pipeline:
        """Start every worker and wait until each has loaded its stage and is ready.

        Raises ``StageStartError`` when one does not come up (its load failed, it
        crashed, or ``ready_timeout_s`` passed).
        """
        if not self._started:
            _handle_sigterm()
            self.backend.start()
            self._started = True
            _live.add(self)
        return self

    def close(self, drain: bool = False, timeout_s: float = 10.0) -> None:
        """Stop every worker and free every segment; ``drain`` first lets open requests end."""
        if not self._started:
            return
        if drain:
            end = time.monotonic() + timeout_s
            while self.backend.open_requests() and time.monotonic() < end:
                time.sleep(0.01)
        self.backend.close(graceful=True, timeout_s=timeout_s)
        self._started = False
        _live.discard(self)

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests --------------------------------------------------------------
    def submit(
        self, request: dict[str, Any], request_id: str | None = None, timeout_s: float | None = None
    ) -> RequestHandle:
        """Start a request; iterate the handle for its events."""
        self.start()
        return self.backend.submit(request, request_id, timeout_s)

    def stream(
        self, request: dict[str, Any], request_id: str | None = None, timeout_s: float | None = None
    ) -> Iterator[AnyEvent]:
        """Yield the request's events as they happen; the last one is terminal."""
        yield from self.submit(request, request_id, timeout_s)

    async def astream(
        self, request: dict[str, Any], request_id: str | None = None, timeout_s: float | None = None
    ) -> AsyncIterator[AnyEvent]:
        """``stream`` for asyncio callers."""
        self.start()
        loop = asyncio.get_running_loop()
        handle = self.backend.submit(request, request_id, timeout_s, loop=loop)
        try:
            async for ev in handle:
                yield ev
        finally:
            if not handle.done:
                self.cancel(handle.request_id)

    def generate(
        self, requests: Iterable[dict[str, Any]], timeout_s: float | None = None
    ) -> list[RequestOutput]:
        """Run many requests at once; their final outputs, in the order given."""
        handles = [self.submit(r, timeout_s=timeout_s) for r in requests]
        return [collect(h) for h in handles]

    def cancel(self, request_id: str) -> bool:
        """Cancel a request in flight: it ends with one ``cancelled`` event."""
        return self.backend.cancel(request_id)

    def health(self) -> Health:
        """Per worker (a stage's name, or ``STAGE#i`` for each replica of a replicated
        stage): its state; one that is dead or restarting is not healthy."""
        return self.backend.health()

    def pids(self) -> dict[str, int | None]:
        """Per worker (as in :meth:`health`), its process id (None until known)."""
        return {name: h.get("pid") for name, h in self.health().items()}

    def stage_health(self) -> dict[str, StageHealth]:
        """Per stage, its replicas together: ``ok``, ``degraded`` (a replica is down but
        another serves) or ``failed`` (none serves), with the replicas running and
        serving."""
        return stage_health(self.health())

    def zygote(self) -> dict[str, Any] | None:
        """How this pipeline's workers start (the local backend): ``start`` (zygote or
        spawn), the zygote's ``state`` (preloading | ready | restarting | failed | off),
        ``pid``, ``restarts``, ``preload_s``, ``preloaded`` modules, a ``note`` on what
        happened to it, and the stages always spawned with why. None on other backends."""
        return self.backend.zygote()

    @property
    def failure(self) -> Failure | None:
        """Set once the runtime itself failed for good: ``{"part", "error"}``; every
        request then fails with ``runtime_failed`` until the pipeline is started anew."""
        return self.backend.failure

    @property
    def healthy(self) -> bool:
        """Every stage serves (a replicated one: at least one replica does) and the
        runtime has not failed."""
        return self.failure is None and all(
            s["state"] != "failed" for s in self.stage_health().values()
        )

    def metrics(self) -> Metrics:
        """Per stage counters and rates, per request latencies, counts of outcomes."""
        return self.backend.metrics()

    def trace(self) -> dict[str, Any]:
        """The run so far as Chrome / Perfetto trace JSON (needs ``trace: true``).

        Workers ship trace records with their heartbeats: wait one
        ``heartbeat_interval_s`` after the last request for its records to arrive.
        """
        if not self.config.trace:
            raise RuntimeError("tracing is off: set `trace: true` in the pipeline config")
        return self.backend.chrome_trace()


# Pipelines still open when the interpreter exits (or the caller gets SIGTERM) are closed,
# so no worker and no shared-memory segment outlives the caller.
_live: weakref.WeakSet[Pipeline] = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    for pipe in list(_live):
        try:
            pipe.close(timeout_s=2.0)
        except Exception:
            pass


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds `with Pipeline(...)` blocks, then atexit


def _handle_sigterm() -> None:
    """Turn SIGTERM into SystemExit, unless the application handles SIGTERM itself."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _on_sigterm)
