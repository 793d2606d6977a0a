"""``omni bench chaos``: does the runtime never hang and never lie while it is broken?

Requests stream through a pipeline (``--target synthetic``: source -> faulty -> sink on
the Python API, for speed; ``--target ar_chat``: ``configs/ar_chat.yaml`` behind the
OpenAI server, over HTTP) while faults are injected in turn, one per ``--phase-s``:

* ``sigkill``: SIGKILL of a random stage worker;
* ``sigstop``: SIGSTOP of a random stage worker past its stall timeout (then SIGCONT);
* ``bad_frame``: garbage bytes and a frame whose one message does not decode (naming a
  request in flight) pushed into a random worker's data socket;
* ``bad_payload``: a message a plug-in could emit but nobody can decode (an int-keyed
  payload): synthetic, by requests that make the faulty stage emit it; ar_chat, pushed
  onto the results socket for a request in flight;
* ``slow_reader``: callers that read their long streams slowly;
* ``burst``: 10x ``max_queued_requests`` requests at once.

Health is sampled every 50 ms (``Pipeline.health`` / ``GET /health``) and checked against
the processes themselves: a sample that says healthy while a reported worker is gone
(for over 0.5 s), has been stopped longer than health's own unresponsive threshold plus
0.5 s, or the runtime has failed, is a ``health_lie``. A request with no terminal event by
its deadline + 10 s is ``lost``. Targets: ``lost == 0``, ``health_lies == 0``,
``shm_segments_left == 0``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from typing import Any

from omni_core import Pipeline, load_config
from omni_core.control.supervisor import LATE_HEARTBEATS, MIN_LATE_S
from omni_core.dataplane.serial import encode_frame
from omni_core.dataplane.shm import list_segments
from omni_core.errors import OverloadedError
from omni_core.events import Segment
from omni_testing.configs import chain
from omni_testing.hostile import push_frames

from omni_bench.report import emit
from omni_bench.soak import rss_bytes

FAULTS = ("sigkill", "sigstop", "bad_frame", "bad_payload", "slow_reader", "burst")
GRACE_LOST_S = 10.0


def synthetic_config(stall_s: float, max_queued: int) -> dict[str, Any]:
    common = {"stall_timeout_s": stall_s, "restart_backoff_s": 0.1, "max_restarts": 100}
    return chain(
        ("src", "synthetic.source", {"segment": 2, "delay_s": 0.005}, dict(common)),
        ("faulty", "synthetic.faulty", {}, dict(common)),
        ("sink", "synthetic.map", {"offset": 1}, dict(common)),
        heartbeat_interval_s=0.1,
        max_queued_requests=max_queued,
    )


def proc_state(pid: int | None) -> str:
    """'gone', or the kernel's one-letter state of ``pid`` (R, S, T, Z ...)."""
    if pid is None:
        return "gone"
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


