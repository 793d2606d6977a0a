"""The ``priority`` body field (vLLM's extra field) against real ``omni serve``s: passed on
to the pipeline, where a busy stage serves the waiting requests of each endpoint by
(priority, arrival); a 400 naming the field when it is not a 64-bit integer, or not 0 on
a pipeline that schedules first come, first served (as vLLM's server refuses it without
priority scheduling); the requests in flight meanwhile are untouched."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from omni_core.errors import UserInputError
from omni_core.scheduling import PRIORITY_KEY
from omni_serve.openai_api import ImageRequest, image_requests, parse
from omni_testing.faults import wait_for

from .conftest import Server, intake_then, mixed_config, slow, start_server, stop_server
from .test_app_inprocess import FakePipe, client_of

pytest.importorskip("transformers")

CHAT, COMPLETIONS, IMAGES = "/v1/chat/completions", "/v1/completions", "/v1/images/generations"
PRIORITY = {"mrs": {"defaults": {"scheduler_policy": "priority"}}, "heartbeat_interval_s": 0.05}
# the priority text server's stage holds each request until its gate file exists, then
# this long (the requests are answered one at a time, in the order they were served)
HOLD_S = 0.3
# not 64-bit integers: each a 400 naming the field, whatever the pipeline's policy
NOT_INT64 = [2**63, -(2**63) - 1, True, 1.5, "1", None]
FCFS_REFUSES = "this pipeline schedules first come, first served"


def body(path: str, **fields: Any) -> dict[str, Any]:
    """The smallest body of ``path``, with ``fields``."""
    if path == CHAT:
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    if path == IMAGES:
        return {"prompt": "a cat", "max_tokens": 2, "preview_every": 0, **fields}
    return {"prompt": "hi", "max_tokens": 2, **fields}


@pytest.fixture(scope="module")
def text_priority(tiny_llama, tmp_path_factory):
    """intake -> a stage holding each request until the gate file exists, then HOLD_S,
    every stage under priority; the server and the gate."""
    where = tmp_path_factory.mktemp("text-priority")
    stage = slow(HOLD_S)
    gate = where / "release"
    stage["options"]["until_file"] = str(gate)
    s = start_server({**intake_then("text_priority", tiny_llama, stage), **PRIORITY}, where)
    yield s, gate
    stop_server(s)


@pytest.fixture(scope="module")
def text_fcfs(tiny_llama, tmp_path_factory):
    """intake -> a stage holding each request 1 s, first come, first served."""
    config = intake_then("text_fcfs", tiny_llama, slow(1.0))
    s = start_server({**config, "heartbeat_interval_s": 0.05}, tmp_path_factory.mktemp("fcfs"))
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def image_priority(tiny_llama, tiny_dit, tmp_path_factory):
    """The mixed pipeline on tiny models, every stage under priority."""
    config = mixed_config("image_priority", tiny_llama, tiny_dit, **PRIORITY)
    s = start_server(config, tmp_path_factory.mktemp("image-priority"))
    yield s
    stop_server(s)


class Posts:
    """Requests posted each from its own thread; ``order``: the names in the order their
    answers came."""

    def __init__(self, server: Server) -> None:
        self.url = server.url
        self.answers: dict[str, httpx.Response] = {}
        self.order: list[str] = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def post(self, name: str, path: str, json: dict[str, Any]) -> None:
        def run() -> None:
            r = httpx.post(f"{self.url}{path}", json=json, timeout=120)
            with self.lock:
                self.answers[name] = r
                self.order.append(name)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> dict[str, httpx.Response]:
        for t in self.threads:
            t.join(120)
        assert len(self.answers) == len(self.threads), "a request got no answer"
        return self.answers


def stage_stats(server: Server, stage: str) -> dict[str, Any]:
    rows = httpx.get(f"{server.url}/v1/omni/stats", timeout=10).json()["stages"]
    return next(r for r in rows if r["name"] == stage)


def refused(server: Server, path: str, priority: Any, why: str = "") -> None:
    """``priority`` is a 400 on ``path`` naming the field (and saying ``why``), streamed
    or not."""
    for stream in (False, True):
        json = body(path, priority=priority, stream=stream)
        r = httpx.post(f"{server.url}{path}", json=json, timeout=30)
        assert r.status_code == 400, (priority, stream, r.text)
        err = r.json()["error"]
        assert err["param"] == "priority", err
        assert err["message"].startswith("field 'priority': ") and why in err["message"], err


def served_order(
    server: Server,
    stage: str,
    blocker: tuple[str, dict[str, Any]],
    waiting: dict[str, Any],
    gate: Path | None = None,
) -> tuple[list[str], dict[str, httpx.Response]]:
    """Post ``blocker``; once ``stage`` holds it, post each of ``waiting`` (name -> (path,
    body)) once the one before waits in ``stage``'s queue, then the bodies that are not
    64-bit priorities (400s, with these requests in flight), then create ``gate`` (the
    file a stage holding its requests until it exists waits for); the order the waiting
    ones were answered in, and every answer."""
    posts = Posts(server)
    posts.post("blocker", *blocker)
    wait_for(lambda: stage_stats(server, stage)["inflight"] >= 1, 60, "the blocker held")
    for i, (name, (path, json)) in enumerate(waiting.items()):
        posts.post(name, path, json)
        wait_for(lambda i=i: stage_stats(server, stage)["queue_depth"] >= i + 1, 30, name)
    assert stage_stats(server, stage)["completed"] == 0, (
        "the blocker ended before every request waited behind it: hold it longer"
    )
    for path in server_paths(blocker[0]):
        for bad in NOT_INT64:
            refused(server, path, bad)
    if gate is not None:
        gate.touch()
    answers = posts.join()
    for name, r in answers.items():
        assert r.status_code == 200, (name, r.text)
    return [n for n in posts.order if n != "blocker"], answers


def server_paths(path: str) -> list[str]:
    return [IMAGES] if path == IMAGES else [CHAT, COMPLETIONS]


def test_text_requests_wait_by_priority_then_arrival_the_bounds_pass(text_priority):
    waiting = {
        "max": (COMPLETIONS, body(COMPLETIONS, priority=2**63 - 1)),
        "chat-1": (CHAT, body(CHAT, priority=-1)),
        "min": (CHAT, body(CHAT, priority=-(2**63))),
        "zero": (COMPLETIONS, body(COMPLETIONS, priority=0)),
        "completion-1": (COMPLETIONS, body(COMPLETIONS, priority=-1)),
    }
    blocker = (COMPLETIONS, body(COMPLETIONS))
    server, gate = text_priority
    order, _ = served_order(server, "slow", blocker, waiting, gate)
    assert order == ["min", "chat-1", "completion-1", "zero", "max"]


def test_image_requests_wait_by_priority_then_arrival_the_bounds_pass(image_priority):
    small = {"size": "128x128", "steps": 30}  # ~0.1 s apart: their answers in order
    waiting = {
        "max": body(IMAGES, priority=2**63 - 1, **small),
        "minus-1": body(IMAGES, priority=-1, **small),
        "zero": body(IMAGES, **small),
        "minus-1-later": body(IMAGES, priority=-1, **small),
    }
    # ~3 s in the sampler; the best priority there is: none of them preempts it
    blocker = (IMAGES, body(IMAGES, priority=-(2**63), size="512x512", steps=100))
    order, answers = served_order(
        image_priority, "sample", blocker, {n: (IMAGES, b) for n, b in waiting.items()}
    )
    assert order == ["minus-1", "minus-1-later", "zero", "max"]
    for name in waiting:
        (image,) = answers[name].json()["data"]
        assert image["b64_json"] and answers[name].json()["size"] == "128x128"


def test_a_fcfs_pipeline_refuses_a_priority_and_takes_0_meanwhile_one_runs(text_fcfs):
    posts = Posts(text_fcfs)
    posts.post("running", COMPLETIONS, body(COMPLETIONS))
    wait_for(lambda: stage_stats(text_fcfs, "slow")["inflight"] >= 1, 60, "a request held")
    for path in (CHAT, COMPLETIONS):
        for priority in (1, -1, 2**63 - 1):
            refused(text_fcfs, path, priority, FCFS_REFUSES)
        for bad in NOT_INT64:
            refused(text_fcfs, path, bad)
        posts.post(f"{path} 0", path, body(path, priority=0))
    for name, r in posts.join().items():
        assert r.status_code == 200, (name, r.text)
    assert posts.order[0] == "running"


def test_a_fcfs_image_pipeline_refuses_a_priority_and_takes_0(image_server):
    refused(image_server, IMAGES, 1, FCFS_REFUSES)
    refused(image_server, IMAGES, -(2**63), FCFS_REFUSES)
    refused(image_server, IMAGES, 2**63)
    r = httpx.post(f"{image_server.url}{IMAGES}", json=body(IMAGES, priority=0), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["b64_json"]


def test_a_priority_the_pipeline_refuses_on_submit_is_a_400_naming_the_field():
    """The server checks first; where the pipeline's own check refuses (its submit raises
    UserInputError) the answer is the same 400, not a 503."""
    pipe = FakePipe()
    pipe.refuse = UserInputError("field 'priority': refused by the pipeline")
    with client_of(pipe) as client:
        for stream in (False, True):
            r = client.post(COMPLETIONS, json={"prompt": "x", "stream": stream})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "priority" and "refused by the pipeline" in err["message"]


def test_every_image_of_n_gets_the_priority_and_0_is_left_out():
    req = parse(ImageRequest, {"prompt": "a cat", "n": 3, "priority": -3})
    assert [r[PRIORITY_KEY] for r in image_requests(req, 1 << 20, 4, None)] == [-3, -3, -3]
    req = parse(ImageRequest, {"prompt": "a cat", "priority": 0})
    assert PRIORITY_KEY not in image_requests(req, 1 << 20, 4, None)[0]
