"""One client cannot stall the server: a 20 MiB body is parsed off the event loop (while
/health answers), a body of too many JSON values is refused unparsed, slow-loris heads
and bodies are closed at their deadlines, a head over the limit is a 431, past
``--max-connections`` a request is a 503, and OpenAI's types are strict."""

from __future__ import annotations

import json
import logging
import socket
import statistics
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from omni_testing.configs import chain

from .conftest import OMNI, start_server, stop_server

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


# ---- the server-wide body budget, the open file limit, a big bad body ----


def body_bytes_in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    (line,) = [x for x in text.splitlines() if x.startswith("omni_http_body_bytes_in_flight ")]
    return float(line.split()[1])


def wait_for_body_bytes(url: str, n: int) -> None:
    end = time.monotonic() + 10
    while body_bytes_in_flight(url) != n:
        assert time.monotonic() < end, body_bytes_in_flight(url)
        time.sleep(0.05)


def sized_body(n: int) -> bytes:
    raw = json.dumps({"prompt": "x", "user": ""}).encode()
    out = raw.replace(b'"user": ""', b'"user": "' + b"u" * (n - len(raw)) + b'"')
    assert len(out) == n
    return out


def test_bodies_held_at_once_are_bounded_server_wide(tmp_path):
    cfg = chain(("source", "synthetic.source", {"tokens": 4}), name="budget")
    s = start_server(
        cfg,
        tmp_path,
        *("--max-body-bytes", "200000", "--max-body-bytes-in-flight", "300000"),
        *("--body-timeout", "60"),
    )
    try:
        url = f"{s.url}/v1/completions"
        headers = {"Content-Type": "application/json"}
        held = socket.create_connection(address(s.url), timeout=30)
        held.sendall(  # a body of 200000 bytes announced, none sent: taken before reading
            b"POST /v1/completions HTTP/1.1\r\nHost: " + address(s.url)[0].encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 200000\r\n\r\n{"
        )
        wait_for_body_bytes(s.url, 200_000)
        # at the limit: read and parsed (then refused: this pipeline has no text endpoint)
        r = httpx.post(url, content=sized_body(100_000), headers=headers, timeout=30)
        assert r.status_code == 404, r.text
        for body in (sized_body(100_001), iter([sized_body(100_001)])):  # sized, chunked
            r = httpx.post(url, content=body, headers=headers, timeout=30)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert "--max-body-bytes-in-flight" in err["message"] and err["code"] == "server_busy"
        assert body_bytes_in_flight(s.url) == 200_000  # a refusal holds nothing
        held.close()
        wait_for_body_bytes(s.url, 0)
        r = httpx.post(url, content=sized_body(100_001), headers=headers, timeout=30)
        assert r.status_code == 404, r.text
        assert "Traceback" not in s.log()
    finally:
        stop_server(s)


def test_the_budget_cannot_be_below_one_body():
    from omni_serve import ServeSettings
    from omni_serve.settings import SettingsError

    assert ServeSettings(model_name="m").max_body_bytes_in_flight == 4 * (20 << 20)
    with pytest.raises(SettingsError, match="--max-body-bytes-in-flight"):
        ServeSettings(model_name="m", max_body_bytes=1000, max_body_bytes_in_flight=999)


def test_a_big_bad_body_is_parsed_once_and_named_by_position(monkeypatch):
    from omni_serve import body as body_module
    from omni_serve.body import INLINE_BYTES, parse_json
    from omni_serve.errors import APIError

    def no_second_parse(*args, **kw):
        raise AssertionError("a big body was parsed twice")

    raw = b'{"a": "' + b"\\u00e9" * (INLINE_BYTES // 6 + 10) + b'", "b": NaN}'
    monkeypatch.setattr(body_module.json, "loads", no_second_parse)
    with pytest.raises(APIError) as e:
        parse_json(raw)
    assert e.value.status == 400 and f"(byte {len(raw) - 4})" in e.value.message, e.value.message
    monkeypatch.undo()
    with pytest.raises(APIError) as e:  # a small body still names the field
        parse_json(b'{"a": [1, NaN]}')
    assert e.value.param == "a[1]" and "not a finite number" in e.value.message


def test_the_open_file_limit_is_raised_at_start():
    code = (
        "import resource\n"
        "from omni_serve.connections import raise_fd_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "got = raise_fd_limit()\n"
        "assert got == resource.getrlimit(resource.RLIMIT_NOFILE)[0], got\n"
        "assert got > 64 and (got == hard or hard == resource.RLIM_INFINITY), (got, hard)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_max_connections_fits_the_open_file_limit(caplog):
    from omni_serve.connections import FD_RESERVE, connection_cap

    with caplog.at_level(logging.WARNING, logger="omni.serve"):
        assert connection_cap(None, 1024, 1024) == 1024 - FD_RESERVE  # the default: lowered
    assert "lowered from 1024" in caplog.text and "1024" in caplog.text
    assert connection_cap(None, 1024, 1 << 20) == 1024
    assert connection_cap(500, 1024, 1024) == 500
    with pytest.raises(ValueError, match="--max-connections 1000 .* open file limit of 1024"):
        connection_cap(1000, 1024, 1024)


def test_max_connections_over_the_hard_fd_limit_is_refused_at_start(tmp_path):
    import resource

    cfg = tmp_path / "p.yaml"
    cfg.write_text("name: p\nstages: [{name: s, kind: synthetic.source}]\n")

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))

    r = subprocess.run(
        [sys.executable, "-c", OMNI, "serve", str(cfg), "--port", "0"]
        + ["--max-connections", "1000"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=low_limit,
    )
    assert r.returncode == 2, r.stderr
    assert "--max-connections 1000" in r.stderr and "open file limit of 512" in r.stderr
    assert "Traceback" not in r.stderr
