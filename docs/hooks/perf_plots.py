"""MkDocs hook: the performance page's plots, drawn at build time from ``docs/perf/``.

Each bench section of ``docs/performance.md`` links its measured output (one JSON object
per run, committed under ``docs/perf/``) and holds a marker ``<!-- perf-plot: NAME -->``.
This hook reads NAME's file, draws its headline figures as ratios against the baseline
measured in the same run (one horizontal bar per figure and run, a line at 1.0 for the
baseline, a red tick at the target where there is one) with matplotlib, publishes the
drawing as ``perf/NAME.svg`` and puts the image where the marker was.

A missing or malformed JSON file, or one that lacks a key a plot reads, fails the build
with a message naming the file; so does a marker naming no plot, and (strict build) a plot
whose marker is missing. The SVG has no date and fixed ids: a build is reproducible.
``python docs/hooks/perf_plots.py OUTDIR`` writes the SVGs alone.
"""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator  # noqa: E402

log = logging.getLogger("mkdocs.hooks.perf_plots")

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "perf"
PAGE = "performance.md"
MARKER = re.compile(r"<!-- perf-plot: ([\w-]+) -->")

Series = list[tuple[str, list[float | None]]]  # (run, one value per row; None: not measured)


@dataclass(frozen=True)
class Plot:
    source: str  # the file under docs/perf/
    title: str
    rows: tuple[tuple[str, float | None], ...]  # (figure, its target or None)
    series: Callable[[Any], Series]  # the file's content -> the values to draw
    log: bool = False  # a log axis, for ratios far apart
    baseline: str | None = "baseline = 1"  # the line at 1.0 (None: no line)
    xlabel: str = "ratio to the baseline of the same run"


class PerfDataError(Exception):
    """A file under docs/perf/ that is missing, malformed or lacks what a plot reads."""


# -- the plots: what each reads from its file ------------------------------------------


def _ipc(runs: list[dict[str, Any]]) -> Series:
    return [
        (
            f"run {i}",
            [
                r["events_ratio"],
                r["events_ratio_single_yield"],
                r["gbps_64m_vs_memcpy"],
                r["gbps_64m"] / r["mpqueue_gbps_64m"],
            ],
        )
        for i, r in enumerate(runs, 1)
    ]


def _ipc_ray(d: dict[str, Any]) -> Series:
    cross, same = d["ray_cross_node_vs_local"], d["ray_same_node_vs_local"]
    client = d["ray_client_vs_driver"]
    return [
        (
            "run 2",
            [
                d["ray_cross_node"]["gbps_64m"] / d["ray_call_gbps_64m_cross_node"],
                cross["events_per_s_1k"],
                cross["gbps_64m"],
                same["events_per_s_1k"],
                same["gbps_64m"],
                client["events_per_s_1k"],
                client["gbps_64m"],
            ],
        )
    ]


def _pipeline(d: dict[str, Any]) -> Series:
    ideal = d["ideal_rps"]
    return [("", [d["throughput_vs_ideal"], d["makespan_rps"] / ideal, d["serial_rps"] / ideal])]


def _soak(d: dict[str, Any]) -> Series:
    n = d["requests"]
    return [("", [d[k] / n for k in ("completed", "cancelled", "errored", "lost")])]


def _ar(d: dict[str, Any]) -> Series:
    direct = d["direct_tok_per_s_c8"]
    return [
        (
            "",
            [
                d["staged_vs_direct_c8"],
                d["inline_detok_tok_per_s_c8"] / direct,
                d["staged_ttft_ms_c1"] / d["direct_ttft_ms_c1"],
                d["first_downstream_ms_window_16"] / d["first_downstream_ms_window_full"],
            ],
        )
    ]


def _dit(d: dict[str, Any]) -> Series:
    return [
        (
            "",
            [
                d["staged_vs_stock"],
                d["staged_unbatched_img_per_s_c8"] / d["stock_img_per_s"],
                d["full_layout_vs_stock"],
                d["second_arch_vs_stock"],
                d["preview_every_step_img_per_s"] / d["no_preview_img_per_s"],
            ],
        )
    ]


def _level(run: dict[str, Any], c: int, constraint: str = "json_schema") -> dict[str, Any]:
    for level in run["levels"]:
        if level["c"] == c and level.get("constraint", constraint) == constraint:
            return level
    raise KeyError(f"no level c={c} ({constraint})")


def _serve(d: dict[str, Any]) -> Series:
    out: Series = []
    for i, run in enumerate(d["runs"], 1):
        lv = [_level(run, c) for c in (1, 8, 32)]
        out.append(
            (
                f"run {i}",
                [x["omni_vs_vllm_tok_per_s"] for x in lv]
                + [x["omni_vs_vllm_ttft_p50"] for x in lv[:2]]
                + [x["split_local_vs_fused"] for x in lv],
            )
        )
    return out


