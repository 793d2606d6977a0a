"""Prometheus metrics: every counter the pipeline collects (read from ``Pipeline.metrics()``
and ``health()`` at scrape time, so nothing is double-booked) plus the HTTP server's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# stage counters (monotonic within a worker's life; a restart starts them again, which
# Prometheus' rate() reads as a counter reset)
STAGE_COUNTERS = {
    "received": "data events a stage took in",
    "dequeued": "work items a stage took from its queue",
    "emitted": "events a stage sent",
    "window_triggers": "windows that triggered a stage",
    "completed": "requests a stage finished",
    "errors": "requests a stage failed",
    "dropped": "previews coalesced away under backpressure",
}
STAGE_GAUGES = {
    "queue_depth": "work items waiting in a stage's queue",
    "inflight": "requests a stage works on",
    "outbox_depth": "events waiting to be sent by a stage",
    "shm_slots_in_use": "shared-memory slots a stage's arena has out",
    "enqueue_per_s": "events taken in per second (last heartbeat interval)",
    "dequeue_per_s": "work items taken per second (last heartbeat interval)",
    "gpu_mem_allocated_bytes": "GPU memory torch's allocator holds in a stage's worker",
    "gpu_mem_reserved_bytes": "GPU memory torch's allocator reserved in a stage's worker",
}
STATES = ("starting", "ready", "unresponsive", "hung", "restarting", "dead", "failed")
SUMMARIES = {
    "time_to_first_event_s": ("omni_request_time_to_first_event_seconds", "submit to first event"),
    "time_between_events_s": ("omni_request_time_between_events_seconds", "time per segment"),
    "completion_latency_s": ("omni_request_latency_seconds", "submit to completion"),
}


class PipelineCollector(Collector):
    """The pipeline's metrics as Prometheus families, computed at each scrape."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def collect(self) -> Iterator[Metric]:
        m = self.pipe.metrics()
        health = self.pipe.health()
        stages: dict[str, dict[str, Any]] = m["stages"]
        for key, doc in STAGE_COUNTERS.items():
            yield _per_stage(CounterMetricFamily, f"omni_stage_{key}", doc, stages, key)
        yield _per_stage(
            CounterMetricFamily,
            "omni_stage_blocked_seconds",
            "time a stage waited on a full destination or shared-memory pool (watermarks)",
            stages,
            "blocked_s",
            default=0.0,
        )
        yield _per_stage(
            CounterMetricFamily, "omni_stage_restarts", "worker restarts", stages, "restarts"
        )
        for key, doc in STAGE_GAUGES.items():
            yield _per_stage(GaugeMetricFamily, f"omni_stage_{key}", doc, stages, key)
        util = GaugeMetricFamily(
            "omni_stage_gpu_utilization_percent",
            "utilisation of a stage's GPU (NVML; absent where unknown)",
            labels=["stage"],
        )
        for name, s in stages.items():
            if s.get("gpu_util_pct") is not None:
                util.add_metric([name], s["gpu_util_pct"])
        yield util
        state = GaugeMetricFamily(
            "omni_stage_state", "1 for the state each stage is in", labels=["stage", "state"]
        )
        up = GaugeMetricFamily("omni_stage_up", "1 when the stage is ready", labels=["stage"])
        for name, h in health.items():
            for st in STATES:
                state.add_metric([name, st], 1.0 if h["state"] == st else 0.0)
            up.add_metric([name], 1.0 if h.get("healthy") else 0.0)
        yield state
        yield up
        outcomes = CounterMetricFamily(
            "omni_requests", "requests that ended, by outcome", labels=["outcome"]
        )
        for outcome, n in m["counts"].items():
            outcomes.add_metric([outcome], n)
        yield outcomes
        yield GaugeMetricFamily("omni_requests_in_flight", "open requests", value=m["in_flight"])
        yield CounterMetricFamily(
            "omni_cancel_acks", "cancels acknowledged by workers", value=m["cancel_acks"]
        )
        for key, (name, doc) in SUMMARIES.items():
            r = m["requests"].get(key, {"count": 0})
            s = Metric(name, doc, "summary")
            for q, field in (("0.5", "p50"), ("0.95", "p95"), ("1.0", "max")):
                if field in r:
                    s.add_sample(name, {"quantile": q}, r[field])
            s.add_sample(f"{name}_count", {}, r["count"])
            s.add_sample(f"{name}_sum", {}, r.get("mean", 0.0) * r["count"])
            yield s


def _per_stage(
    family: type[CounterMetricFamily | GaugeMetricFamily],
    name: str,
    doc: str,
    stages: dict[str, dict[str, Any]],
    key: str,
    default: float = 0,
) -> Metric:
    """A family with a sample per stage: its figure ``key`` (``default`` where it has none)."""
    metric = family(name, doc, labels=["stage"])
    for stage, figures in stages.items():
        metric.add_metric([stage], figures.get(key, default))
    return metric


KEY_GAUGES = (
    ("omni_http_key_connections", "connections counted against an API key, by key name"),
    ("omni_http_key_inflight", "HTTP requests of an API key being answered, by key name"),
    ("omni_http_key_queued", "pipeline requests of an API key open, by key name"),
    ("omni_http_key_held_refusals", "429s of an API key held before they are sent, by key name"),
    ("omni_http_key_running", "pipeline requests of an API key past the fair gate, by key name"),
    ("omni_http_key_waiting", "pipeline requests of an API key waiting their turn, by key name"),
)
Usage = Callable[[], dict[str, tuple[int, ...]]]


class SharesCollector(Collector):
    """What each API key holds now (``omni_serve.shares.Shares.usage``), at each scrape."""

    def __init__(self, usage: Usage) -> None:
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        usage = self.usage()
        for i, (name, doc) in enumerate(KEY_GAUGES):
            family = GaugeMetricFamily(name, doc, labels=["key"])
            for key, held in usage.items():
                family.add_metric([key], held[i])
            yield family


class ServerMetrics:
    """One registry per app: the pipeline's families and the HTTP server's."""

    def __init__(self, pipe: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(PipelineCollector(pipe))
        self.http_requests = Counter(
            "omni_http_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.http_seconds = Histogram(
            "omni_http_request_duration_seconds",
            "HTTP request duration (streams: until the last byte)",
            ["endpoint"],
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.body_bytes = Gauge(
            "omni_http_body_bytes_in_flight",
            "bytes of request bodies held against --max-body-bytes-in-flight",
            registry=self.registry,
        )
        self.disconnects = Counter(
            "omni_http_client_disconnects",
            "requests cancelled because their client went away",
            registry=self.registry,
        )
        self.key_requests = Counter(
            "omni_http_key_requests",
            "HTTP requests that carried a valid API key, by key name",
            ["key"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "omni_http_refusals",
            "requests and connections refused over a client's share, by key name ('' "
            "before a key is known) and reason (address_connections, connections, "
            "inflight, queued, priority)",
            ["key", "reason"],
            registry=self.registry,
        )

    def track_shares(self, usage: Usage) -> None:
        """Export what each API key holds (:class:`SharesCollector`)."""
        self.registry.register(SharesCollector(usage))
