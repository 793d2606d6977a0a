"""``n`` choices of one prompt (chat and completions, vLLM's ``n``): ``n`` pipeline requests
merged into one answer. On the tiny Llama, choice ``i`` of a seeded request equals a request
of its own with seed ``seed + i`` (text, logprobs), streamed or not; usage counts the prompt
once and sums the completions. ``--max-n`` at its limit and one past, bad values of ``n``;
each choice counted against its key's ``max_queued``; one choice failing (or the client
going away) ends the others and the answer is that error. The merge itself runs in-process
over a scripted stand-in for the pipeline, where a failure can hit exactly one choice."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from omni_core.events import AnyEvent, Completed, Error, Segment
from omni_serve import ServeSettings, create_app
from omni_serve.settings import SettingsError

from .conftest import chained, intake_then, start_server, stop_server

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
PROMPT = "a red fox"
SAMPLED = {"max_tokens": 6, "temperature": 1.0, "seed": 11}

# -- in-process: a scripted pipeline --------------------------------------------------------

Script = Callable[[dict[str, Any], str], AsyncIterator[AnyEvent]]


async def by_seed(request: dict[str, Any], rid: str) -> AsyncIterator[AnyEvent]:
    """``seed % 3 + 1`` tokens, each's text naming the seed; the last says ``length``."""
    seed = int(request.get("seed", 0))
    k = seed % 3 + 1
    for j in range(k):
        payload: dict[str, Any] = {"text": f"{seed}.{j} ", "prompt_tokens": 5}
        if j == k - 1:
            payload["finish_reason"] = "length"
        yield Segment(request_id=rid, stage="decode", tokens=[j], payload=payload)
    yield Completed(request_id=rid, stage="decode")


class ScriptedPipe:
    """What the app reads of a Pipeline: each request answers ``script(request, id)``;
    ``requests`` and ``ids``: what it was given; ``ended``: set once every request's stream
    has ended (run out, or closed: cancelled)."""

    def __init__(self, script: Script = by_seed) -> None:
        stages = [SimpleNamespace(name="intake", kind="ar.intake", options={"model": "m"})]
        stages.append(SimpleNamespace(name="decode", kind="ar.decode", options={"model": "m"}))
        edges = [SimpleNamespace(source="intake", target="decode")]
        self.config = SimpleNamespace(
            name="fake", stages=stages, edges=edges, request_timeout_s=None
        )
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.ids: list[str] = []
        self.open = 0
        self.ended = threading.Event()

    async def astream(
        self, request: dict[str, Any], request_id: str, timeout_s: float | None
    ) -> AsyncIterator[AnyEvent]:
        self.requests.append(request)
        self.ids.append(request_id)
        self.open += 1
        self.ended.clear()
        try:
            async for ev in self.script(request, request_id):
                yield ev
        finally:
            self.open -= 1
            if not self.open:
                self.ended.set()

    def health(self) -> dict[str, dict[str, Any]]:
        return {n: {"state": "ready", "healthy": True, "restarts": 0, "pid": 1} for n in ("a",)}

    def metrics(self) -> dict[str, Any]:
        return {"stages": {}, "in_flight": 0, "counts": {}}


def serve(pipe: ScriptedPipe, **settings: Any) -> TestClient:
    return TestClient(create_app(pipe, ServeSettings(model_name="fake", **settings)))  # type: ignore[arg-type]


def sse_data(text: str) -> list[dict[str, Any]]:
    """The JSON of each ``data:`` line of an SSE answer (not ``[DONE]``)."""
    return [
        json.loads(line.removeprefix("data: "))
        for line in text.split("\n")
        if line.startswith("data: {")
    ]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_requests_with_seeds_merged_in_order(path):
    pipe = ScriptedPipe()
    body = {"prompt": "x"} if "chat" not in path else {"messages": MESSAGES}
    with serve(pipe) as client:
        r = client.post(path, json={**body, "n": 3, "seed": 4})
        assert r.status_code == 200, r.text
        out = r.json()
        assert [p["seed"] for p in pipe.requests] == [4, 5, 6]
        assert len(set(pipe.ids)) == 3
        texts = [c["text"] if "text" in c else c["message"]["content"] for c in out["choices"]]
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert texts == ["4.0 4.1 ", "5.0 5.1 5.2 ", "6.0 "]
        assert [c["finish_reason"] for c in out["choices"]] == ["length"] * 3
        # the prompt once, the completions summed (as vLLM counts them)
        assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
        pipe.requests.clear()
        # no seed: the choices get seeds of their own, drawn anew for every request
        for _ in range(2):
            r = client.post(path, json={**body, "n": 2})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
        seeds = [p["seed"] for p in pipe.requests]
        assert seeds[1] == seeds[0] + 1 and seeds[3] == seeds[2] + 1 and seeds[0] != seeds[2]
        assert all(0 <= s < 2**63 for s in seeds)
        pipe.requests.clear()
        for extra in ({"seed": 9}, {}):  # one choice: the request as it is
            assert client.post(path, json={**body, **extra}).status_code == 200
        assert [p.get("seed") for p in pipe.requests] == [9, None]