def _serve_json(d: dict[str, Any]) -> Series:
    out: Series = []
    for name, run in (("quiet machine", d["quiet"]), ("loaded machine", d["loaded"])):
        lv = [_level(run, c) for c in (1, 8)]
        values = [x["omni_vs_vllm_tok_per_s"] for x in lv]
        values += [x["omni_vs_vllm_default_tok_per_s"] for x in lv]
        out.append((name, values))
    return out


def _scale(d: dict[str, Any]) -> Series:
    dit = d["dit"]
    return [
        (
            "",
            [
                d["cpu"]["replicas2_vs_1_throughput"],
                dit["replicas2_vs_1"],
                dit["second_run"]["replicas2_vs_1"],
                dit["max_batch_size_1"]["replicas2_vs_1"],
                d["kill"]["during_restart_vs_before"],
            ],
        )
    ]


def _start(d: dict[str, Any]) -> Series:
    mixed = d["mixed"]
    return [
        (
            "",
            [
                mixed["zygote_vs_spawn_ready"],
                mixed["zygote_vs_spawn_pss"],
                d["restart"]["zygote_vs_spawn_restart"],
                d["demo"]["zygote_vs_spawn_ready"],
            ],
        )
    ]


def _attack(d: dict[str, Any]) -> Series:
    server, plane = d["server"], d["dataplane"]
    return [
        (
            "",
            [
                server["served_ratio"],
                server["health_p99_ms_during_big_body"] / server["health_p99_ms_idle"],
                plane["refused"] / plane["attempted"],
            ],
        )
    ]


def _priority(d: dict[str, Any]) -> Series:
    rows = d["rows"]
    return [
        ("priority / idle", [r["priority_vs_idle"] for r in rows]),
        ("fcfs / idle", [r["fcfs_vs_idle"] for r in rows]),
    ]


def _revisions(d: dict[str, Any]) -> Series:
    rows = [r for r in d["rows"] if r["figure"] != "lost, health lies, segments left (requests)"]
    rounds = max(len(r["before"]) for r in rows)
    return [
        (
            f"round {i + 1}",
            [r["after"][i] / r["before"][i] if i < len(r["before"]) else None for r in rows],
        )
        for i in range(rounds)
    ]


