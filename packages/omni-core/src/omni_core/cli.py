"""The ``omni`` command: ``omni stages``, ``omni run``, ``omni trace``, ``omni bench``,
``omni models`` (:mod:`omni_core.models.named_models`), ``omni config normalize``, and
the subcommands plug-ins register under the entry-point group ``omni.commands`` (``omni
serve`` from omni-serve)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from omni_core.client.image_files import append_media_segment, save_image_event
from omni_core.registry import (
    RegistryError,
    benchmark_registry,
    command_registry,
    default_registry,
)

# plug-in subcommands named in the docs, and the distribution that brings each
KNOWN_PLUGIN_COMMANDS = {"serve": "omni-serve"}


def _cmd_stages(args: argparse.Namespace) -> int:
    reg = default_registry()
    rows = []
    for claims in reg.entries():
        for e in claims:
            rows.append(
                {
                    "name": e.name,
                    "value": e.value,
                    "distribution": e.distribution,
                    "version": e.version,
                    "conflict": len(claims) > 1,
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no stages installed (entry-point group 'omni.stages')")
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        flag = "  CONFLICT: registered by more than one distribution" if r["conflict"] else ""
        print(f"{r['name']:<{width}}  {r['distribution']} {r['version']}  {r['value']}{flag}")
    return 1 if any(r["conflict"] for r in rows) else 0


def _request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    request: dict[str, Any] = {}
    if args.input:
        try:
            request = json.loads(args.input)
        except json.JSONDecodeError as e:
            raise SystemExit(f"omni run: --input is not valid JSON: {e}") from None
        if not isinstance(request, dict):
            raise SystemExit("omni run: --input must be a JSON object")
    if args.prompt is not None:
        request["prompt"] = args.prompt
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"omni run: --set expects KEY=VALUE, got {item!r}")
        try:
            request[key] = json.loads(value)
        except json.JSONDecodeError:
            request[key] = value
    return request


def _describe(ev: Any) -> str:
    parts = [f"[{ev.stage}] {ev.event_type} #{ev.sequence}"]
    tokens = getattr(ev, "tokens", None)
    if tokens is not None:
        shown = tokens if len(tokens) <= 16 else [*tokens[:16], "..."]
        parts.append(f"tokens={shown}")
    if getattr(ev, "step", None) is not None and ev.event_type == "image":
        parts.append(f"step={ev.step}")
    for k, a in getattr(ev, "arrays", {}).items():
        shape = getattr(a, "shape", None)
        parts.append(f"{k}={'x'.join(map(str, shape)) if shape else len(a)}")
    if getattr(ev, "message", ""):
        parts.append(ev.message)
    text = ev.payload.get("text") if isinstance(ev.payload, dict) else None
    if text:
        parts.append(repr(text))
    return " ".join(parts)


def _load(args: argparse.Namespace) -> Any:
    """The validated config, or None after printing why it is not valid."""
    from omni_core.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"omni {args.command}: {e}", file=sys.stderr)
        return None
    return cfg.with_backend(getattr(args, "backend", None), getattr(args, "address", None))


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend", help="where the stage workers run: local | ray (default: the config's)"
    )
    p.add_argument("--address", help="ray: the cluster address (default: RAY_ADDRESS or local)")


def _cmd_run(args: argparse.Namespace) -> int:
    from omni_core.errors import StageStartError

    cfg = _load(args)
    if cfg is None:
        return 2
    try:
        return _run(args, cfg)
    except StageStartError as e:  # the stage's worker has logged its traceback
        print(f"omni run: {e}", file=sys.stderr)
        return 1


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """To whatever ``sys.stderr`` is when a record comes (not the one at its creation)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def show_start() -> None:
    """Print each step of a pipeline's start on stderr as it happens (the zygote's
    preload, each worker's start and ready), one line each."""
    start = logging.getLogger("omni.start")
    if not start.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("  start: %(message)s"))
        start.addHandler(handler)
        start.setLevel(logging.INFO)
        start.propagate = False