def test_streamed_choices_carry_their_index_finish_and_one_usage():
    pipe = ScriptedPipe()
    body = {"messages": MESSAGES, "n": 3, "seed": 4, "stream": True}
    with serve(pipe) as client:
        r = client.post(
            "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}
        )
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    chunks = sse_data(r.text)
    texts, finishes = ["", "", ""], [[], [], []]
    for c in chunks[:-1]:
        assert c["usage"] is None and len(c["choices"]) == 1
        choice = c["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert texts == ["4.0 4.1 ", "5.0 5.1 5.2 ", "6.0 "]
    assert finishes == [["length"]] * 3
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_at_the_cap_and_one_past_and_bad_values(path):
    body = {"prompt": "x"} if "chat" not in path else {"messages": MESSAGES}
    for settings, cap in (({}, 16), ({"max_n": 2}, 2)):
        pipe = ScriptedPipe()
        with serve(pipe, **settings) as client:
            r = client.post(path, json={**body, "n": cap})
            assert r.status_code == 200 and len(r.json()["choices"]) == cap
            assert len(pipe.requests) == cap
            for n in (cap + 1, 0, -1, "2", 2.0, True, None, 2**70):
                r = client.post(path, json={**body, "n": n})
                assert r.status_code == 400, (n, r.text)
                err = r.json()["error"]
                assert err["param"] == "n", err
                assert "n" in err["message"]
            assert len(pipe.requests) == cap  # nothing past the check reached the pipeline
            r = client.post(path, json={**body, "n": cap + 1})
            assert f"expected 1..{cap}" in r.json()["error"]["message"]
            r = client.post(path, json={**body, "n": 2, "seed": 2**63 - 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
            r = client.post(path, json={**body, "n": 2, "seed": 2**63 - 2})
            assert r.status_code == 200, r.text


def test_the_cap_is_a_positive_number():
    for bad_cap in (0, -1):
        with pytest.raises(SettingsError, match="max_n"):
            ServeSettings(model_name="fake", max_n=bad_cap)


def test_n_with_best_of_stays_refused_and_with_echo_each_choice_echoes():
    with serve(ScriptedPipe()) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "n": 2, "best_of": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
        r = client.post("/v1/completions", json={"prompt": "x", "n": 2, "echo": True})
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in r.json()["choices"]]
        assert len(texts) == 2 and all(t.startswith("x") and len(t) > 1 for t in texts)


async def one_fails(request: dict[str, Any], rid: str) -> AsyncIterator[AnyEvent]:
    """Seed 1: a token, then the stage fails it; any other: a token, then nothing until
    it is cancelled."""
    yield Segment(request_id=rid, stage="decode", tokens=[1], payload={"text": "a"})
    if request.get("seed") == 1:
        yield Error(request_id=rid, stage="decode", message="stage 'decode': ValueError: x")
        return
    await asyncio.Event().wait()  # ends when its stream is closed
    yield Segment(request_id=rid, stage="decode", tokens=[2], payload={"text": "never"})


@pytest.mark.parametrize("stream", [False, True])
def test_one_choice_failing_cancels_the_others_and_fails_the_answer(stream):
    pipe = ScriptedPipe(one_fails)
    body = {"prompt": "x", "n": 3, "seed": 0, "stream": stream}
    with serve(pipe) as client:
        r = client.post("/v1/completions", json=body)
        assert pipe.ended.wait(10), f"{pipe.open} choices still running"
        rid = r.headers["x-request-id"]
        if not stream:
            assert r.status_code == 500, r.text
            assert r.json()["error"]["message"] == f"stage 'decode' failed; request id {rid}"
            assert "choices" not in r.json()
        else:
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            lines = r.text.split("\n")
            err = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))
            assert err["error"]["request_id"] == rid
            # no choice is passed off as finished
            assert all(c["choices"][0]["finish_reason"] is None for c in sse_data(r.text)[:-1])
        assert len(pipe.requests) == 3
        # the server goes on serving
        pipe.script = by_seed
        assert client.post("/v1/completions", json={"prompt": "x", "n": 2}).status_code == 200


# -- a real server: the tiny Llama ----------------------------------------------------------


