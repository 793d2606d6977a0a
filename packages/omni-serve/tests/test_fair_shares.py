"""Fair shares per client against a real ``omni serve --api-keys-file``: a key at its
``max_inflight``, ``max_queued`` or ``max_connections`` gets a 429 with ``Retry-After``
naming the limit while another key's requests go through; an address holding
``--max-connections-per-address`` connections without a key is refused the next one
while another address connects; a priority better than a key's ``best_priority`` is a
400; the metrics are labelled by key name, and no key reaches the metrics or the log."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from .conftest import intake_then, slow, start_server, stop_server

pytest.importorskip("transformers")

HOLD_S = 1.5  # the stage holds each request this long
PER_ADDRESS = 4
KEYS = {name: f"{name}-{'k' * 40}" for name in ("a", "b", "c", "m", "h")}
HELD_S = 2.0  # key h's refusal_delay_s
KEYS_FILE = f"""
[[keys]]
name = "a"
key = "{KEYS["a"]}"
max_inflight = 2
max_connections = 3
best_priority = -5

[[keys]]
name = "b"
key = "{KEYS["b"]}"

[[keys]]
name = "c"
key = "{KEYS["c"]}"
max_queued = 2

[[keys]]
name = "m"
key = "{KEYS["m"]}"

[[keys]]
name = "h"
key = "{KEYS["h"]}"
max_inflight = 1
refusal_delay_s = {HELD_S}
"""
COMPLETIONS = "/v1/completions"
PRIORITY = {"mrs": {"defaults": {"scheduler_policy": "priority"}}, "heartbeat_interval_s": 0.05}


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    where = tmp_path_factory.mktemp("fair-shares")
    keys = where / "keys.toml"
    keys.write_text(KEYS_FILE)
    keys.chmod(0o600)
    config = {**intake_then("shares", tiny_llama, slow(HOLD_S)), **PRIORITY}
    s = start_server(
        config,
        where,
        *("--api-keys-file", str(keys)),
        *("--max-connections-per-address", str(PER_ADDRESS)),
        *("--keep-alive-timeout", "60"),
    )
    yield s
    stop_server(s)


def metrics(server) -> str:
    r = httpx.get(f"{server.url}/metrics", headers=auth("m"), timeout=10)
    assert r.status_code == 200, r.text
    return r.text


def sample(text: str, name: str, **labels: str) -> float:
    """The value of ``name{labels}`` in a scrape (0 where absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.02)


class Background:
    """Requests posted each from its own thread."""

    def __init__(self) -> None:
        self.answers: list[httpx.Response] = []
        self.threads: list[threading.Thread] = []

    def post(self, url: str, headers: dict[str, str], body: dict[str, Any]) -> None:
        def run() -> None:
            self.answers.append(httpx.post(url, json=body, headers=headers, timeout=60))

        t = threading.Thread(target=run)
        t.start()
        self.threads.append(t)

    def join(self) -> list[httpx.Response]:
        for t in self.threads:
            t.join(60)
        return self.answers


def refused(r: httpx.Response, limit: str) -> None:
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    assert limit in err["message"]
    assert err["request_id"] == r.headers["x-request-id"]


def test_a_key_at_its_max_inflight_gets_429_while_another_key_goes_through(server):
    url = f"{server.url}{COMPLETIONS}"
    held = Background()
    for _ in range(2):  # at the limit: both go
        held.post(url, auth("a"), {"prompt": "a"})
    wait_for(
        lambda: sample(metrics(server), "omni_http_key_inflight", key="a") == 2,
        "key a never had 2 requests in flight",
    )
    for stream in (False, True):  # one past
        r = httpx.post(url, json={"prompt": "x", "stream": stream}, headers=auth("a"), timeout=30)
        refused(r, "max_inflight")
        # the connection stays open (only a key over its max_connections is closed)
        assert r.headers.get("connection", "").lower() != "close"
    other = httpx.post(url, json={"prompt": "b"}, headers=auth("b"), timeout=60)
    assert other.status_code == 200, other.text
    assert all(r.status_code == 200 for r in held.join())
    r = httpx.post(url, json={"prompt": "a"}, headers=auth("a"), timeout=60)
    assert r.status_code == 200, r.text  # its share is back
    text = metrics(server)
    assert sample(text, "omni_http_refusals_total", key="a", reason="inflight") == 2
    assert sample(text, "omni_http_key_requests_total", key="a") >= 5
    assert sample(text, "omni_http_key_requests_total", key="b") >= 1
    assert sample(text, "omni_http_key_inflight", key="a") == 0
    for key in KEYS.values():
        assert key not in text and key not in server.log()
    assert "refused a request of key 'a'" in server.log()


def test_a_key_at_its_max_queued_gets_429(server):
    url = f"{server.url}{COMPLETIONS}"
    held = Background()
    for _ in range(2):
        held.post(url, auth("c"), {"prompt": "c"})
    wait_for(
        lambda: sample(metrics(server), "omni_http_key_queued", key="c") == 2,
        "key c never had 2 pipeline requests open",
    )
    for stream in (False, True):
        sent = time.monotonic()
        r = httpx.post(url, json={"prompt": "x", "stream": stream}, headers=auth("c"), timeout=30)
        refused(r, "max_queued")
        assert time.monotonic() - sent >= 1.0  # held for the default refusal_delay_s
    other = httpx.post(url, json={"prompt": "b"}, headers=auth("b"), timeout=60)
    assert other.status_code == 200, other.text
    assert all(r.status_code == 200 for r in held.join())
    text = metrics(server)
    assert sample(text, "omni_http_refusals_total", key="c", reason="queued") == 2
    assert sample(text, "omni_http_key_queued", key="c") == 0


