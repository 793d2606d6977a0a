"""``omni bench attack``'s server arm: a live ``omni serve`` (a text pipeline) attacked
over HTTP by one client while others use it.

* ``/health`` is sampled every ~10 ms, idle (``health_p99_ms_idle``) and while bodies at
  the 20 MiB limit are posted (``health_p99_ms_during_big_body``, target <= 50): a chat of
  one 20 MiB string and a completion of ~99,000 numbers, each parsed in full and refused
  by the server (a string ``max_tokens``), and the same chat well-typed, which the server
  refuses too, by its characters, before the pipeline's intake would tokenize it.
* 64 slow-loris connections, 32 sending a head and 32 a body a byte a second
  (``slowloris_closed`` of ``slowloris``, ``slowloris_max_open_s``, and
  ``slowloris_open_past_deadline``: those open 2 s past the server's deadline, target 0),
  while 4 normal clients send chats: their requests per second against the same without
  the attack (``served_ratio``, target >= 0.9) and ``lost``, their requests that got no
  answer (target 0).
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

LIMIT = 20 << 20  # omni serve's default --max-body-bytes
SLOWLORIS = 32  # of each kind
CLIENTS = 4
GRACE_S = 2.0


def _p99(xs: list[float]) -> float:
    q = statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]
    return round(q, 1)


def _sample_health(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t = time.perf_counter()
            c.get(f"{url}/health")
            out.append((time.perf_counter() - t) * 1000)
            stop.wait(0.01)


def _big_bodies() -> list[tuple[str, bytes]]:
    chat = {"messages": [{"role": "user", "content": ""}], "max_tokens": "10"}
    chat["messages"][0]["content"] = "a" * (LIMIT - len(json.dumps(chat)) - 64)
    numbers: dict[str, Any] = {"prompt": "x", "max_tokens": "10", "stop": [1.5] * 99_000}
    numbers["user"] = "u" * (LIMIT - len(json.dumps(numbers)) - 64)
    valid = {**chat, "max_tokens": 10}  # parsed, refused by its characters (never tokenized)
    return [
        ("/v1/chat/completions", json.dumps(chat).encode()),
        ("/v1/completions", json.dumps(numbers).encode()),
        ("/v1/chat/completions", json.dumps(valid).encode()),
    ]


def health_during_big_bodies(url: str, headers: dict[str, str]) -> dict[str, Any]:
    idle: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_health, args=(url, stop, idle))
    sampler.start()
    time.sleep(2.0)
    stop.set()
    sampler.join()
    during: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_health, args=(url, stop, during))
    statuses = []
    bodies = _big_bodies()
    sampler.start()
    try:
        json_headers = {**headers, "Content-Type": "application/json"}
        with httpx.Client(timeout=120, headers=json_headers) as c:
            for _ in range(3):
                for path, raw in bodies:
                    r = c.post(f"{url}{path}", content=raw)
                    statuses.append(r.status_code)
    finally:
        stop.set()
        sampler.join()
    return {
        "health_p99_ms_idle": _p99(idle),
        "health_p99_ms_during_big_body": _p99(during),
        "health_max_ms_during_big_body": round(max(during), 1),
        "big_body_bytes": max(len(raw) for _, raw in bodies),
        "big_body_statuses": sorted(set(statuses)),
    }


def _slow(address: tuple[str, int], head: bytes, dribble: bytes, give_up_s: float) -> float:
    """Seconds the server kept a connection open that sends ``head``, then a byte of
    ``dribble`` a second (``give_up_s``: still open then)."""
    t0 = time.monotonic()
    try:
        s = socket.create_connection(address, timeout=10)
    except OSError:
        return 0.0
    with s:
        try:
            s.sendall(head)
            s.settimeout(1.0)
            i = 0
            while time.monotonic() - t0 < give_up_s:
                try:
                    if not s.recv(4096):  # closed (after a 408, or at once)
                        break
                except TimeoutError:
                    pass
                s.sendall(dribble[i % len(dribble) : i % len(dribble) + 1])
                i += 1
        except OSError:  # reset by the server
            pass
    return time.monotonic() - t0


class _Clients:
    """``CLIENTS`` threads sending short chats until stopped: answers and lost ones."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url, self.headers = url, headers
        self.ok = self.refused = self.lost = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run) for _ in range(CLIENTS)]

    def _run(self) -> None:
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        with httpx.Client(timeout=60, headers=self.headers) as c:
            while not self.stop.is_set():
                try:
                    r = c.post(f"{self.url}/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    with self.lock:
                        self.lost += 1
                    continue
                with self.lock:
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.refused += 1

    def run_for(self, seconds: float) -> float:
        """Answered requests per second over ``seconds``."""
        for t in self.threads:
            t.start()
        time.sleep(seconds)
        self.stop.set()
        for t in self.threads:
            t.join()
        return self.ok / seconds


ATTACKER = "from omni_bench.attack_server import attacker_main; attacker_main()"


def attacker_main() -> None:
    """The attacker's process: the spec on stdin, (seconds open, deadline) pairs out."""
    spec = json.load(sys.stdin)
    heads = [(bytes.fromhex(h), bytes.fromhex(d), t) for h, d, t in spec["heads"]]
    json.dump(_slowloris_all(tuple(spec["address"]), heads), sys.stdout)


def _slowloris_all(
    address: tuple[str, int], heads: list[tuple[bytes, bytes, float]]
) -> list[tuple[float, float]]:
    """(In a process of its own, as an attacker elsewhere would be: its threads take
    no time from the normal clients'.) ``SLOWLORIS`` connections of each head: (seconds
    each was open, its deadline)."""
    held: list[tuple[float, float]] = []
    lock = threading.Lock()

    def one(head: bytes, dribble: bytes, deadline: float) -> None:
        open_s = _slow(address, head, dribble, deadline + GRACE_S + 5)
        with lock:
            held.append((open_s, deadline))

    threads = [threading.Thread(target=one, args=h) for h in heads for _ in range(SLOWLORIS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return held


def slowloris(
    url: str,
    headers: dict[str, str],
    header_timeout_s: float,
    body_timeout_s: float,
    measure_s: float = 10.0,
) -> dict[str, Any]:
    u = urlsplit(url)
    address = (u.hostname or "127.0.0.1", u.port or 80)
    host = f"Host: {u.hostname}\r\n".encode()
    auth = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
    heads = [
        (b"GET /health HTTP/1.1\r\n" + host, b"X-a: b\r\n", header_timeout_s),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            + host
            + auth
            + b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n",
            b" ",
            body_timeout_s,
        ),
    ]
    baseline = _Clients(url, headers)
    base_rps = baseline.run_for(measure_s)
    spec = {"address": address, "heads": [[h.hex(), d.hex(), t] for h, d, t in heads]}
    attacker = subprocess.Popen(
        [sys.executable, "-c", ATTACKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert attacker.stdin is not None
    attacker.stdin.write(json.dumps(spec))
    attacker.stdin.close()
    time.sleep(2.0)  # started, connected and dribbling
    during = _Clients(url, headers)
    attack_rps = during.run_for(measure_s)
    assert attacker.stdout is not None
    out = attacker.stdout.read()  # (the spec holds the key: on stdin, not the command line)
    attacker.wait(timeout=60)
    if attacker.returncode != 0:
        raise RuntimeError(f"the slow-loris attacker failed (exit {attacker.returncode})")
    held = [tuple(x) for x in json.loads(out)]
    return {
        "slowloris": len(held),
        "slowloris_closed": sum(1 for s, d in held if s < d + GRACE_S + 5),
        "slowloris_max_open_s": round(max(s for s, _ in held), 1),
        "slowloris_open_past_deadline": sum(1 for s, d in held if s > d + GRACE_S),
        "rps_without_attack": round(base_rps, 2),
        "rps_during_slowloris": round(attack_rps, 2),
        "served_ratio": round(attack_rps / base_rps, 3) if base_rps else 0.0,
        "refused": baseline.refused + during.refused,
        "lost": baseline.lost + during.lost,
    }


def run_server_attacks(
    base_url: str,
    api_key: str | None,
    header_timeout_s: float = 10.0,
    body_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """The attacks against ``omni serve`` at ``base_url`` (whose ``--header-timeout`` and
    ``--body-timeout`` are the given ones, its defaults by default): a flat dict of the
    figures (about ``body_timeout_s`` + 30 s)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out: dict[str, Any] = {}
    out.update(health_during_big_bodies(base_url, headers))
    out.update(slowloris(base_url, headers, header_timeout_s, body_timeout_s))
    return out
