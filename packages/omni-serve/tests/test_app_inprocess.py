"""The app in-process over a scripted stand-in for the pipeline: how each way a request
can fail becomes an answer (429 with Retry-After, 503 for a failed runtime or a dead
stage, a 5xx without the stage's text), ``/health`` of a failed runtime, the timeout cap,
and the settings and ``Host`` rules."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from omni_core.errors import OverloadedError, RuntimeFailedError, StageDeadError
from omni_core.events import AnyEvent, Error, Segment
from omni_serve import ServeSettings, create_app
from omni_serve.middleware import allowed_hosts
from omni_serve.settings import SettingsError

SECRET = "secret-detail-1234"
Script = Callable[[str], list[AnyEvent]]


class FakePipe:
    """What the app reads of a Pipeline; each request answers ``script(request_id)``
    (events) or raises ``refuse``; ``requests``: what it was given."""

    def __init__(self, request_timeout_s: float | None = None, intake: str = "ar.intake") -> None:
        stages = [SimpleNamespace(name="intake", kind=intake, options={"model": "m"})]
        stages.append(SimpleNamespace(name="decode", kind="ar.decode", options={"model": "m"}))
        edges = [SimpleNamespace(source="intake", target="decode")]
        self.config = SimpleNamespace(
            name="fake", stages=stages, edges=edges, request_timeout_s=request_timeout_s
        )
        self.failure: dict[str, str] | None = None
        self.healthy = {"intake": True, "decode": True}
        self.script: Script = lambda rid: [text(rid, "hi", last=True)]
        self.refuse: Exception | None = None
        self.timeouts: list[float | None] = []
        self.requests: list[dict[str, Any]] = []

    async def astream(
        self, request: dict[str, Any], request_id: str, timeout_s: float | None
    ) -> AsyncIterator[AnyEvent]:
        self.timeouts.append(timeout_s)
        self.requests.append(request)
        if self.refuse is not None:
            raise self.refuse
        for ev in self.script(request_id):
            yield ev

    def health(self) -> dict[str, dict[str, Any]]:
        return {
            n: {"state": "ready" if ok else "dead", "healthy": ok, "restarts": 0, "pid": 1}
            for n, ok in self.healthy.items()
        }

    def metrics(self) -> dict[str, Any]:
        return {"stages": {}, "in_flight": 0, "counts": {}}


def text(rid: str, t: str, last: bool = False) -> Segment:
    return Segment(request_id=rid, stage="decode", tokens=[1], payload={"text": t}, is_last=last)


def stage_error(rid: str, code: str = "stage_error") -> Error:
    msg = f"stage 'decode': ValueError: {SECRET}"
    return Error(request_id=rid, stage="decode", message=msg, code=code)


@pytest.fixture
def pipe() -> FakePipe:
    return FakePipe()


def client_of(pipe: FakePipe, **settings: Any) -> TestClient:
    return TestClient(create_app(pipe, ServeSettings(model_name="fake", **settings)))  # type: ignore[arg-type]


def post(client: TestClient, stream: bool = False, **body: Any):
    return client.post("/v1/completions", json={"prompt": "x", "stream": stream, **body})


def sse_error(r) -> dict[str, Any]:
    """The ``error`` event of an SSE answer."""
    lines = r.text.split("\n")
    i = lines.index("event: error")
    return json.loads(lines[i + 1].removeprefix("data: "))["error"]


def test_health_of_a_failed_runtime(pipe):
    client = client_of(pipe)
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    pipe.healthy["decode"] = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unhealthy"
    assert r.json()["stages"]["decode"]["state"] == "dead"
    pipe.healthy["decode"] = True
    pipe.failure = {"part": "collector", "error": "pump thread died"}
    r = client.get("/health")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "failed"
    assert body["failure"] == {"part": "collector", "error": "pump thread died"}
    assert set(body["stages"]) == {"intake", "decode"}


@pytest.mark.parametrize(("retry_after_s", "header"), [(2.5, "3"), (0.01, "1"), (7.0, "7")])
def test_overloaded_is_a_429_with_retry_after(pipe, retry_after_s, header):
    pipe.refuse = OverloadedError("4096 requests are open", retry_after_s=retry_after_s)
    client = client_of(pipe)
    for stream in (False, True):
        r = post(client, stream)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == header
        err = r.json()["error"]
        assert err["code"] == "overloaded" and err["request_id"] == r.headers["x-request-id"]


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (RuntimeFailedError(f"the runtime failed (pump: {SECRET})"), "runtime_failed"),
        (StageDeadError(f"stage 'decode' is dead ({SECRET}, after 3 restarts)"), "stage_dead"),
        (RuntimeError(f"pipeline is not running {SECRET}"), None),
    ],
)
def test_refused_requests_are_503s_without_the_runtimes_text(pipe, exc, code, caplog):
    pipe.refuse = exc
    client = client_of(pipe)
    for stream in (False, True):
        with caplog.at_level(logging.INFO, logger="omni.serve"):
            r = post(client, stream, user="u")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        rid = r.headers["x-request-id"]
        assert err["code"] == code and err["request_id"] == rid and rid in err["message"]
        assert SECRET not in r.text
        assert any(SECRET in rec.getMessage() and rec.request_id == rid for rec in caplog.records)
    if code == "stage_dead":
        assert "stage 'decode' is dead" in err["message"]


@pytest.mark.parametrize(
    ("code", "status"), [("stage_error", 500), ("stage_died", 500), ("runtime_failed", 503)]
)
def test_a_stage_failure_hides_the_stages_text(pipe, caplog, code, status):
    pipe.script = lambda rid: [stage_error(rid, code)]
    client = client_of(pipe)
    with caplog.at_level(logging.INFO, logger="omni.serve"):
        r = post(client)
    assert r.status_code == status, r.text
    rid = r.headers["x-request-id"]
    err = r.json()["error"]
    assert err["request_id"] == rid and SECRET not in r.text and "ValueError" not in r.text
    if status == 500:
        assert err["message"] == f"stage 'decode' failed; request id {rid}"
    logged = [rec for rec in caplog.records if SECRET in rec.getMessage()]
    assert logged and all(rec.request_id == rid for rec in logged)


def test_a_failure_mid_stream_is_an_sse_error_without_the_text(pipe):
    pipe.script = lambda rid: [text(rid, "a"), text(rid, "b"), stage_error(rid)]
    r = post(client_of(pipe), stream=True)
    assert r.status_code == 200  # the stream had begun
    err = sse_error(r)
    rid = r.headers["x-request-id"]
    assert err["request_id"] == rid and err["message"] == f"stage 'decode' failed; request id {rid}"
    assert SECRET not in r.text and r.text.endswith("data: [DONE]\n\n")


def test_a_stage_validation_error_keeps_its_field_message(pipe):
    msg = "stage 'intake': field 'prompt': 80 tokens, over max_prompt_tokens=64"
    code = "invalid_request"  # a UserInputError's: the only text a client sees
    pipe.script = lambda rid: [Error(request_id=rid, stage="intake", message=msg, code=code)]
    r = post(client_of(pipe))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == msg
    # the same words from any other error are the stage's failure: not shown
    pipe.script = lambda rid: [Error(request_id=rid, stage="intake", message=msg)]
    r = post(client_of(pipe))
    assert r.status_code == 500 and "80 tokens" not in r.text


def test_an_unforeseen_error_is_a_500_with_the_request_id_only(pipe):
    def broken() -> dict[str, Any]:
        raise RuntimeError(SECRET)

    pipe.metrics = broken  # type: ignore[method-assign]
    client = TestClient(
        create_app(pipe, ServeSettings(model_name="fake")), raise_server_exceptions=False
    )  # type: ignore[arg-type]
    r = client.get("/v1/omni/stats", headers={"X-Request-Id": "abc-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "abc-1"
    assert r.json()["error"]["message"] == "internal server error; request id abc-1"
    assert SECRET not in r.text


def test_timeout_s_lowers_the_cap_never_raises_it(pipe):
    client = client_of(pipe, request_timeout_s=0.5)
    for body_timeout in (30, 0.1, None):
        extra = {} if body_timeout is None else {"timeout_s": body_timeout}
        assert post(client, **extra).status_code == 200
    assert pipe.timeouts == [0.5, 0.1, 0.5]
    # without --request-timeout the config's request_timeout_s is the cap
    capped = FakePipe(request_timeout_s=2.0)
    client = client_of(capped)
    for body_timeout in (30, 1):
        assert post(client, timeout_s=body_timeout).status_code == 200
    assert capped.timeouts == [2.0, 1]
    free = FakePipe()  # no cap anywhere: the body's, up to 7 days
    assert post(client_of(free), timeout_s=3600).status_code == 200
    assert free.timeouts == [3600]


def test_settings_refuse_an_empty_api_key_and_bad_timeouts():
    for key in ("", "   "):
        with pytest.raises(SettingsError, match="API key is empty"):
            ServeSettings(model_name="m", api_key=key)
    for bad in (0, -1, float("nan"), float("inf"), 1e9):
        with pytest.raises(SettingsError, match="request-timeout"):
            ServeSettings(model_name="m", request_timeout_s=bad)


def test_host_allow_lists():
    loop = ("localhost", "127.0.0.1", "[::1]")
    assert allowed_hosts("127.0.0.1") == loop
    assert allowed_hosts("localhost") == loop
    assert allowed_hosts("127.0.0.2") == (*loop, "127.0.0.2")
    assert allowed_hosts("::1") == loop
    assert allowed_hosts("127.0.0.1", ["Api.Test:8000"]) == (*loop, "api.test")
    assert allowed_hosts("127.0.0.1", ["*"]) is None
    assert allowed_hosts("0.0.0.0") is None  # open binds check only when told
    assert allowed_hosts("0.0.0.0", ["api.test"]) == (*loop, "0.0.0.0", "api.test")
    pipe = FakePipe()
    client = TestClient(
        create_app(pipe, ServeSettings(model_name="m", allowed_hosts=allowed_hosts("::1"))),  # type: ignore[arg-type]
        base_url="http://[::1]:8000",
    )
    assert client.get("/health").status_code == 200
    assert client.get("/health", headers={"Host": "rebound.example"}).status_code == 400


# -- top_logprobs: the AR stages' per-token alternatives, in OpenAI's shapes -------------

TOKENS = [
    ("Hé", -0.5, [["Hé", -0.5], ["Ho", -1.5], ["Hé", -2.0]]),
    (" fox", -0.25, [[" fox", -0.25], [" cat", -2.5], [" dog", -3.0]]),
]


def with_top(rid: str) -> list[AnyEvent]:
    """Postprocess's segments of a request with ``logprobs`` and ``top_logprobs: 3``:
    ``token_texts`` and ``top_logprobs`` beside the segment's logprobs, one token each."""
    return [
        Segment(
            request_id=rid,
            stage="postprocess",
            tokens=[i],
            logprobs=[lp],
            payload={"text": t, "token_texts": [t], "top_logprobs": [top]},
            is_last=i == len(TOKENS) - 1,
        )
        for i, (t, lp, top) in enumerate(TOKENS)
    ]


