"""Run traces: what each stage did for each request, as Chrome / Perfetto trace JSON.

Workers record a span per trigger (which requests, start, end, events out) and a mark per
emitted event when ``trace: true``; they ship them with their heartbeats. The caller's side
adds a mark per event it received. Load the JSON in ui.perfetto.dev or chrome://tracing:
one row per stage, one bar per request per trigger, so overlap between stages shows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from omni_core.events import TraceMark, TraceSpan

MAX_RECORDS = 1_000_000


def _user_id(wire_id: str) -> str:
    return wire_id.split("~", 1)[0]


@dataclass
class TraceLog:
    """Trace records of one pipeline, bounded (oldest dropped first)."""

    stages: list[str]
    spans: deque[tuple[str, TraceSpan]] = field(default_factory=lambda: deque(maxlen=MAX_RECORDS))
    marks: deque[tuple[str, TraceMark]] = field(default_factory=lambda: deque(maxlen=MAX_RECORDS))

    def add(self, stage: str, spans: list[TraceSpan], marks: list[TraceMark]) -> None:
        self.spans.extend((stage, s) for s in spans)
        self.marks.extend((stage, m) for m in marks)

    def chrome(self, pids: dict[str, int] | None = None) -> dict[str, Any]:
        """The Chrome trace-event JSON object (``traceEvents``, microsecond timestamps)."""
        rows = {name: i + 1 for i, name in enumerate([*self.stages, "client"])}
        t0 = min([s.start for _, s in self.spans] + [m.ts for _, m in self.marks], default=0.0)
        us = lambda t: round((t - t0) * 1e6, 1)  # noqa: E731
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "omni pipeline"}}
        ]
        for name, tid in rows.items():
            label = f"{name} (pid {pids[name]})" if pids and name in pids else name
            events.append(
                {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": label}}
            )
            events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": 1,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        for stage, s in self.spans:
            requests = [_user_id(r) for r in s.requests]
            events.append(
                {
                    "name": ",".join(r[:8] for r in requests),
                    "cat": stage,
                    "ph": "X",
                    "pid": 1,
                    "tid": rows.get(stage, 0),
                    "ts": us(s.start),
                    "dur": max(us(s.end) - us(s.start), 0.1),
                    "args": {"requests": requests, "outputs": s.outputs, "window": s.window},
                }
            )
        for stage, m in self.marks:
            events.append(
                {
                    "name": f"{m.event_type} #{m.sequence}",
                    "cat": stage,
                    "ph": "i",
                    "s": "t",
                    "pid": 1,
                    "tid": rows.get(stage, 0),
                    "ts": us(m.ts),
                    "args": {"request": _user_id(m.request_id), "sequence": m.sequence},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}
