"""The in-process backend (``mrs.enabled: false``): every stage in the caller's process.

Requests run one after another, each to its end, through the same :class:`StageHost`
windows and the same event encoding as the process backend, with arrays carried inline
instead of through shared memory. It is the parity oracle: a pipeline must give the same
outputs with and without worker processes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import msgspec

from omni_core.client.backend import Backend
from omni_core.client.collector import Collector, RequestHandle
from omni_core.config import PipelineConfig
from omni_core.dataplane.serial import ArrayCodec, decode_event_frame, encode_frame
from omni_core.events import Cancelled, Event, Submit
from omni_core.health import Health, Metrics
from omni_core.registry import load_stage_class
from omni_core.worker.devices import worker_devices
from omni_core.worker.host import CLIENT, StageHost, WorkItem, stage_context


class InlineRunner(Backend):
    def __init__(self, cfg: PipelineConfig) -> None:
        # every stage once, in this process: replicas are a matter of worker processes
        one = [msgspec.structs.replace(s, replicas=1) for s in cfg.stages]
        self.cfg = cfg = msgspec.structs.replace(cfg, stages=one)
        self.order = cfg.topological_order()
        self.hosts: dict[str, StageHost] = {}
        self.collector = Collector(
            cfg.sinks(), cfg.client_streams(), ArrayCodec(CLIENT), cfg.preview_streams()
        )
        self.lock = threading.Lock()
        self.started = False

    def start(self) -> None:
        for name in self.order:
            st = self.cfg.stage(name)
            cls = load_stage_class(st.kind)
            devices = worker_devices(self.cfg, name, in_process=True)
            stage = cls(stage_context(self.cfg, name, devices))
            stage.load()
            codec = ArrayCodec(name, threshold=self.cfg.shm_threshold_bytes)
            self.hosts[name] = StageHost(self.cfg, name, stage, codec)
        self.started = True

    def running(self) -> bool:
        return self.started

    def send_request(
        self, h: RequestHandle, request: dict[str, Any], timeout_s: float | None
    ) -> None:
        """Run the request to its end now; the handle then replays its events."""
        rid = h.request_id
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        work: deque[tuple[str, WorkItem]] = deque()
        msg = Submit(request_id=rid, request=request)
        for s in self.cfg.sources():
            work.extend((s, w) for w in self.hosts[s].submit(msg))

        def route(ev: Event, dests: list[str]) -> None:
            frame = encode_frame([ev])  # each receiver decodes its own copy, as off the wire
            for d in dests:
                received = decode_event_frame(frame)[0]
                if d == CLIENT:
                    self.collector.on_event(received)
                else:
                    work.extend((d, w) for w in self.hosts[d].receive(received))

        try:
            while work and not h.done:
                name, item = work.popleft()
                host = self.hosts[name]
                try:
                    for step in host.stage.process([item.inp]):
                        if deadline is not None and time.monotonic() > deadline:
                            self.collector.finish(h, Cancelled(request_id=rid, reason="timeout"))
                            break
                        if step is None:  # a turn given to other requests (see Stage.process)
                            continue
                        for out in step if isinstance(step, list) else [step]:
                            route(*host.emit(out))
                        if h.done:
                            break
                except Exception as e:
                    route(host.error(rid, f"{type(e).__name__}: {e}"), [CLIENT])
                    break
                if h.done:
                    break
                for ev, dests in host.finish(item):
                    route(ev, dests)
        finally:  # a request that raised (a bad one, an interrupt) leaves no state
            for host in self.hosts.values():
                host.forget(rid)
                host.end_requests(host.take_ended())

    def cancel(self, request_id: str) -> bool:
        return False  # requests have already run to their end when submit returns

    def health(self) -> Health:
        return {n: {"alive": True, "healthy": True, "state": "inline"} for n in self.hosts}

    def metrics(self) -> Metrics:
        return {
            "stages": {n: {"window_triggers": h.window_triggers} for n, h in self.hosts.items()},
            "requests": self.collector.metrics.report(),
            "counts": dict(self.collector.counts),
            "in_flight": 0,
        }

    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        self.started = False
        for host in self.hosts.values():
            host.stage.close()
        self.collector.fail_all("pipeline closed before the request finished")