def sse_chunks(r) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix("data: "))
        for line in r.text.split("\n")
        if line.startswith("data: {")
    ]


def test_chat_top_logprobs_rendered(pipe):
    pipe.script = with_top
    client = client_of(pipe)
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert pipe.requests[-1]["logprobs"] is True and pipe.requests[-1]["top_logprobs"] == 3
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "Hé" and content[0]["bytes"] == list("Hé".encode())
    assert content[0]["top_logprobs"] == [
        {"token": a, "logprob": lp, "bytes": list(a.encode())} for a, lp in TOKENS[0][2]
    ]
    assert [c["top_logprobs"][1]["token"] for c in content] == ["Ho", " cat"]
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    parts = [
        c
        for ch in sse_chunks(streamed)
        if ch["choices"] and ch["choices"][0]["logprobs"]
        for c in ch["choices"][0]["logprobs"]["content"]
    ]
    assert parts == content
    # top_logprobs without logprobs: true is refused (as OpenAI does)
    r = client.post("/v1/chat/completions", json={**body, "logprobs": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    # logprobs alone: no alternatives asked for, none rendered
    plain = {"messages": body["messages"], "logprobs": True}
    r = client.post("/v1/chat/completions", json=plain)
    assert "top_logprobs" not in pipe.requests[-1]


def test_completion_top_logprobs_rendered(pipe):
    pipe.script = with_top
    client = client_of(pipe)
    r = client.post("/v1/completions", json={"prompt": "x", "logprobs": 3})
    assert r.status_code == 200, r.text
    assert pipe.requests[-1]["top_logprobs"] == 3
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hé", " fox"] and lp["token_logprobs"] == [-0.5, -0.25]
    # one {text: logprob} per token, most likely first; a repeated text keeps the likelier
    assert lp["top_logprobs"] == [
        {"Hé": -0.5, "Ho": -1.5},
        {" fox": -0.25, " cat": -2.5, " dog": -3.0},
    ]
    assert list(lp["top_logprobs"][1]) == [" fox", " cat", " dog"]
    assert lp["text_offset"] == [0, 2]
    r = client.post("/v1/completions", json={"prompt": "x", "logprobs": 3, "stream": True})
    chunks = [ch["choices"][0]["logprobs"] for ch in sse_chunks(r) if ch["choices"][0]["logprobs"]]
    assert [t for c in chunks for t in c["top_logprobs"]] == lp["top_logprobs"]
    assert [o for c in chunks for o in c["text_offset"]] == [0, 2]
    r = client.post("/v1/completions", json={"prompt": "x", "logprobs": 0})
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"] is None
    assert "top_logprobs" not in pipe.requests[-1]


# -- images in chat: what reaches ar.mm_intake, and what is refused by name -------------

PNG_URL = "data:image/png;base64,iVBORw0KGgo="  # the server passes it on; the intake decodes


def image_chat(url: str, role: str = "user", **part: Any) -> dict[str, Any]:
    content = [
        {"type": "text", "text": "what is "},
        {"type": "image_url", "image_url": {"url": url, **part}},
    ]
    return {"messages": [{"role": role, "content": content}]}


def test_image_parts_reach_the_multimodal_intake():
    mm = FakePipe(intake="ar.mm_intake")
    client = client_of(mm)
    r = client.post("/v1/chat/completions", json=image_chat(PNG_URL, detail="low"))
    assert r.status_code == 200, r.text
    assert mm.requests[-1]["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is "},
                {"type": "image_url", "image_url": {"url": PNG_URL}},
            ],
        }
    ]
    # text-only parts still become one string (what ar.intake reads too)
    parts = [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200 and mm.requests[-1]["messages"][0]["content"] == "a b"


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            image_chat("https://example.com/cat.png"),
            "messages[0].content[1].image_url",
            "--allow-remote-images",
        ),
        (image_chat("/etc/passwd"), "messages[0].content[1].image_url", "data URL"),
        (image_chat("file:///etc/passwd"), "messages[0].content[1].image_url", "data URL"),
        (image_chat(PNG_URL, role="assistant"), "messages[0].content[1]", "user messages only"),
        (image_chat(PNG_URL, detail="max"), "messages[0].content[1].image_url.detail", "'auto'"),
        (image_chat(""), "messages[0].content[1].image_url.url", "at least 1"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            "messages[0].content[0].input_audio.data",
            "required",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "input_audio",
                                "input_audio": {"data": "AAAA", "format": "wav"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0]",
            "speech.thinker",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
            "messages[0].content[0]",
            "'video_url'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].image_url",
            "required",
        ),
    ],
)
def test_bad_image_parts_are_400s_naming_the_part(body, param, says):
    mm = FakePipe(intake="ar.mm_intake")
    r = client_of(mm).post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert not mm.requests