def test_chat_choices_equal_separate_seeded_requests(client):
    kw = {"model": "tiny_chat", "messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    out = client.chat.completions.create(**kw, **SAMPLED, n=3)
    alone = [
        client.chat.completions.create(**kw, **{**SAMPLED, "seed": SAMPLED["seed"] + i})
        for i in range(3)
    ]
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c, a in zip(out.choices, alone, strict=True):
        assert c.message.content == a.choices[0].message.content
        assert c.finish_reason == a.choices[0].finish_reason
        assert c.logprobs.model_dump() == a.choices[0].logprobs.model_dump()
    assert len({c.message.content for c in out.choices}) > 1  # the seeds made a difference
    unseeded = client.chat.completions.create(**kw, **{**SAMPLED, "seed": None}, n=3)
    assert len({c.message.content for c in unseeded.choices}) > 1  # drawn apart
    assert out.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_choices_equal_separate_seeded_requests_streamed_too(client):
    kw = {"model": "tiny_chat", "prompt": PROMPT, "logprobs": 2}
    alone = [
        client.completions.create(**kw, **{**SAMPLED, "seed": SAMPLED["seed"] + i})
        for i in range(3)
    ]
    out = client.completions.create(**kw, **SAMPLED, n=3)
    for c, a in zip(out.choices, alone, strict=True):
        assert (c.text, c.logprobs) == (a.choices[0].text, a.choices[0].logprobs)
    assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    chunks = list(
        client.completions.create(
            **kw, **SAMPLED, n=3, stream=True, stream_options={"include_usage": True}
        )
    )
    texts, tokens, finishes = ["", "", ""], [[], [], []], [[], [], []]
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        texts[c.index] += c.text
        tokens[c.index] += c.logprobs.tokens if c.logprobs else []
        if c.finish_reason is not None:
            finishes[c.index].append(c.finish_reason)
    assert texts == [a.choices[0].text for a in alone]
    assert tokens == [a.choices[0].logprobs.tokens for a in alone]
    assert finishes == [[a.choices[0].finish_reason] for a in alone]
    assert chunks[-1].choices == [] and chunks[-1].usage == out.usage


def test_chat_streamed_choices_equal_the_whole_answer(client):
    kw = {"model": "tiny_chat", "messages": MESSAGES, **SAMPLED, "n": 2}
    whole = client.chat.completions.create(**kw)
    texts = ["", ""]
    roles = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.append(c.index)
    assert texts == [c.message.content for c in whole.choices]
    assert sorted(roles) == [0, 1]  # each choice opens with its role


def test_the_default_cap_on_a_real_server(text_server, client):
    out = client.completions.create(model="tiny_chat", prompt=PROMPT, max_tokens=1, n=16)
    assert [c.index for c in out.choices] == list(range(16))
    assert out.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny_chat", prompt=PROMPT, max_tokens=1, n=17)
    assert e.value.body["param"] == "n" and "--max-n" in e.value.body["message"]


def ended(server) -> tuple[float, float, float]:
    """(requests cancelled, completed, in flight) as the server's metrics count them."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        values[name] = float(value) if name.startswith("omni_requests_") else 0.0
    return (
        values.get('omni_requests_total{outcome="cancelled"}', 0.0),
        values.get('omni_requests_total{outcome="completed"}', 0.0),
        values["omni_requests_in_flight"],
    )


def test_a_client_going_away_mid_stream_cancels_every_choice(text_server, client):
    cancelled0, completed0, _ = ended(text_server)
    body = {"prompt": PROMPT, "max_tokens": 256, "ignore_eos": True, "n": 3, "stream": True}
    url = f"{text_server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk: the choices run; now hang up
    end = time.monotonic() + 20
    cancelled, completed, in_flight = ended(text_server)
    while (cancelled, in_flight) != (cancelled0 + 3, 0):
        assert time.monotonic() < end, (cancelled, completed, in_flight)
        time.sleep(0.05)  # the pipeline's counters: read until they settle
        cancelled, completed, in_flight = ended(text_server)
    assert completed == completed0
    assert client.completions.create(model="tiny_chat", prompt="ok", max_tokens=2, n=2).choices


# -- a real server with keys: each choice is a pipeline request of the key ----------------

KEYS = {name: f"{name}-{'k' * 40}" for name in ("c", "d")}
KEYS_FILE = "".join(
    f'[[keys]]\nname = "{name}"\nkey = "{key}"\nmax_queued = {q}\n\n'
    for (name, key), q in zip(KEYS.items(), (2, 3), strict=True)
)


@pytest.fixture(scope="module")
def gated(tiny_llama, tmp_path_factory):
    """intake -> a stage that holds every request until the test opens its gate."""
    from omni_testing.faults import Gate

    where = tmp_path_factory.mktemp("n-shares")
    keys = where / "keys.toml"
    keys.write_text(KEYS_FILE)
    keys.chmod(0o600)
    gate = Gate(where)
    hold = {"name": "hold", "kind": "synthetic.sleep", "options": {"hold_s": 0}}
    hold["options"]["until_file"] = gate.path
    config = {**intake_then("n_shares", tiny_llama, hold), "heartbeat_interval_s": 0.05}
    s = start_server(config, where, "--api-keys-file", str(keys))
    yield s, gate
    stop_server(s)


def metric(server, name: str, **labels: str) -> float:
    text = httpx.get(
        f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEYS['d']}"}, timeout=10
    ).text
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rpartition(" ")[2])
    return 0.0


def wait_for(check: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + 20
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.02)


def test_each_choice_counts_against_the_keys_max_queued(gated):
    server, gate = gated
    if os.path.exists(gate.path):  # a rerun: the gate closed again
        os.remove(gate.path)
    url = f"{server.url}/v1/completions"

    def post(key: str, **body: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEYS[key]}"}
        return httpx.post(url, json={"prompt": "x", **body}, headers=headers, timeout=60)

    held: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda: held.append(post("d", n=3))),  # d's whole share
        threading.Thread(target=lambda: held.append(post("c"))),  # one of c's two
    ]
    for t in threads:
        t.start()
    wait_for(lambda: metric(server, "omni_http_key_queued", key="d") == 3, "d never held 3")
    wait_for(lambda: metric(server, "omni_http_key_queued", key="c") == 1, "c never held 1")
    # d holds 3 open by one request, as 3 requests would: one more is over its share
    r = post("d")
    assert r.status_code == 429 and "max_queued" in r.json()["error"]["message"]
    # c's n=2: the first choice goes in, the second is refused; the first is cancelled
    cancelled = metric(server, "omni_requests_total", outcome="cancelled")
    r = post("c", n=2)
    assert r.status_code == 429 and "max_queued" in r.json()["error"]["message"], r.text
    wait_for(
        lambda: metric(server, "omni_requests_total", outcome="cancelled") == cancelled + 1,
        "the admitted choice was not cancelled",
    )
    assert metric(server, "omni_http_key_queued", key="c") == 1
    # more choices than the key may ever hold: a 400 naming n, not a 429 to retry
    r = post("c", n=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "max_queued" in r.json()["error"]["message"]
    gate.open()
    for t in threads:
        t.join(60)
    assert sorted(len(r.json()["choices"]) for r in held) == [1, 3]
    assert post("c", n=2).status_code == 200  # at its share
    assert metric(server, "omni_http_key_queued", key="c") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_going_away_cancels_every_held_choice(gated, stream):
    server, gate = gated
    if os.path.exists(gate.path):  # the choices are held until the client has gone
        os.remove(gate.path)
    cancelled = metric(server, "omni_requests_total", outcome="cancelled")
    url = f"{server.url}/v1/completions"
    body = {"prompt": "x", "n": 3, "stream": stream}
    headers = {"Authorization": f"Bearer {KEYS['d']}"}
    with pytest.raises(httpx.ReadTimeout):  # nothing comes: the client hangs up
        httpx.post(url, json=body, headers=headers, timeout=1.0)
    wait_for(
        lambda: metric(server, "omni_requests_total", outcome="cancelled") == cancelled + 3,
        "not every choice was cancelled",
    )
    wait_for(lambda: metric(server, "omni_http_key_queued", key="d") == 0, "d holds choices")


# -- the vLLM engine ------------------------------------------------------------------------

VLLM_ARGS = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20}


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    from omni_ar.testing import build_tiny_llama, require_vllm

    require_vllm()
    model = str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-32"), head_dim=32))
    opts = {"model": model, "engine": "vllm"}
    stages = [
        {"name": "intake", "kind": "ar.intake", "options": opts},
        {
            "name": "generate",
            "kind": "ar.generate",
            "max_inflight": 4,  # the choices decode together
            "options": {**opts, "engine_args": VLLM_ARGS, "max_segment_tokens": 4},
        },
        {"name": "postprocess", "kind": "ar.postprocess", "options": opts},
    ]
    config = {**chained("tiny_vllm", stages), "ready_timeout_s": 300}
    s = start_server(config, tmp_path_factory.mktemp("vllm-server"))
    yield s
    stop_server(s)


def test_vllm_choices_equal_separate_seeded_requests(vllm_server):
    c = openai.OpenAI(base_url=f"{vllm_server.url}/v1", api_key="unused", max_retries=0)
    kw = {"model": "tiny_vllm", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    out = c.completions.create(**kw, seed=5, n=3)
    alone = [c.completions.create(**kw, seed=5 + i).choices[0].text for i in range(3)]
    assert [x.text for x in out.choices] == alone
    assert len(set(alone)) > 1
    greedy = c.completions.create(**{**kw, "temperature": 0}, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text