def _run(args: argparse.Namespace, cfg: Any) -> int:
    from omni_core.pipeline import Pipeline

    request = _request_from_args(args)
    view = RunView(show=not args.json)
    seen: dict[str, StageSeen] = {}
    out_dir = Path(args.out) if args.out else None
    written: list[Path] = []
    streams: set[Path] = set()  # streamed media files begun (audio chunks appended)
    t0 = time.monotonic()
    status = 0
    show_start()
    with Pipeline(cfg) as pipe:
        started = view.started = time.monotonic()
        if not args.json:
            print(
                f"pipeline {cfg.name!r}: {len(cfg.stages)} stages ready in {started - t0:.2f}s",
                file=sys.stderr,
            )
        for _i in range(args.repeat):
            submitted = time.monotonic()
            for ev in pipe.stream(request, timeout_s=args.timeout):
                seen.setdefault(ev.stage, StageSeen()).add(ev, time.monotonic() - submitted)
                files: list[Path] = []
                if out_dir is not None and ev.event_type == "image":
                    files = save_image_event(ev, out_dir, ev.request_id[:8])
                    written.extend(files)
                elif out_dir is not None and ev.event_type == "segment":
                    stream = append_media_segment(ev, out_dir, ev.request_id[:8], streams)
                    if stream is not None and stream not in written:
                        written.append(stream)
                text = ev.payload.get("text") if isinstance(ev.payload, dict) else None
                if args.json:
                    print(json.dumps(_event_json(ev)), flush=True)
                elif isinstance(text, str):  # a text stream: show it as it comes
                    view.text(ev, text)
                else:
                    view.event(ev, files if getattr(ev, "is_last", False) else [])
                if ev.terminal and ev.event_type != "completed":
                    status = 1
        view.end()
        if not args.json:
            print(
                f"done in {time.monotonic() - started:.3f}s ({args.repeat} request(s))",
                file=sys.stderr,
            )
            if written:
                print(f"{len(written)} media file(s) in {out_dir}/", file=sys.stderr)
            # the workers' counters come with their heartbeats: wait for one more round
            time.sleep(min(cfg.heartbeat_interval_s * 1.5, 2.0))
            print(run_summary(cfg, seen, pipe.metrics()), file=sys.stderr)
    return status


