"""/health tells the truth about stages (a killed stage is never healthy), the API key
guards every endpoint but /health, and ``omni serve``'s own errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from omni_testing.configs import chain
from prometheus_client.parser import text_string_to_metric_families

from .conftest import OMNI, start_server, stop_server


def synthetic(**top):
    return chain(
        ("source", "synthetic.source", {"tokens": 8}, {"max_restarts": 1, "restart_backoff_s": 1}),
        ("map", "synthetic.map", {}, {"max_restarts": 0}),
        name="synthetic",
        heartbeat_interval_s=0.1,
        **top,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(synthetic(), tmp_path_factory.mktemp("synthetic"))
    yield s
    stop_server(s)


def wait_health(server, status: int, timeout_s: float = 15.0) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        r = server.health()
        if r.status_code == status or time.monotonic() > end:
            assert r.status_code == status, r.text
            return r.json()
        time.sleep(0.05)


def test_killed_stage_is_unhealthy_while_restarting_and_when_dead(server):
    body = wait_health(server, 200)
    assert {s["state"] for s in body["stages"].values()} == {"ready"}
    os.kill(body["stages"]["source"]["pid"], signal.SIGKILL)
    body = wait_health(server, 503)  # restarting (back-off 1 s) is not healthy
    assert body["status"] == "unhealthy"
    assert body["stages"]["source"]["state"] in ("restarting", "starting")
    body = wait_health(server, 200)  # restarted
    assert body["stages"]["source"]["restarts"] == 1
    os.kill(body["stages"]["map"]["pid"], signal.SIGKILL)  # max_restarts 0: dead
    body = wait_health(server, 503)
    assert body["stages"]["map"]["state"] == "dead"
    time.sleep(1.5)
    assert server.health().status_code == 503  # and stays so
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("omni_stage_up", (("stage", "map"),))] == 0
    assert samples[("omni_stage_state", (("stage", "map"), ("state", "dead")))] == 1
    assert samples[("omni_stage_restarts_total", (("stage", "source"),))] == 1
    # a pipeline with no AR or DiT stages has no OpenAI endpoint; the server says so
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 404 and "does not serve" in r.json()["error"]["message"]


def test_api_key_guards_everything_but_health(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_API_KEY", "s3cret")  # the environment variable form
    s = start_server(synthetic(), tmp_path)
    try:
        assert "listening on http://127.0.0.1:" in s.log()  # the safe default bind
        good = {"Authorization": "Bearer s3cret"}
        assert s.health().status_code == 200
        for path in ("/metrics", "/v1/models", "/v1/omni/stats"):
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
                r = httpx.get(f"{s.url}{path}", headers=headers, timeout=10)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(f"{s.url}{path}", headers=good, timeout=10).status_code == 200
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": []}, timeout=10)
        assert r.status_code == 401
        # the page is static HTML with no data; what it fetches needs the key
        assert httpx.get(f"{s.url}/", timeout=10).status_code == 200
    finally:
        stop_server(s)


def test_serve_refuses_an_inline_pipeline_and_a_bad_config(tmp_path):
    cfg = tmp_path / "inline.yaml"
    cfg.write_text("stages: [{name: s, kind: synthetic.source}]\nmrs: {enabled: false}\n")
    r = subprocess.run(
        [sys.executable, "-c", OMNI, "serve", str(cfg)], capture_output=True, text=True
    )
    assert r.returncode == 2 and "mrs.enabled: true" in r.stderr
    cfg.write_text("stages: [{name: s, kind: no.such}]\n")
    r = subprocess.run(
        [sys.executable, "-c", OMNI, "serve", str(cfg)], capture_output=True, text=True
    )
    assert r.returncode == 2 and "no.such" in r.stderr and "Traceback" not in r.stderr


def test_health_is_degraded_200_while_one_replica_serves_and_503_when_none(tmp_path):
    cfg = chain(
        ("source", "synthetic.source", {"tokens": 4}),
        ("map", "synthetic.map", {}, {"replicas": 2, "max_restarts": 0}),
        name="replicated",
        heartbeat_interval_s=0.1,
    )
    server = start_server(cfg, tmp_path)
    try:
        body = wait_health(server, 200)
        assert body["status"] == "ok" and sorted(body["stages"]) == ["map#0", "map#1", "source"]
        assert body["stages_summary"]["map"] == {"state": "ok", "replicas": 2, "serving": 2}
        os.kill(body["stages"]["map#1"]["pid"], signal.SIGKILL)  # dead for good
        end = time.monotonic() + 15
        while server.health().json()["status"] != "degraded" and time.monotonic() < end:
            time.sleep(0.05)
        r = server.health()
        assert r.status_code == 200 and r.json()["status"] == "degraded"
        assert r.json()["stages"]["map#1"]["state"] == "dead"
        assert r.json()["stages_summary"]["map"] == {
            "state": "degraded",
            "replicas": 2,
            "serving": 1,
        }
        os.kill(r.json()["stages"]["map#0"]["pid"], signal.SIGKILL)
        body = wait_health(server, 503)
        assert body["status"] == "unhealthy" and body["stages_summary"]["map"]["state"] == "failed"
    finally:
        stop_server(server)
