"""``omni bench attack``'s per-client arms: one client attacks a live server while a normal
client uses it, each attack measured as a ratio in one run.

The server is ``omni serve configs/mm_chat.yaml`` (the tiny Llava: it takes images) with a
keys file of three keys, ``normal``, ``tiered`` (``normal``'s limits, weight
:data:`TIERED_WEIGHT`) and ``attacker`` (:data:`ATTACKER_LIMITS`), and
``--max-running-requests`` :data:`MAX_RUNNING` (the fair gate between keys), shared by the
arms (:class:`SharesServer`). Each arm (:func:`run_arm`) measures the normal client's
latency (``CLIENTS`` threads sending requests one after another) for ``measure_s`` idle,
then starts the attacker in a process of its own (its CPU is not the normal client's
GIL), waits until it says its attack is under way, and measures again for ``measure_s``:

* ``prompts``: ``PROMPT_THREADS`` threads post bodies of ``prompt_mb`` MB with the
  attacker's key, a chat of one string, a completion's ``prompt``, a chat of many
  messages (the server refuses each by its characters, before anything is tokenized);
* ``connections``: ``held`` connections from another address (127.0.0.2), half idle and
  half sending a head a byte at a time, each one opened again once the server closes it
  (the per-address cap answers 429; a head past its deadline 408);
* ``image_headers``: ``IMAGE_THREADS`` threads post chats with a PNG of ``png_chunks``
  empty chunks (Pillow parses chunks in Python; the header budget refuses it), while the
  normal client sends chats with a small image;
* ``keys``: ``FLOOD_THREADS`` threads send short chats as fast as they are answered with
  the attacker's key (past its share: 429); both keys weigh the same at the fair gate,
  so the flood runs as many as the normal client;
* ``keys_weighted``: the same flood, the normal client with the ``tiered`` key, which
  weighs :data:`TIERED_WEIGHT` times the attacker's (an interactive tier beside a batch
  one): the flood runs a quarter of the places.

Each arm reports ``p99_ms_idle``, ``p99_ms_attack`` and ``ratio`` (target <= 2), the
attacker's answers by status (``attacker_statuses``; ``none``: closed without an answer,
``error``: no connection), ``attacker_2xx`` (target 0 but in the ``keys`` arms, whose attacker
is served within its share) and ``attacker_5xx`` (answers of 500 or more but 503: target
0), ``normal_refused`` (the normal client's answers other than 200) and ``lost`` (its
requests with no answer: target 0).
"""

from __future__ import annotations

import base64
import json
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from omni_bench.serve import OMNI, Server, free_port

CLIENTS = 2  # the normal client's threads
PROMPT_THREADS = 4
IMAGE_THREADS = 2
FLOOD_THREADS = 32
ATTACKER_ADDRESS = "127.0.0.2"  # another client address than the normal client's
ATTACKER_LIMITS = {"max_inflight": 4, "max_queued": 8, "max_connections": 16}
# --max-running-requests: about where this pipeline stops gaining throughput on 2 cores
# (the normal client's 2 chats alone keep 1.7 of them busy); with two keys active, each
# runs at most 2 (its share), so the flood cannot outnumber the normal client in the pipeline
MAX_RUNNING = 4
# the tiered key's weight: its share of the MAX_RUNNING places is 3 with the attacker
# active (the attacker's 1), so the normal client's 2 never wait and the flood runs 1
TIERED_WEIGHT = 3
FLOODS = ("keys", "keys_weighted")  # the arms whose attacker floods with chats
PNG_1X1 = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def p99(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    q = statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]
    return round(q, 1)


def png_with_chunks(empty: int) -> bytes:
    """A 1x1 PNG with ``empty`` empty private chunks before its pixels (12 bytes each)."""

    def chunk(cid: bytes, data: bytes = b"") -> bytes:
        return struct.pack(">I", len(data)) + cid + data + struct.pack(">I", zlib.crc32(cid + data))

    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
    idat = chunk(b"IDAT", zlib.compress(b"\0\0\0\0"))
    return b"\x89PNG\r\n\x1a\n" + ihdr + chunk(b"ruBy") * empty + idat + chunk(b"IEND")