class RunView:
    """What ``omni run`` shows as a request runs (not with ``--json``): streamed text on
    stdout as it comes, a line per other event on stdout, and on stderr a progress bar
    per request while it samples (its image events' ``step`` of ``payload["steps"]``).

    With stderr on a terminal the bar (or, between bars, a status line: events per
    stage, elapsed) is redrawn in place on the last line, erased before anything else is
    written and never drawn while a text line is open on the same screen, so the streamed
    text is never garbled. Otherwise the bar is plain lines (:class:`Bar`), written only
    once the text line has ended.
    """

    def __init__(
        self, show: bool = True, out: Any = None, err: Any = None, tty: bool | None = None
    ) -> None:
        from omni_core.observability.progress import is_terminal

        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.show = show
        self.tty = show and (is_terminal(self.err) if tty is None else tty)
        # stdout and stderr on one screen: the status line must wait for a text line's end
        self.shared = self.tty and (is_terminal(self.out) if tty is None else tty)
        self.bars: dict[str, Any] = {}  # request id -> its open sampling bar
        self.counts: dict[str, int] = {}
        self.started = time.monotonic()
        self.status_shown = False
        self.text_open = False  # a streamed text line is open on stdout

    # -- what comes ----------------------------------------------------------------
    def text(self, ev: Any, text: str) -> None:
        self.counts[ev.stage] = self.counts.get(ev.stage, 0) + 1
        self.clear()
        self.out.write(text)
        self.out.flush()
        self.text_open = True

    def event(self, ev: Any, files: list[Path]) -> None:
        self.counts[ev.stage] = self.counts.get(ev.stage, 0) + 1
        self.clear()
        self.end_text_line()
        self.out.write(_describe(ev) + "\n")
        self.out.flush()
        for f in files:
            print(f"wrote {f}", file=self.err, flush=True)
        self.progress(ev)
        self.draw()

    def progress(self, ev: Any) -> None:
        """A request's sampling bar: opened by its first image event with a step, moved
        by the next, closed (a line that stays) by its last image or its end."""
        from omni_core.observability.progress import Bar

        rid, step = ev.request_id, getattr(ev, "step", None)
        bar = self.bars.get(rid)
        if ev.event_type == "image" and isinstance(step, int):
            total = ev.payload.get("steps") if isinstance(ev.payload, dict) else None
            total = total if isinstance(total, int) and total > 0 else None
            last = bool(getattr(ev, "is_last", False))
            if bar is None and not last:
                bar = self.bars[rid] = Bar(
                    f"{rid[:8]} {ev.stage}", total, stream=self.err, tty=self.tty, live=False
                )
            if bar is not None:
                bar.update(step, total or (step if last else None))
                if last:
                    bar.close()
                    del self.bars[rid]
        elif ev.terminal and bar is not None:
            del self.bars[rid]
            bar.close("" if ev.event_type == "completed" else ev.event_type)

    def end(self) -> None:
        self.clear()
        self.end_text_line()
        self.out.flush()
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()

    def end_text_line(self) -> None:
        """The streamed text stopped: close its line, so what follows starts on its own."""
        if self.text_open:
            self.out.write("\n")
            self.text_open = False

    # -- the last line of a terminal ---------------------------------------------------
    def clear(self) -> None:
        if self.status_shown:
            self.err.write("\r\033[K")
            self.err.flush()
            self.status_shown = False
        for bar in self.bars.values():
            bar.clear()

    def draw(self) -> None:
        if not self.tty or (self.shared and self.text_open):
            return
        if self.bars:
            next(reversed(self.bars.values())).draw()  # the latest request's
            return
        progress = "  ".join(f"{s}:{n}" for s, n in self.counts.items())
        self.err.write(f"  {progress}  {time.monotonic() - self.started:.2f}s")
        self.err.flush()
        self.status_shown = True


class StageSeen:
    """What one stage sent the caller during ``omni run``: events, tokens, denoising
    steps, and when (seconds after the request was submitted; over ``--repeat``, the
    latest request's)."""

    def __init__(self) -> None:
        self.events = self.tokens = self.steps = 0
        self.first = self.last = 0.0

    def add(self, ev: Any, at: float) -> None:
        if not self.events or at < self.first:
            self.first = at
        self.events += 1
        self.last = max(self.last, at)
        self.tokens += len(getattr(ev, "tokens", None) or ())
        step = getattr(ev, "step", None)
        if isinstance(step, int):
            self.steps = max(self.steps, step)