class Books:
    """Every request tried, accounted once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[int, float] = {}  # request -> deadline (monotonic)
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self.n = 0

    def begin(self, timeout_s: float) -> int:
        with self.lock:
            i = self.n
            self.n += 1
            self.open[i] = time.monotonic() + timeout_s
            return i

    def end(self, i: int, outcome: str, code: str = "", example: str = "") -> None:
        with self.lock:
            if self.open.pop(i, None) is None:
                return  # already counted lost
            self.outcomes[outcome] += 1
            if code:
                self.errors[code] += 1
                self.examples.setdefault(code, example[:300])

    def end_with(self, i: int, ev: Any) -> None:
        """Book request ``i`` by its terminal event."""
        if ev.event_type == "completed":
            self.end(i, "completed")
        elif ev.event_type == "cancelled":
            self.end(i, "errored", ev.reason, ev.reason)
        else:
            self.end(i, "errored", ev.code, ev.message)

    def lost(self, now: float, final: bool = False) -> int:
        with self.lock:
            late = [i for i, d in self.open.items() if final or now > d + GRACE_LOST_S]
            for i in late:
                del self.open[i]
            self.outcomes["lost"] += len(late)
            return len(late)


class PythonTarget:
    """Requests on the Python API; health from ``Pipeline.health``."""

    def __init__(self, pipe: Pipeline, args: argparse.Namespace) -> None:
        self.pipe = pipe
        self.args = args

    def request(self, books: Books, n: int, slow_s: float = 0.0, extra: dict | None = None) -> None:
        i = books.begin(self.args.timeout_s)
        try:
            h = self.pipe.submit({"n": n, **(extra or {})}, timeout_s=self.args.timeout_s)
        except OverloadedError:
            books.end(i, "rejected_429")
            return
        except Exception as e:
            books.end(i, "rejected", type(e).__name__, str(e))
            return
        for ev in h:
            if slow_s:
                time.sleep(slow_s)
            if ev.terminal:
                books.end_with(i, ev)
                return

    def health(self) -> tuple[bool, dict[str, int | None]]:
        h = self.pipe.health()
        return self.pipe.healthy, {n: s.get("pid") for n, s in h.items()}

    def bad_payload(self, books: Books) -> None:
        self.request(books, 4, extra={"undecodable": True})


class HttpTarget:
    """Chat completions over HTTP on an in-process ``omni serve``; health from /health."""

    def __init__(self, pipe: Pipeline, args: argparse.Namespace, base: str) -> None:
        import httpx

        self.pipe = pipe
        self.args = args
        self.base = base
        self.http = httpx.Client(base_url=base, timeout=args.timeout_s + GRACE_LOST_S)

    def request(self, books: Books, n: int, slow_s: float = 0.0, extra: dict | None = None) -> None:
        import httpx

        i = books.begin(self.args.timeout_s)
        body = {
            "messages": [{"role": "user", "content": f"Count to {n}."}],
            "max_tokens": n,
            "timeout_s": self.args.timeout_s,
            "stream": bool(slow_s),
        }
        try:
            if slow_s:
                self._stream(books, i, body, slow_s)
                return
            r = self.http.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            books.end(i, "errored", "http_" + type(e).__name__, str(e))
            return
        self._answer(books, i, r.status_code, r.content)

    def _stream(self, books: Books, i: int, body: dict, slow_s: float) -> None:
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                self._answer(books, i, r.status_code, r.content)
                return
            for line in r.iter_lines():
                time.sleep(slow_s)
                if line.startswith("data: ") and '"error"' in line:
                    err = json.loads(line[6:]).get("error", {})
                    books.end(i, "errored", err.get("code") or "error", err.get("message", ""))
                    return
                if line == "data: [DONE]":
                    books.end(i, "completed")
                    return
        books.end(i, "errored", "stream_ended", "stream ended without [DONE]")

    @staticmethod
    def _answer(books: Books, i: int, status: int, content: bytes) -> None:
        if status == 200:
            books.end(i, "completed")
        elif status == 429:
            books.end(i, "rejected_429")
        else:
            try:
                err = json.loads(content)["error"]
                code, message = err.get("code") or str(status), err.get("message", "")
            except (ValueError, KeyError, TypeError):
                code, message = str(status), content[:200].decode(errors="replace")
            books.end(i, "errored", code, message)

    def health(self) -> tuple[bool, dict[str, int | None]]:
        r = self.http.get("/health")
        stages = r.json().get("stages", {})
        return r.status_code == 200, {n: s.get("pid") for n, s in stages.items()}

    def bad_payload(self, books: Books) -> None:
        inject_bad_result(self.pipe)


def in_flight(pipe: Pipeline) -> list[str]:
    """Wire ids of requests open now."""
    with pipe.backend.requests.lock:
        return list(pipe.backend.collector.wire)


def inject_bad_frame(pipe: Pipeline, stage: str) -> None:
    wire = in_flight(pipe)
    bad = Segment(request_id=wire[0] if wire else "nobody", stage="x", payload={0: "x"})
    push_frames(pipe.backend.addr.data(stage), os.urandom(64), encode_frame([bad]))


def inject_bad_result(pipe: Pipeline) -> None:
    wire = in_flight(pipe)
    sink = pipe.config.sinks()[0]
    bad = Segment(request_id=wire[0] if wire else "nobody", stage=sink, payload={0: "x"})
    push_frames(pipe.backend.addr.results, os.urandom(64), encode_frame([bad]))


class Chaos:
    def __init__(self, pipe: Pipeline, target: Any, args: argparse.Namespace) -> None:
        self.pipe = pipe
        self.target = target
        self.args = args
        self.books = Books()
        self.rng = random.Random(args.seed)
        self.stop = threading.Event()
        self.samples = 0
        self.health_errors = 0
        self.health_error_example = ""
        self.lies: Counter[str] = Counter()
        self.lie_examples: list[str] = []
        self.injected: Counter[str] = Counter()
        self.rss_max = 0
        late = max(MIN_LATE_S, LATE_HEARTBEATS * pipe.config.heartbeat_interval_s)
        self.stopped_grace_s = late + 0.5

    def client(self) -> None:
        while not self.stop.is_set():
            before = self.books.outcomes["rejected_429"]
            self.target.request(self.books, self.rng.randint(8, self.args.tokens))
            if self.books.outcomes["rejected_429"] > before:
                self.stop.wait(0.2)  # as a client honouring Retry-After would

    def sampler(self) -> None:
        first_seen: dict[tuple[int, str], float] = {}
        while not self.stop.wait(0.05):
            try:
                healthy, pids = self.target.health()
            except Exception as e:  # health itself failed to answer: counted, not a lie
                self.health_errors += 1
                self.health_error_example = self.health_error_example or repr(e)[:300]
                continue
            now = time.monotonic()
            self.samples += 1
            self.rss_max = max(self.rss_max, rss_bytes())
            if healthy and self.pipe.failure is not None:
                self._lie("runtime_failed", "healthy after the runtime failed")
            for stage, pid in pids.items():
                state = proc_state(pid)
                kind = {"gone": "dead", "Z": "dead", "T": "stopped", "t": "stopped"}.get(state)
                if kind is None:
                    continue
                since = first_seen.setdefault((pid or 0, kind), now)
                grace = 0.5 if kind == "dead" else self.stopped_grace_s
                if healthy and now - since > grace:
                    self._lie(kind, f"{stage} (pid {pid}) {kind} {now - since:.1f} s, healthy")

    def _lie(self, kind: str, example: str) -> None:
        self.lies[kind] += 1
        if len(self.lie_examples) < 5:
            self.lie_examples.append(example)

    # -- faults ------------------------------------------------------------------
    def stage_pid(self) -> tuple[str, int]:
        alive = {n: h["pid"] for n, h in self.pipe.health().items() if h.get("alive")}
        name = self.rng.choice(sorted(alive))
        return name, alive[name]

    def inject(self, fault: str) -> None:
        self.injected[fault] += 1
        stall = self.args.stall_timeout_s
        if fault == "sigkill":
            os.kill(self.stage_pid()[1], signal.SIGKILL)
        elif fault == "sigstop":
            _, pid = self.stage_pid()
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stall + 1.5)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        elif fault == "bad_frame":
            inject_bad_frame(self.pipe, self.stage_pid()[0])
        elif fault == "bad_payload":
            for _ in range(3):
                self.target.bad_payload(self.books)
        elif fault == "slow_reader":
            readers = [
                threading.Thread(target=self.target.request, args=(self.books, 256, 0.05))
                for _ in range(3)
            ]
            for t in readers:
                t.start()
            for t in readers:
                t.join(self.args.timeout_s + GRACE_LOST_S)
        elif fault == "burst":
            n = 10 * self.args.max_queued_requests
            burst = [
                threading.Thread(target=self.target.request, args=(self.books, 8)) for _ in range(n)
            ]
            for t in burst:
                t.start()
            for t in burst:
                t.join(self.args.timeout_s + GRACE_LOST_S)

    def run(self) -> dict[str, Any]:
        args = self.args
        threads = [threading.Thread(target=self.client, daemon=True) for _ in range(args.clients)]
        threads.append(threading.Thread(target=self.sampler, daemon=True))
        for t in threads:
            t.start()
        t0 = time.monotonic()
        time.sleep(args.phase_s)
        gc.collect()
        rss_start = rss_bytes()
        for fault in args.faults:
            try:
                self.inject(fault)
            except Exception as e:  # a fault that could not be injected is reported
                self.injected[f"{fault}_failed: {type(e).__name__}: {e}"] += 1
            time.sleep(args.phase_s)
            self.books.lost(time.monotonic())
        self.stop.set()
        end = time.monotonic() + args.timeout_s + GRACE_LOST_S
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        self.books.lost(time.monotonic(), final=True)
        gc.collect()
        rss_end = rss_bytes()
        o = self.books.outcomes
        return {
            "target": args.target,
            "faults": dict(self.injected),
            "requests": self.books.n,
            "completed": o["completed"],
            "errored": dict(self.books.errors),
            "rejected_429": o["rejected_429"],
            "rejected_other": o["rejected"],
            "lost": o["lost"],
            "health_samples": self.samples,
            "health_errors": self.health_errors,
            "health_error_example": self.health_error_example,
            "health_lies": sum(self.lies.values()),
            "health_lies_by_kind": dict(self.lies),
            "health_lie_examples": self.lie_examples,
            "restarts": {n: h["restarts"] for n, h in self.pipe.health().items()},
            "runtime_failure": self.pipe.failure,
            "error_examples": self.books.examples,
            "rss_start_mb": round(rss_start / 2**20, 1),
            "rss_max_mb": round(self.rss_max / 2**20, 1),
            "rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2),
            "wall_s": round(time.monotonic() - t0, 1),
        }


def serve_in_thread(pipe: Pipeline, port: int) -> Any:
    import uvicorn
    from omni_serve.app import create_app
    from omni_serve.settings import ServeSettings

    app = create_app(pipe, ServeSettings(model_name=pipe.config.name))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    end = time.monotonic() + 30
    while not server.started and time.monotonic() < end:
        time.sleep(0.05)
    return server


def ar_chat_config(args: argparse.Namespace) -> Any:
    import msgspec

    cfg = load_config(args.config)
    stages = [
        msgspec.structs.replace(
            s, stall_timeout_s=args.stall_timeout_s, restart_backoff_s=0.1, max_restarts=100
        )
        for s in cfg.stages
    ]
    return msgspec.structs.replace(
        cfg,
        stages=stages,
        heartbeat_interval_s=0.1,
        max_queued_requests=args.max_queued_requests,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench chaos", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--target", choices=("synthetic", "ar_chat"), default="synthetic")
    ap.add_argument("--config", default="configs/ar_chat.yaml", help="for --target ar_chat")
    ap.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    ap.add_argument("--phase-s", type=float, default=4.0, help="seconds between faults")
    ap.add_argument("--clients", type=int, default=4, help="requests kept in flight")
    ap.add_argument("--tokens", type=int, default=32, help="most tokens a request asks for")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="per-request deadline")
    ap.add_argument("--stall-timeout-s", type=float, default=3.0)
    ap.add_argument("--max-queued-requests", type=int, default=16)
    ap.add_argument("--port", type=int, default=18765)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.target == "synthetic":
        cfg = synthetic_config(args.stall_timeout_s, args.max_queued_requests)
    else:
        cfg = ar_chat_config(args)
    with Pipeline(cfg) as pipe:
        if args.target == "synthetic":
            target: Any = PythonTarget(pipe, args)
        else:
            server = serve_in_thread(pipe, args.port)
            target = HttpTarget(pipe, args, f"http://127.0.0.1:{args.port}")
        res = Chaos(pipe, target, args).run()
        if args.target != "synthetic":
            server.should_exit = True
    res["shm_segments_left"] = len(list_segments(os.getpid()))
    res["targets_met"] = {
        "lost == 0": res["lost"] == 0,
        "health_lies == 0": res["health_lies"] == 0,
        "shm_segments_left == 0": res["shm_segments_left"] == 0,
    }
    emit(res, args.json)
    return 0