@pytest.mark.parametrize("stream", [False, True])
def test_a_pipeline_that_does_not_speak_refuses_audio_output_by_field(pipe, stream):
    """``audio`` and ``modalities`` with audio are 400s naming the field on a pipeline
    without an audio stage; ``modalities: ["text"]`` is what it does anyway; completions
    refuse both; ``/v1/audio/speech`` is not served."""
    client = client_of(pipe)
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
    for extra, param, says in [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio output is not supported"),
        ({"modalities": ["text", "audio"]}, "modalities", "only text output is supported"),
    ]:
        r = client.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and says in err["message"], err
        r = client.post("/v1/completions", json={"prompt": "hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post("/v1/chat/completions", json={**chat, "modalities": ["text"]})
    assert r.status_code == 200 and "modalities" not in pipe.requests[-1], r.text
    r = client.post("/v1/audio/speech", json={"input": "hi", "voice": "alloy"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unsupported_endpoint"


def test_a_text_pipeline_refuses_image_parts_by_name(pipe):
    r = client_of(pipe).post("/v1/chat/completions", json=image_chat(PNG_URL))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1]"
    assert "multimodal pipeline (ar.mm_intake" in err["message"] and not pipe.requests


def test_allowed_remote_images_are_fetched_and_inlined(image_host):
    import base64
    import io

    from PIL import Image

    url, path = image_host
    png = io.BytesIO()
    Image.new("RGB", (4, 3), "red").save(png, format="PNG")
    path.write_bytes(png.getvalue())
    mm = FakePipe(intake="ar.mm_intake")
    # the image host is on loopback: allowed by name (tests/test_remote_image_ssrf.py
    # shows what is refused without the allow-list)
    allow = {"remote_images_allow": ("127.0.0.1/32",)}
    client = client_of(mm, allow_remote_images=True, max_image_bytes=1000, **allow)
    r = client.post("/v1/chat/completions", json=image_chat(f"{url}/cat.png"))
    assert r.status_code == 200, r.text
    sent = mm.requests[-1]["messages"][0]["content"][1]["image_url"]["url"]
    assert sent == "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    r = client.post("/v1/chat/completions", json=image_chat(f"{url}/missing.png"))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages[0].content[1].image_url"
    assert "HTTP 4xx" in err["message"]
    path.write_bytes(b"x" * 1001)  # over --max-image-bytes
    r = client.post("/v1/chat/completions", json=image_chat(f"{url}/cat.png"))
    assert r.status_code == 400 and "--max-image-bytes" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=image_chat("http://127.0.0.1:9/x.png"))
    assert r.status_code == 400 and "could not fetch" in r.json()["error"]["message"]
    assert len(mm.requests) == 1


def test_body_limit_fits_images_and_names_itself(pipe):
    from omni_serve.cli import parser

    assert ServeSettings(model_name="m").max_body_bytes == 20 << 20
    assert parser().parse_args(["x.yaml"]).max_body_bytes == 20 << 20
    client = client_of(pipe, max_body_bytes=1000)
    r = client.post("/v1/chat/completions", json=image_chat("data:image/png;base64," + "A" * 1000))
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "body_too_large" and "1000 bytes (--max-body-bytes)" in err["message"]


def test_max_tokens_over_the_stages_limit_is_refused_before_the_pipeline(pipe):
    """The limit is the stages' ``max_tokens_limit`` (the smallest declared), checked by
    the server: the request never reaches the pipeline."""
    pipe.config.stages[1].options.update(max_tokens_limit=8, default_max_tokens=8)
    client = client_of(pipe)
    r = post(client, max_tokens=9)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "limit of 8 (option max_tokens_limit of stage 'decode')" in r.text
    assert pipe.requests == []
    assert post(client, max_tokens=8).status_code == 200
    assert pipe.requests[-1]["max_tokens"] == 8


@pytest.mark.parametrize("stream", [False, True])
def test_the_finish_reason_is_the_stages(pipe, stream):
    def ended(reason: str | None) -> Script:
        payload = {"text": "hi"} if reason is None else {"text": "hi", "finish_reason": reason}
        return lambda rid: [
            Segment(request_id=rid, stage="decode", tokens=[1], payload=payload, is_last=True)
        ]

    client = client_of(pipe)
    for reason, expected in (("length", "length"), ("stop", "stop"), (None, "stop")):
        pipe.script = ended(reason)
        r = post(client, stream, max_tokens=1)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(x[6:]) for x in r.text.split("\n") if x.startswith("data: {")]
            assert chunks[-1]["choices"][0]["finish_reason"] == expected
        else:
            assert r.json()["choices"][0]["finish_reason"] == expected
