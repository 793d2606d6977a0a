"""A run's trace as a timeline picture (``omni trace --png``): a row per stage, a bar per
request per stage (its first trigger's start to its last trigger's end there), so overlap
between stages shows at a glance. Drawn with Pillow (the ``png`` extra of omni-core)."""

from __future__ import annotations

import hashlib
import io
import math
from collections import defaultdict
from typing import Any

WIDTH = 1200
LABEL_W = 170
LANE_H = 14
ROW_PAD = 8
AXIS_H = 28


def _color(request: str) -> tuple[int, int, int]:
    """A stable, fairly saturated colour per request id."""
    d = hashlib.blake2b(request.encode(), digest_size=3).digest()
    return (60 + d[0] % 160, 60 + d[1] % 160, 60 + d[2] % 160)


def _bars(trace: dict[str, Any]) -> tuple[list[str], dict[str, list[tuple[float, float, str]]]]:
    """Row names in order, and per row (start_us, end_us, request) bars."""
    rows: dict[int, str] = {}
    order: dict[int, int] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            rows[e["tid"]] = e["args"]["name"].split(" (pid")[0]
        elif e.get("ph") == "M" and e.get("name") == "thread_sort_index":
            order[e["tid"]] = e["args"]["sort_index"]
    spans: dict[tuple[str, str], list[float]] = {}
    marks: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        row = rows.get(e.get("tid", -1))
        if row is None:
            continue
        if e.get("ph") == "X":
            for r in e["args"]["requests"]:
                span = spans.setdefault((row, r), [e["ts"], e["ts"] + e["dur"]])
                span[0] = min(span[0], e["ts"])
                span[1] = max(span[1], e["ts"] + e["dur"])
        elif e.get("ph") == "i" and row == "client":  # arrivals at the caller: ticks
            marks[row].append((e["ts"], e["ts"], e["args"]["request"]))
    bars: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for (row, r), (a, b) in spans.items():
        bars[row].append((a, b, r))
    for row, ticks in marks.items():
        bars[row].extend(ticks)
    names = [rows[t] for t in sorted(rows, key=lambda t: order.get(t, t))]
    return names, bars


def _lanes(bars: list[tuple[float, float, str]]) -> list[int]:
    """A lane per bar so that bars in one lane never overlap (greedy, by start)."""
    ends: list[float] = []
    lanes = [0] * len(bars)
    for i in sorted(range(len(bars)), key=lambda i: bars[i][0]):
        a, b, _ = bars[i]
        for lane, end in enumerate(ends):
            if end <= a:
                ends[lane] = b
                lanes[i] = lane
                break
        else:
            ends.append(b)
            lanes[i] = len(ends) - 1
    return lanes


def timeline_png(trace: dict[str, Any]) -> bytes:
    """The PNG bytes of the timeline of a Chrome trace made by :meth:`Pipeline.trace`."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise ImportError(
            "drawing needs Pillow: pip install 'omni-core[png]' (or pillow)"
        ) from None

    names, bars = _bars(trace)
    t_end = max((b for row in bars.values() for _, b, _ in row), default=1.0) or 1.0
    lanes = {row: _lanes(bars.get(row, [])) for row in names}
    heights = {row: (max(lanes[row], default=0) + 1) * LANE_H + 2 * ROW_PAD for row in names}
    height = AXIS_H + sum(heights.values()) + 10
    img = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    span_w = WIDTH - LABEL_W - 20
    x_of = lambda t: LABEL_W + t / t_end * span_w  # noqa: E731
    # time axis, in milliseconds
    step = _nice_step(t_end / 1000 / 8)
    t = 0.0
    while t * 1000 <= t_end:
        x = x_of(t * 1000)
        draw.line([(x, AXIS_H - 6), (x, height - 10)], fill=(225, 225, 225))
        draw.text((x + 2, 4), f"{t:g} ms", fill="black", font=font)
        t += step
    y = AXIS_H
    for row in names:
        draw.rectangle([0, y, WIDTH, y + heights[row]], outline=(200, 200, 200))
        draw.text((6, y + ROW_PAD), row, fill="black", font=font)
        for (a, b, r), lane in zip(bars.get(row, []), lanes[row], strict=True):
            top = y + ROW_PAD + lane * LANE_H
            x0, x1 = x_of(a), max(x_of(b), x_of(a) + 2)
            draw.rectangle([x0, top + 1, x1, top + LANE_H - 2], fill=_color(r))
            if x1 - x0 > 60:
                draw.text((x0 + 3, top + 1), r[:8], fill="white", font=font)
        y += heights[row]
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _nice_step(x: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``x``."""
    mag = 10.0 ** math.floor(math.log10(max(x, 1e-9)))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= x)


def write_timeline_png(trace: dict[str, Any], path: str) -> None:
    with open(path, "wb") as f:
        f.write(timeline_png(trace))