PLOTS: dict[str, Plot] = {
    "ipc": Plot(
        "ipc.jsonl",
        "omni bench ipc: the data plane against multiprocessing.Queue and memcpy",
        (
            ("1 KB events, 64 per yield / mp.Queue", 3.0),
            ("1 KB events, 1 per yield / mp.Queue", None),
            ("64 MB arrays / in-process memcpy", 0.6),
            ("64 MB arrays / mp.Queue", None),
        ),
        _ipc,
        log=True,
    ),
    "ipc-ray": Plot(
        "ipc-ray.json",
        "omni bench ipc --backend ray: across nodes, on one node, through Ray Client",
        (
            ("64 MB across nodes / Ray's actor call", 0.9),
            ("1 KB events across nodes / local", 0.5),
            ("64 MB across nodes / local", None),
            ("1 KB events, one node / local", None),
            ("64 MB, one node / local", None),
            ("1 KB events, Ray Client / driver", None),
            ("64 MB, Ray Client / driver", None),
        ),
        _ipc_ray,
        log=True,
    ),
    "pipeline": Plot(
        "pipeline.json",
        "omni bench pipeline: 4 stages against the ideal rate (1 / 50 ms)",
        (
            ("steady-state throughput / ideal", 0.95),
            ("makespan rate / ideal", None),
            ("serial (mrs off) / ideal", None),
        ),
        _pipeline,
        baseline="ideal = 1",
    ),
    "soak": Plot(
        "soak.json",
        "omni bench soak: how 2,000 requests ended (no baseline: shares of requests)",
        (("completed", None), ("cancelled", None), ("errored", None), ("lost", None)),
        _soak,
        baseline=None,
        xlabel="share of the requests",
    ),
    "ar": Plot(
        "ar.json",
        "omni bench ar: four AR workers against one transformers engine (direct)",
        (
            ("tok/s at 8, staged / direct", 0.9),
            ("tok/s at 8, inline detok / direct", None),
            ("TTFT at 1, staged / direct (lower is better)", None),
            ("second stage's first output, window 16 / full (lower is better)", 0.1),
        ),
        _ar,
        log=True,
    ),
    "dit": Plot(
        "dit.json",
        "omni bench dit: staged pipelines against diffusers' own (stock)",
        (
            ("tiny-sd3, embeddings given, staged / stock", 1.0),
            ("the same, unbatched / stock", None),
            ("tiny-sd3-full, staged / stock", 1.0),
            ("tiny-flux, staged / stock", 1.0),
            ("preview every step / none", None),
        ),
        _dit,
    ),
    "serve": Plot(
        "serve.json",
        "omni bench serve: omni (fused) against vLLM's OpenAI server, two runs",
        (
            ("tok/s, c=1, omni / vLLM", 0.9),
            ("tok/s, c=8, omni / vLLM", 0.9),
            ("tok/s, c=32, omni / vLLM", 0.9),
            ("TTFT p50, c=1, omni / vLLM (lower is better)", 1.25),
            ("TTFT p50, c=8, omni / vLLM (lower is better)", 1.25),
            ("tok/s, c=1, split_local / fused", 0.8),
            ("tok/s, c=8, split_local / fused", 0.8),
            ("tok/s, c=32, split_local / fused", 0.8),
        ),
        _serve,
    ),
    "serve-json-schema": Plot(
        "serve-json-schema.json",
        "omni bench serve --constraint json_schema: omni against vLLM's server",
        (
            ("tok/s, c=1, omni / vLLM same settings", 0.9),
            ("tok/s, c=8, omni / vLLM same settings", 0.9),
            ("tok/s, c=1, omni / vLLM defaults", 0.9),
            ("tok/s, c=8, omni / vLLM defaults", 0.9),
        ),
        _serve_json,
        log=True,
    ),
    "scale": Plot(
        "scale.json",
        "omni bench scale: 2 replicas against 1, and a replica killed",
        (
            ("CPU-bound stage, 2 replicas / 1", 1.7),
            ("DiT sample, 2 replicas / 1", None),
            ("the same, a second run", None),
            ("the same, max_batch_size 1", None),
            ("while a replica restarts / before", 0.4),
        ),
        _scale,
    ),
    "start": Plot(
        "start.json",
        "omni bench start: workers forked from the zygote against spawned (lower is better)",
        (
            ("mixed_ar_dit.yaml, time to ready", None),
            ("mixed_ar_dit.yaml, workers' PSS", None),
            ("restart after SIGKILL, time to ready", None),
            ("demo.yaml, time to ready", None),
        ),
        _start,
        baseline="spawn = 1",
    ),
    "attack": Plot(
        "attack.json",
        "omni bench attack: under attack against without",
        (
            ("chat requests/s under slow-loris / without", 0.9),
            ("/health p99 during a 20 MiB body / idle", None),
            ("hostile data-plane frames refused / sent", None),
        ),
        _attack,
        baseline="unattacked = 1",
    ),
    "priority": Plot(
        "priority.json",
        "omni bench priority: a probe's p50 under load against idle (lower is better)",
        (
            ("ar_chat (transformers), first text", 2.0),
            ("ar_chat (transformers), completion", None),
            ("ar_chat on vLLM, first text", 2.0),
            ("ar_chat on vLLM, completion", None),
            ("dit_image, final image", 2.0),
            ("dit_image, first preview", None),
        ),
        _priority,
        log=True,
        baseline="idle = 1",
    ),
    "revisions": Plot(
        "revisions.json",
        "omni bench revisions: after the refactor / before it (41f9df4), per round",
        (
            ("pipeline, req/s", None),
            ("ipc, 1 KB events/s, 64 per yield", None),
            ("ipc, 1 KB events/s, 1 per yield", None),
            ("ipc, 64 MB GB/s", None),
            ("serve, omni tok/s, c=1", None),
            ("serve, omni tok/s, c=8", None),
            ("serve, omni / vLLM, c=1", None),
            ("serve, omni / vLLM, c=8", None),
        ),
        _revisions,
        baseline="before = 1",
        xlabel="after / before",
    ),
}


# -- reading and drawing ---------------------------------------------------------------


def load(source: str) -> Any:
    """The content of docs/perf/SOURCE: one object, or a list of them for ``.jsonl``."""
    path = DATA / source
    name = path.relative_to(ROOT)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PerfDataError(f"{name}: cannot be read ({e.strerror or e})") from e
    lines = text.splitlines() if source.endswith(".jsonl") else [text]
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            where = f"line {n}, " if source.endswith(".jsonl") else ""
            raise PerfDataError(f"{name}: not valid JSON ({where}{e})") from e
    if not out:
        raise PerfDataError(f"{name}: empty")
    return out if source.endswith(".jsonl") else out[0]


