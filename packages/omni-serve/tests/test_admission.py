"""Admission and timeouts against a real ``omni serve``: past ``--max-queued-requests``
a request is a 429 with ``Retry-After`` (and admission recovers), and a body's
``timeout_s`` lowers the request's timeout."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .conftest import intake_then, slow, start_server, stop_server

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """intake -> a stage holding each request 2 s; one open request at most."""
    s = start_server(
        intake_then("admission", tiny_llama, slow(2.0)),
        tmp_path_factory.mktemp("admission"),
        *("--max-queued-requests", "1"),
    )
    yield s
    stop_server(s)


def in_flight(server) -> int:
    return httpx.get(f"{server.url}/v1/omni/stats", timeout=10).json()["in_flight"]


def test_past_max_queued_requests_is_a_429_with_retry_after(server):
    url = f"{server.url}/v1/completions"
    first: dict[str, httpx.Response] = {}
    t = threading.Thread(
        target=lambda: first.setdefault("r", httpx.post(url, json={"prompt": "a"}, timeout=60))
    )
    t.start()
    end = time.monotonic() + 20
    while in_flight(server) < 1:
        assert time.monotonic() < end, "the first request never got in flight"
        time.sleep(0.02)
    for stream in (False, True):
        r = httpx.post(url, json={"prompt": "b", "stream": stream}, timeout=30)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "overloaded" and err["request_id"] == r.headers["x-request-id"]
    t.join(60)
    assert first["r"].status_code == 200, first["r"].text  # the admitted one completes
    r = httpx.post(url, json={"prompt": "c"}, timeout=60)  # and admission recovers
    assert r.status_code == 200, r.text


def test_a_body_timeout_lowers_the_timeout(server):
    t0 = time.monotonic()
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "x", "timeout_s": 0.3}, timeout=30
    )
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert time.monotonic() - t0 < 1.9  # the stage alone holds 2 s
