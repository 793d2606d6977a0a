"""One client cannot stall the server: a 20 MiB body is parsed off the event loop (while
/health answers), a body of too many JSON values is refused unparsed, slow-loris heads
and bodies are closed at their deadlines, a head over the limit is a 431, past
``--max-connections`` a request is a 503, and OpenAI's types are strict."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from omni_testing.configs import chain

from .conftest import start_server, stop_server

DEADLINE_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = chain(("source", "synthetic.source", {"tokens": 4}), name="limits")
    s = start_server(
        cfg,
        tmp_path_factory.mktemp("limits"),
        "--header-timeout",
        str(DEADLINE_S),
        "--body-timeout",
        str(DEADLINE_S),
        "--max-header-bytes",
        "8192",
    )
    yield s
    stop_server(s)


def address(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or 80


def health_latencies_ms(url: str, stop: threading.Event) -> list[float]:
    out = []
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            t = time.perf_counter()
            assert c.get(f"{url}/health").status_code == 200
            out.append((time.perf_counter() - t) * 1000)
            stop.wait(0.01)
    return out


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]


@pytest.mark.parametrize(
    "shape",
    ["string", "numbers"],  # a chat of one 20 MiB string; ~99k numbers in 20 MiB
)
def test_health_answers_while_a_20_mib_body_is_parsed(server, shape):
    limit = 20 << 20
    if shape == "string":
        body = {"messages": [{"role": "user", "content": "a" * (limit - 200)}]}
    else:
        pad = " " * 200
        body = {"prompt": "x", "stop": [1.5] * 99_000}
        body["user"] = "u" * (limit - len(json.dumps(body)) - len(pad) - 20)
    raw = json.dumps(body).encode()
    assert len(raw) <= limit
    stop = threading.Event()
    results: list[list[float]] = []
    sampler = threading.Thread(target=lambda: results.append(health_latencies_ms(server.url, stop)))
    sampler.start()
    try:
        time.sleep(0.3)
        for _ in range(3):
            r = httpx.post(
                f"{server.url}/v1/chat/completions"
                if shape == "string"
                else f"{server.url}/v1/completions",
                content=raw,
                headers={"Content-Type": "application/json"},
                timeout=60,
            )
            # parsed and checked in full; then refused: this pipeline has no text endpoint
            # (the numbers are refused by the model first: stop holds strings)
            assert r.status_code in (400, 404), r.text
        time.sleep(0.3)
    finally:
        stop.set()
        sampler.join()
    latencies = results[0]
    # the bench asks <= 50 ms on a quiet machine; tests run on noisy shared ones
    assert p99(latencies) < 250, sorted(latencies)[-5:]


def test_a_body_of_too_many_values_is_refused_before_parsing(server):
    raw = b"[" + b"0," * 200_000 + b"0]"
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and "JSON values" in r.json()["error"]["message"], r.text


def slow_connection(url: str, head: bytes) -> tuple[socket.socket, float]:
    s = socket.create_connection(address(url), timeout=30)
    s.sendall(head)
    return s, time.monotonic()


def open_for_s(s: socket.socket, t0: float, dribble: bytes) -> tuple[float, bytes]:
    """How long the server keeps ``s`` open while a byte of ``dribble`` goes every 0.2 s,
    and what it answered."""
    got = b""
    s.settimeout(0.2)
    for i in range(200):
        try:
            s.sendall(dribble[i % len(dribble) : i % len(dribble) + 1])
        except OSError:
            break
        try:
            chunk = s.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    s.close()
    return time.monotonic() - t0, got


@pytest.mark.parametrize("part", ["headers", "body"])
def test_slow_loris_connections_are_closed_at_the_deadline(server, part):
    host = address(server.url)[0]
    if part == "headers":
        head = b"GET /health HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
        dribble = b"X-a: b\r\n"
    else:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        )
        dribble = b" "
    conns = [slow_connection(server.url, head) for _ in range(8)]
    results: list[tuple[float, bytes]] = []
    threads = [
        threading.Thread(target=lambda c=c: results.append(open_for_s(*c, dribble))) for c in conns
    ]
    for t in threads:
        t.start()
    # meanwhile the server serves others
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    for t in threads:
        t.join()
    assert len(results) == 8
    for held_s, answer in results:
        assert DEADLINE_S - 0.5 < held_s < DEADLINE_S + 2.0, results
        if part == "headers":
            assert answer.startswith(b"HTTP/1.1 408"), answer


def test_a_head_over_the_limit_is_431(server):
    r = httpx.get(f"{server.url}/health", headers={"X-Big": "a" * 20_000}, timeout=10)
    assert r.status_code == 431
    # sent a byte at a time, never complete: refused as soon as it is over the limit
    s = socket.create_connection(address(server.url), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 10_000)
    assert s.recv(100).startswith(b"HTTP/1.1 431")
    s.close()
    assert server.health().status_code == 200


def test_max_connections_answers_503(tmp_path):
    cfg = chain(("source", "synthetic.source", {"tokens": 4}), name="few")
    s = start_server(cfg, tmp_path, "--max-connections", "4")
    try:
        host = address(s.url)[0].encode()
        held = [socket.create_connection(address(s.url), timeout=10) for _ in range(4)]
        for h in held:  # open connections, heads unfinished
            h.sendall(b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\n")
        r = httpx.get(f"{s.url}/health", timeout=10)
        assert r.status_code == 503, r.text
        for h in held:
            h.close()
        end = time.monotonic() + 10
        while httpx.get(f"{s.url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < end
            time.sleep(0.05)
    finally:
        stop_server(s)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "10"),
        ("temperature", "0.5"),
        ("seed", 1.0),
        ("stream", 1),
        ("stream", "true"),
        ("logprobs", "1"),
    ],
)
def test_openai_types_are_strict(server, field, value):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", field: value}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"field '{field}'" in err["message"], err


def test_an_int_is_still_a_float(server):
    # temperature 1 (an int) is a float as OpenAI takes it: checked, then the pipeline
    # (with no text endpoint) is what refuses it
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "x", "temperature": 1}, timeout=10
    )
    assert r.status_code == 404, r.text