def run_summary(cfg: Any, seen: dict[str, StageSeen], metrics: dict[str, Any]) -> str:
    """Per stage, in the config's order, from the workers' metrics: what it emitted, how
    long its work waited in its queue before the stage took it (``queued``: in all over
    the run; the longest single wait is in ``metrics()``'s ``queued_max_s``) and how long
    it waited on its downstream (``blocked``, backpressure); and what the caller saw of
    it. A figure the backend does not measure (``mrs.enabled: false``) shows ``-``."""
    stages = metrics.get("stages", {})
    lines = [
        f"{'stage':<14}{'emitted':>8}{'to you':>8}{'tokens':>8}{'steps':>7}"
        f"{'first':>9}{'last':>9}{'queued':>9}{'blocked':>9}{'errors':>8}"
    ]

    def secs(m: dict[str, Any], key: str) -> str:
        value = m.get(key)
        return f"{value:.2f}s" if isinstance(value, int | float) else "-"

    def worker_row(label: str, m: dict[str, Any]) -> str:
        return (
            f"{label:<14}{m.get('emitted', 0):>8}{'':>8}{'':>8}{'':>7}{'':>9}{'':>9}"
            f"{secs(m, 'queued_s'):>9}{secs(m, 'blocked_s'):>9}{m.get('errors', 0):>8}"
        )

    for spec in cfg.stages:
        # a replicated stage: its replicas' figures summed, then a row for each replica
        replicas = {w: stages[w] for w in cfg.workers(spec.name) if w != spec.name and w in stages}
        m = _summed(replicas.values()) if replicas else stages.get(spec.name, {})
        s = seen.get(spec.name)
        first = f"{s.first:.2f}s" if s else "-"
        last = f"{s.last:.2f}s" if s else "-"
        lines.append(
            f"{spec.name:<14}{m.get('emitted', 0):>8}{s.events if s else 0:>8}"
            f"{s.tokens if s else 0:>8}{s.steps if s else 0:>7}{first:>9}{last:>9}"
            f"{secs(m, 'queued_s'):>9}{secs(m, 'blocked_s'):>9}{m.get('errors', 0):>8}"
        )
        lines.extend(worker_row(f"  {w}", rm) for w, rm in replicas.items())
    return "\n".join(lines)


def _summed(metrics: Any) -> dict[str, Any]:
    """The counters of several workers' metrics added up (the others left out)."""
    out: dict[str, Any] = {}
    for m in metrics:
        for k in ("emitted", "errors", "queued_s", "blocked_s"):
            if isinstance(m.get(k), int | float):
                out[k] = out.get(k, 0) + m[k]
    return out


def _event_json(ev: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "event_type": ev.event_type,
        "request_id": ev.request_id,
        "sequence": ev.sequence,
        "stage": ev.stage,
        "ts": ev.ts,
        "payload": ev.payload,
    }
    for key in ("tokens", "step", "is_last", "message", "code", "reason"):
        if hasattr(ev, key):
            out[key] = getattr(ev, key)
    out["arrays"] = {
        k: list(getattr(a, "shape", (len(a),))) for k, a in getattr(ev, "arrays", {}).items()
    }
    return out


def _cmd_trace(args: argparse.Namespace) -> int:
    from omni_core.pipeline import Pipeline

    cfg = _load(args)
    if cfg is None:
        return 2
    cfg.trace = True
    cfg.mrs.enabled = True
    request = _request_from_args(args)
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([dict(request) for _ in range(args.requests)], timeout_s=args.timeout)
        time.sleep(2.5 * cfg.heartbeat_interval_s)  # the last records ride the next heartbeat
        trace = pipe.trace()
    with open(args.out, "w") as f:
        json.dump(trace, f)
    if args.png is not None:
        from omni_core.observability.trace_png import write_timeline_png

        png = args.png or str(Path(args.out).with_suffix(".png"))
        try:
            write_timeline_png(trace, png)
        except ImportError as e:
            print(f"omni trace --png: {e}", file=sys.stderr)
            return 2
        print(f"wrote {png}: the timeline, a row per stage", file=sys.stderr)
    spans = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    failed = [o for o in outs if not o.ok]
    print(
        f"wrote {args.out}: {args.requests} request(s), {spans} stage spans, "
        f"{len(trace['traceEvents'])} trace events; open it in ui.perfetto.dev",
        file=sys.stderr,
    )
    for o in failed:
        print(f"request {o.request_id}: {o.finish_reason}: {o.error}", file=sys.stderr)
    return 1 if failed else 0