def test_a_keys_refusal_is_held_for_its_delay_while_other_keys_are_answered(server):
    url = f"{server.url}{COMPLETIONS}"
    served, held = Background(), Background()
    served.post(url, auth("h"), {"prompt": "h"})  # at its max_inflight of 1
    wait_for(
        lambda: sample(metrics(server), "omni_http_key_inflight", key="h") == 1,
        "key h never had its request in flight",
    )
    sent = time.monotonic()
    held.post(url, auth("h"), {"prompt": "x"})  # one past: refused, and held
    wait_for(
        lambda: sample(metrics(server), "omni_http_key_held_refusals", key="h") == 1,
        "key h's refusal was never held",
    )
    other = httpx.get(f"{server.url}/v1/models", headers=auth("b"), timeout=10)
    assert other.status_code == 200, other.text
    # (b was answered while h's 429 was still held)
    assert sample(metrics(server), "omni_http_key_held_refusals", key="h") == 1
    (r,) = held.join()
    refused(r, "max_inflight")
    assert time.monotonic() - sent >= HELD_S
    assert sample(metrics(server), "omni_http_key_held_refusals", key="h") == 0
    assert all(r.status_code == 200 for r in served.join())


def test_a_key_at_its_max_connections_gets_429_and_the_connection_closed(server):
    wait_for(
        lambda: sample(metrics(server), "omni_http_key_connections", key="a") == 0,
        "key a's earlier connections stayed open",
    )
    clients = [httpx.Client(base_url=server.url, headers=auth("a"), timeout=10) for _ in range(4)]
    try:
        for c in clients[:3]:  # at the limit: three kept-alive connections
            assert c.get("/v1/models").status_code == 200
        r = clients[3].get("/v1/models")  # one past
        refused(r, "max_connections")
        assert r.headers["connection"] == "close"
        assert httpx.get(f"{server.url}/v1/models", headers=auth("b")).status_code == 200
        for c in clients[:3]:  # the kept-alive ones still serve
            assert c.get("/v1/models").status_code == 200
        clients[0].close()
        wait_for(
            lambda: sample(metrics(server), "omni_http_key_connections", key="a") == 2,
            "a closed connection was still counted",
        )
        assert clients[3].get("/v1/models").status_code == 200
    finally:
        for c in clients:
            c.close()
    assert sample(metrics(server), "omni_http_refusals_total", key="a", reason="connections") == 1


def connect(server, source: str) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    s = socket.socket()
    s.settimeout(10)
    s.bind((source, 0))
    s.connect((host, int(port)))
    return s


def test_an_address_holding_its_cap_of_idle_connections_is_refused_others_connect(server):
    idle = [connect(server, "127.0.0.5") for _ in range(PER_ADDRESS)]  # at the cap
    try:
        idle[-1].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert idle[-1].recv(4096).startswith(b"HTTP/1.1 200")  # the last one was taken
        extra = connect(server, "127.0.0.5")  # one past
        answer = b""
        while chunk := extra.recv(4096):
            answer += chunk
        extra.close()
        assert answer.startswith(b"HTTP/1.1 429")
        assert b"retry-after: 1" in answer and b"--max-connections-per-address" in answer
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.6"))
        with other:
            r = other.get(f"{server.url}/v1/models", headers=auth("b"), timeout=10)
            assert r.status_code == 200, r.text
    finally:
        for s in idle:
            s.close()
    again = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.5"))
    with again:  # the address's connections closed: it connects again
        wait_for(lambda: again.get(f"{server.url}/health").status_code == 200, "no room")
    text = metrics(server)
    assert sample(text, "omni_http_refusals_total", key="", reason="address_connections") >= 1


def test_a_priority_better_than_the_keys_best_is_a_400(server):
    url = f"{server.url}{COMPLETIONS}"
    ok = httpx.post(url, json={"prompt": "p", "priority": -5}, headers=auth("a"), timeout=60)
    assert ok.status_code == 200, ok.text  # at a's best
    for name, priority, best in (("a", -6, -5), ("b", -1, 0)):
        r = httpx.post(url, json={"prompt": "p", "priority": priority}, headers=auth(name))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "priority"
        assert f"key {name!r} may ask for: its best_priority is {best}" in err["message"]
    r = httpx.post(url, json={"prompt": "p", "priority": 3}, headers=auth("b"), timeout=60)
    assert r.status_code == 200, r.text  # worse than the best is always fine
    text = metrics(server)
    assert sample(text, "omni_http_refusals_total", key="a", reason="priority") == 1


def test_a_wrong_key_is_still_a_401_and_health_says_the_status_alone(server):
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert set(httpx.get(f"{server.url}/health").json()) == {"status"}
    assert "stages" in httpx.get(f"{server.url}/health", headers=auth("c")).json()