def image_chat(png: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [
        {"type": "text", "text": "What is this? "},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


# ---------------------------------------------------------------------- the server
class SharesServer:
    """``omni serve CONFIG`` with a keys file of ``normal``, ``tiered`` and ``attacker``, started at
    the first :meth:`get`, stopped by :meth:`stop`."""

    def __init__(self, config: str, ready_timeout: float, extra: list[str]) -> None:
        self.config, self.ready_timeout, self.extra = config, ready_timeout, extra
        self.tmp: tempfile.TemporaryDirectory[str] | None = None
        self.server: Server | None = None
        self.keys: dict[str, str] = {}

    def get(self) -> tuple[str, dict[str, str]]:
        """(its URL, key name -> key)."""
        if self.server is None:
            import secrets

            self.tmp = tempfile.TemporaryDirectory(prefix="omni-bench-shares-")
            names = ("normal", "tiered", "attacker")
            self.keys = {n: secrets.token_urlsafe(32) for n in names}
            keys_file = Path(self.tmp.name) / "keys.json"
            entries = [
                {"name": "normal", "key": self.keys["normal"]},
                {"name": "tiered", "key": self.keys["tiered"], "weight": TIERED_WEIGHT},
                {"name": "attacker", "key": self.keys["attacker"], **ATTACKER_LIMITS},
            ]
            keys_file.write_text(json.dumps({"keys": entries}))
            keys_file.chmod(0o600)
            cmd = [
                *OMNI,
                "serve",
                self.config,
                "--host",
                "127.0.0.1",
                "--port",
                str(free_port()),
                "--api-keys-file",
                str(keys_file),
                "--max-running-requests",
                str(MAX_RUNNING),
                *self.extra,
            ]
            env = {k: v for k, v in __import__("os").environ.items() if k != "OMNI_API_KEY"}
            self.server = Server("omni", cmd, env, Path(self.tmp.name) / "serve.log")
            try:
                self.server.wait_ready(self.ready_timeout)
            except BaseException:
                self.stop()
                raise
        return self.server.url, self.keys

    def tail(self) -> str:
        return self.server.tail() if self.server is not None else ""

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.tmp is not None:
            self.tmp.cleanup()
            self.tmp = None


# ---------------------------------------------------------------------- the normal client
class Probe:
    """The normal client: ``CLIENTS`` threads sending ``body`` one after another."""

    def __init__(self, url: str, key: str, body: dict[str, Any]) -> None:
        self.url, self.body = url, body
        self.headers = {"Authorization": f"Bearer {key}"}

    def run_for(self, seconds: float) -> dict[str, Any]:
        """Latencies (ms) of the answered requests, others by status, and lost ones."""
        lock = threading.Lock()
        out: dict[str, Any] = {"ms": [], "refused": Counter(), "lost": 0}
        end = time.monotonic() + seconds

        def client() -> None:
            with httpx.Client(timeout=60, headers=self.headers) as c:
                while time.monotonic() < end:
                    t = time.perf_counter()
                    try:
                        r = c.post(f"{self.url}/v1/chat/completions", json=self.body)
                    except httpx.HTTPError:
                        with lock:
                            out["lost"] += 1
                        continue
                    ms = (time.perf_counter() - t) * 1000
                    with lock:
                        if r.status_code == 200:
                            out["ms"].append(ms)
                        else:
                            out["refused"][str(r.status_code)] += 1

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


def run_arm(
    url: str, keys: dict[str, str], kind: str, spec: dict[str, Any], measure_s: float
) -> dict[str, Any]:
    """One attack (``kind``, the attacker's ``spec``) against the normal client: see the
    module."""
    body = image_chat(PNG_1X1) if kind == "image_headers" else CHAT
    probe = Probe(url, keys["tiered" if kind == "keys_weighted" else "normal"], body)
    probe.run_for(min(2.0, measure_s))  # warm: the first requests load what they need
    idle = probe.run_for(measure_s)
    full = {"url": url, "key": keys["attacker"], "kind": kind, **spec}
    attacker = subprocess.Popen(
        [sys.executable, "-c", ATTACKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert attacker.stdin is not None and attacker.stdout is not None
    attacker.stdin.write(json.dumps(full) + "\n")  # (the key: on stdin, not the command line)
    attacker.stdin.flush()
    ready = attacker.stdout.readline().strip()
    if ready != "ready":
        attacker.kill()
        raise RuntimeError(f"the {kind} attacker did not start (said {ready!r})")
    during = probe.run_for(measure_s)
    attacker.stdin.close()  # the attack ends
    said = attacker.stdout.read()
    attacker.wait(timeout=120)
    if attacker.returncode != 0:
        raise RuntimeError(f"the {kind} attacker failed (exit {attacker.returncode})")
    statuses: dict[str, int] = json.loads(said)["statuses"]
    idle_p99, attack_p99 = p99(idle["ms"]), p99(during["ms"])
    return {
        "p99_ms_idle": idle_p99,
        "p99_ms_attack": attack_p99,
        "ratio": round(attack_p99 / idle_p99, 2) if idle_p99 > 0 else float("nan"),
        "normal_requests": len(idle["ms"]) + len(during["ms"]),
        "normal_refused": dict(idle["refused"] + during["refused"]),
        "lost": idle["lost"] + during["lost"],
        "attacker_statuses": dict(sorted(statuses.items())),
        "attacker_2xx": sum(n for s, n in statuses.items() if s.startswith("2")),
        "attacker_5xx": sum(
            n for s, n in statuses.items() if s.isdigit() and int(s) >= 500 and s != "503"
        ),
        **{k: v for k, v in spec.items() if k != "body"},
    }


# ---------------------------------------------------------------------- the attacker
ATTACKER = "from omni_bench.attack_shares import attacker_main; attacker_main()"


def attacker_main() -> None:
    """The attacker's process: its spec on stdin's first line; ``ready`` on stdout once
    the attack is under way; it goes on until stdin closes, then writes its answers by
    status (a JSON line)."""
    spec = json.loads(sys.stdin.readline())
    stop = threading.Event()
    statuses: Counter[str] = Counter()
    lock = threading.Lock()
    started = threading.Event()  # the attack is under way

    def count(status: str) -> None:
        with lock:
            statuses[status] += 1
        if spec["kind"] != "connections":  # (those: once every one was opened)
            started.set()

    kinds = {
        "prompts": _prompts,
        "connections": _connections,
        "image_headers": _image_headers,
        **dict.fromkeys(FLOODS, _flood),
    }
    threads = kinds[spec["kind"]](spec, stop, count, started)
    for t in threads:
        t.start()
    if not started.wait(120):
        raise SystemExit(f"the {spec['kind']} attack did not get under way in 120 s")
    print("ready", flush=True)
    sys.stdin.read()  # until the bench closes it
    stop.set()
    for t in threads:
        t.join(timeout=120)
    print(json.dumps({"statuses": dict(statuses)}), flush=True)


def _posting(spec: dict[str, Any], bodies: list[tuple[str, bytes]], n: int, stop, count):
    """``n`` threads posting ``bodies`` in turn with the attacker's key until ``stop``."""
    headers = {"Authorization": f"Bearer {spec['key']}", "Content-Type": "application/json"}

    def run(i: int) -> None:
        with httpx.Client(timeout=120, headers=headers) as c:
            while not stop.is_set():
                path, raw = bodies[i % len(bodies)]
                i += 1
                try:
                    count(str(c.post(spec["url"] + path, content=raw).status_code))
                except httpx.HTTPError:
                    count("error")

    return [threading.Thread(target=run, args=(i,)) for i in range(n)]


def _prompts(
    spec: dict[str, Any], stop: threading.Event, count: Any, started: threading.Event
) -> list[threading.Thread]:
    size = int(spec["prompt_mb"] * (1 << 20))
    text = "lorem ipsum " * (size // 12)
    many = [{"role": "user", "content": text[i : i + 65_000]} for i in range(0, len(text), 65_000)]
    bodies = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", {"prompt": text}),
        ("/v1/chat/completions", {"messages": many}),
    ]
    raw = [(p, json.dumps({**b, "max_tokens": 4}).encode()) for p, b in bodies]
    return _posting(spec, raw, PROMPT_THREADS, stop, count)


def _image_headers(
    spec: dict[str, Any], stop: threading.Event, count: Any, started: threading.Event
) -> list[threading.Thread]:
    raw = json.dumps(image_chat(png_with_chunks(spec["png_chunks"]))).encode()
    return _posting(spec, [("/v1/chat/completions", raw)], IMAGE_THREADS, stop, count)


def _flood(
    spec: dict[str, Any], stop: threading.Event, count: Any, started: threading.Event
) -> list[threading.Thread]:
    raw = json.dumps(CHAT).encode()
    return _posting(spec, [("/v1/chat/completions", raw)], FLOOD_THREADS, stop, count)


def _connections(
    spec: dict[str, Any], stop: threading.Event, count: Any, started: threading.Event
) -> list[threading.Thread]:
    """``held`` connections from :data:`ATTACKER_ADDRESS`, half idle, half sending a head
    a byte every ``dribble_s``; each one the server closes is opened again a second later
    (``started``: once each was opened)."""
    host, port = spec["url"].removeprefix("http://").rsplit(":", 1)
    head = f"GET /health HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {spec['key']}\r\n"
    opened = threading.Semaphore(0)

    def all_opened() -> None:
        for _ in range(spec["held"]):
            opened.acquire()
        started.set()

    def one(i: int) -> None:
        dribble = (i % 2 == 1) and head.encode()
        first = True
        while not stop.is_set():
            s = socket.socket()
            try:
                s.bind((ATTACKER_ADDRESS, 0))
                s.settimeout(float(spec["dribble_s"]))
                s.connect((host, int(port)))
            except OSError:
                count("error")
                s.close()
                stop.wait(1.0)
                continue
            finally:
                if first:
                    opened.release()
                    first = False
            answer, sent = b"", 0
            with s:
                while not stop.is_set():
                    try:
                        got = s.recv(4096)
                        if not got:
                            break
                        answer += got
                    except TimeoutError:
                        if dribble:
                            try:
                                s.sendall(dribble[sent % len(dribble) : sent % len(dribble) + 1])
                            except OSError:
                                break
                            sent += 1
                    except OSError:
                        break
            if stop.is_set() and not answer:
                break  # still held when the attack ended
            parts = answer.split(b" ", 2)
            count(parts[1].decode(errors="replace") if len(parts) > 1 else "none")
            stop.wait(1.0)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(spec["held"])]
    return [*threads, threading.Thread(target=all_opened, daemon=True)]