def _cmd_config_normalize(args: argparse.Namespace) -> int:
    from omni_core.config import ConfigError, normalized_yaml

    try:
        print(normalized_yaml(args.config), end="")
    except ConfigError as e:
        print(f"omni config normalize: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    reg = benchmark_registry()
    if args.name is None:
        print("benchmarks:", ", ".join(reg.names()) or "none installed (install omni-bench)")
        return 0
    try:
        fn = reg.load(args.name)
    except RegistryError as e:
        print(f"omni bench: {e}", file=sys.stderr)
        return 2
    return int(fn(rest) or 0)


def _cmd_plugin(name: str, rest: list[str]) -> int:
    reg = command_registry()
    if name not in reg.names():
        dist = KNOWN_PLUGIN_COMMANDS[name]
        print(
            f"omni {name}: this command comes with the {dist} package, which is not installed "
            f"(pip install {dist})",
            file=sys.stderr,
        )
        return 2
    try:
        fn = reg.load(name)
    except RegistryError as e:
        print(f"omni {name}: {e}", file=sys.stderr)
        return 2
    return int(fn(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni", description="omni pipeline runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    builtin = {"stages", "run", "trace", "bench", "models", "config"}
    plugins: dict[str, str] = {}  # name -> help
    for claims in command_registry().entries():
        if claims[0].name not in builtin:
            plugins[claims[0].name] = f"from {', '.join(e.distribution for e in claims)}"
    for name, dist in KNOWN_PLUGIN_COMMANDS.items():
        plugins.setdefault(name, f"needs {dist} (not installed)")

    p = sub.add_parser("stages", help="list the installed stage kinds")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("run", help="run a request through a pipeline and stream its events")
    p.add_argument("config", help="pipeline YAML file")
    p.add_argument("--input", help="the request as a JSON object")
    p.add_argument("--prompt", help="shorthand for a request with this prompt")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="set one request field")
    p.add_argument("--repeat", type=int, default=1, help="run the request this many times")
    p.add_argument("--timeout", type=float, default=None, help="per-request timeout in seconds")
    p.add_argument("--json", action="store_true", help="print events as JSON lines")
    p.add_argument("--out", help="write media here: images (previews, finals) and streamed audio")
    add_backend_args(p)

    p = sub.add_parser("trace", help="run requests with tracing on; write Chrome trace JSON")
    p.add_argument("config", help="pipeline YAML file")
    p.add_argument("--requests", type=int, default=8, help="requests run at once")
    p.add_argument("--out", default="omni-trace.json", help="where to write the trace")
    p.add_argument("--input", help="each request as a JSON object")
    p.add_argument("--prompt", help="shorthand for a request with this prompt")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="set one request field")
    p.add_argument("--timeout", type=float, default=None, help="per-request timeout in seconds")
    p.add_argument(
        "--png",
        nargs="?",
        const="",
        metavar="FILE",
        help="also draw the timeline as a PNG (default: --out with .png)",
    )
    add_backend_args(p)

    p = sub.add_parser("config", help="pipeline configs: normalize one")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    p = config_sub.add_parser(
        "normalize", help="print a config in omni's canonical spelling (design doc keys rewritten)"
    )
    p.add_argument("config", help="pipeline YAML file")

    for name, about in sorted(plugins.items()):
        # the plug-in parses its own arguments (``omni NAME --help`` is its help)
        sub.add_parser(name, help=about, add_help=False)

    # `omni models list|pull NAME` parses its own arguments
    sub.add_parser("models", help="named models: list them, pull one", add_help=False)

    # no -h of its own: `omni bench NAME --help` is the benchmark's help
    p = sub.add_parser("bench", help="run a benchmark (prints one JSON object)", add_help=False)
    p.add_argument("name", nargs="?", help="benchmark name; none lists them")

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _cmd_bench(args, rest)
    if args.command == "models":
        from omni_core.models.named_models import main as models_main

        return models_main(rest)
    if args.command in plugins:
        return _cmd_plugin(args.command, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "stages":
        return _cmd_stages(args)
    if args.command == "trace":
        return _cmd_trace(args)
    if args.command == "config":
        return _cmd_config_normalize(args)
    return _cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