def values(name: str, plot: Plot) -> Series:
    data = load(plot.source)
    try:
        series = plot.series(data)
    except (KeyError, TypeError, IndexError, ZeroDivisionError) as e:
        raise PerfDataError(
            f"docs/perf/{plot.source}: plot {name!r} cannot read it ({type(e).__name__}: {e})"
        ) from e
    for run, vals in series:
        if len(vals) != len(plot.rows):
            raise PerfDataError(
                f"docs/perf/{plot.source}: plot {name!r}, {run or 'the run'}: "
                f"{len(vals)} values for {len(plot.rows)} rows"
            )
    return series


def label(v: float) -> str:
    """A value as the bar shows it: 3 decimals (0.1 to 10), 3 digits under 0.1, fewer above."""
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 0.1 or v == 0:
        return f"{v:.3f}".rstrip("0").rstrip(".")
    return f"{v:.3g}"


def _ratio(v: float, _pos: object = None) -> str:
    return f"{v:g}x"


def _plain(v: float, _pos: object = None) -> str:
    return f"{v:g}"


def draw(plot: Plot, series: Series) -> str:
    """The plot as an SVG document (no date, ids from a fixed salt)."""
    n_rows, n_runs = len(plot.rows), len(series)
    height = 0.8 / n_runs
    fig = Figure(figsize=(8, 1.6 + n_rows * (0.25 + 0.22 * n_runs)), layout="constrained")
    ax = fig.subplots()
    # the bars of a row centred on it, whatever runs measured that row
    present = [
        [i for i, (_, vals) in enumerate(series) if vals[row] is not None] for row in range(n_rows)
    ]
    drawn: list[float] = [1.0] if plot.baseline else []
    for i, (run, vals) in enumerate(series):
        ys: list[float] = []
        xs: list[float] = []
        for row, v in enumerate(vals):
            if v is not None:
                ys.append(row + (present[row].index(i) - (len(present[row]) - 1) / 2) * height)
                xs.append(v)
        drawn += xs
        bars = ax.barh(ys, xs, height=height * 0.9, label=run or None, color=f"C{i}")
        ax.bar_label(bars, labels=[f" {label(v)}" for v in xs], fontsize=9, padding=1)
    targets = [(row, t) for row, (_, t) in enumerate(plot.rows) if t is not None]
    for k, (row, t) in enumerate(targets):
        name = "target" if k == 0 else None
        ax.plot([t, t], [row - 0.45, row + 0.45], color="crimson", lw=2, label=name)
        drawn.append(t)
    if plot.baseline:
        ax.axvline(1.0, color="black", lw=1, ls="--", label=plot.baseline)
    ax.set_yticks(range(n_rows), [figure for figure, _ in plot.rows])
    ax.set_ylim(n_rows - 0.5, -0.5)  # the first row on top
    positive = [v for v in drawn if v > 0]
    if plot.log:
        ax.set_xscale("log")
        ax.set_xlim(min(positive) / 1.6, max(positive) * 2.5)
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_minor_locator(NullLocator())
    else:
        ax.set_xlim(0, max(positive) * 1.18)
    ax.xaxis.set_major_formatter(FuncFormatter(_ratio if plot.baseline else _plain))
    ax.set_xlabel(plot.xlabel)
    fig.suptitle(plot.title, x=0.01, ha="left", fontsize=11)
    ax.grid(axis="x", color="#dddddd", lw=0.6)
    ax.set_axisbelow(True)
    if n_runs > 1 or targets or plot.baseline:
        fig.legend(loc="outside lower center", ncols=5, fontsize=9, frameon=False)
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "omni-perf", "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg", metadata={"Date": None}, facecolor="white")
    return buf.getvalue()


def render_all() -> dict[str, str]:
    """{NAME: SVG} for every plot."""
    return {name: draw(plot, values(name, plot)) for name, plot in PLOTS.items()}


# -- MkDocs hook events ----------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    try:
        svgs = render_all()
    except PerfDataError as e:
        raise PluginError(f"performance plots: {e}") from e
    for name, svg in svgs.items():
        files.append(File.generated(config, f"perf/{name}.svg", content=svg))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    from mkdocs.exceptions import PluginError

    placed: set[str] = set()

    def image(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in PLOTS:
            raise PluginError(f"performance plots: {PAGE} names no plot {name!r} ({m.group(0)})")
        placed.add(name)
        return f"![{PLOTS[name].title}](perf/{name}.svg)"

    markdown = MARKER.sub(image, markdown)
    for name in sorted(set(PLOTS) - placed):
        log.warning("performance plots: %s has no marker <!-- perf-plot: %s -->", PAGE, name)
    return markdown


if __name__ == "__main__":  # write the SVGs to a folder, to look at them
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "perf-plots")
    out.mkdir(parents=True, exist_ok=True)
    for plot_name, svg in render_all().items():
        (out / f"{plot_name}.svg").write_text(svg, encoding="utf-8")
        print(out / f"{plot_name}.svg")
