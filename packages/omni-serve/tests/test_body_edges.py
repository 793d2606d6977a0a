"""The body's limits at the exact limit and one past it, over HTTP in-process: the size
(413), the count of JSON values (413), the server-wide budget (503), the content type
(415), and the 400s of bodies that are not UTF-8 JSON, each with its status and field."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from omni_serve.app import create_app
from omni_serve.body import off_loop
from omni_serve.fair import FairSlot, WorkShares
from omni_serve.settings import ServeSettings

from .test_app_inprocess import FakePipe, client_of

JSON = {"Content-Type": "application/json"}
# the documented limits, written out so that a changed constant fails here
INLINE_BYTES = 64 << 10  # bodies parsed on the event loop and taking none of the budget
MAX_VALUES = 100_000  # JSON values in a body, by its commas and opening brackets


def body_of_size(n: int, filler: str = "x") -> bytes:
    """A completion request that is exactly ``n`` bytes of JSON."""
    head, tail = b'{"prompt": "', b'"}'
    return head + filler.encode() * (n - len(head) - len(tail)) + tail


def roomy() -> FakePipe:
    """A pipeline whose intake takes prompts long enough for any body here (these tests
    fill bodies with a prompt; its own character limit is test_limits_before_work's)."""
    pipe = FakePipe()
    pipe.config.stages[0].options["max_prompt_tokens"] = 1 << 20
    return pipe


def post_raw(raw: bytes, headers: dict[str, str] | None = None, **settings: Any) -> Any:
    return client_of(roomy(), **settings).post(
        "/v1/completions", content=raw, headers=JSON if headers is None else headers
    )


def error_of(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]


# the body's size (--max-body-bytes)

LIMIT = 4096


def chunks(raw: bytes, *sizes: int) -> Any:
    """``raw`` as a body without a Content-Length, in pieces of ``sizes`` (then the rest)."""

    async def gen() -> AsyncIterator[bytes]:
        at = 0
        for n in (*sizes, len(raw)):
            if at < len(raw):
                yield raw[at : at + n]
                at += n

    return gen()


async def post_streamed(app: Any, raw: bytes, *sizes: int) -> httpx.Response:
    """``raw`` posted as it arrives over a connection: chunked, no Content-Length."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/v1/completions", content=chunks(raw, *sizes), headers=JSON)


def app_of(**settings: Any) -> Any:
    return create_app(roomy(), ServeSettings(model_name="fake", **settings))  # type: ignore[arg-type]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_body_at_the_size_limit_passes_and_one_byte_more_is_a_413(streamed):
    for size, status in ((LIMIT, 200), (LIMIT + 1, 413)):
        raw = body_of_size(size)
        if streamed:
            r = asyncio.run(post_streamed(app_of(max_body_bytes=LIMIT), raw, 1000))
        else:
            r = post_raw(raw, max_body_bytes=LIMIT)
        assert r.status_code == status, (size, r.text)
    err = r.json()["error"]
    assert err["code"] == "body_too_large" and f"limit of {LIMIT} bytes" in err["message"]


# the count of JSON values


@pytest.mark.parametrize("filler", [",", "[", "{", ",[{"])
def test_a_body_of_max_values_passes_and_one_more_is_a_413(filler):
    """Values are counted by commas and opening brackets, in strings too (the body's own
    ``{`` is one)."""
    pad = (MAX_VALUES - 1) // len(filler)
    rest = "," * (MAX_VALUES - 1 - pad * len(filler))
    raw = json.dumps({"prompt": filler * pad + rest}, separators=(":", ":")).encode()
    r = post_raw(raw)
    assert r.status_code == 200, r.text
    raw = json.dumps({"prompt": filler * pad + rest + ","}, separators=(":", ":")).encode()
    err = error_of(post_raw(raw), 413)
    assert (
        err["code"] == "body_too_large" and f"more than {MAX_VALUES} JSON values" in err["message"]
    )


# the server-wide budget (--max-body-bytes-in-flight)


def with_full_budget(**settings: Any) -> Any:
    """An app whose body budget other requests hold whole."""
    app = app_of(**settings)
    app.state.server.bodies.used = app.state.server.bodies.limit
    return app


@pytest.mark.parametrize("streamed", [False, True])
def test_bodies_up_to_inline_bytes_take_nothing_of_the_budget(streamed):
    """With the budget held whole by other bodies, a body of ``INLINE_BYTES`` is still
    served; one byte more is a 503 with ``Retry-After``."""
    for size, status in ((INLINE_BYTES, 200), (INLINE_BYTES + 1, 503)):
        app = with_full_budget()
        if streamed:
            r = asyncio.run(post_streamed(app, body_of_size(size)))
        else:
            r = TestClient(app).post("/v1/completions", content=body_of_size(size), headers=JSON)
        assert r.status_code == status, (size, r.text)
    err = r.json()["error"]
    assert err["code"] == "server_busy" and r.headers["Retry-After"] == "1"


def test_a_body_arriving_in_pieces_may_fill_the_budget_exactly():
    """Each piece takes only its own bytes: a body as large as the whole budget, in two
    pieces past ``INLINE_BYTES``, is served, and gives its bytes back."""
    size = 3 * INLINE_BYTES
    app = app_of(max_body_bytes=size, max_body_bytes_in_flight=size)
    r = asyncio.run(post_streamed(app, body_of_size(size), 2 * INLINE_BYTES))
    assert r.status_code == 200, r.text
    assert app.state.server.bodies.used == 0
    r = asyncio.run(post_streamed(app, body_of_size(size + 1), 2 * INLINE_BYTES))
    assert r.status_code == 413, r.text
    assert app.state.server.bodies.used == 0


def test_a_body_arriving_in_pieces_takes_its_bytes_before_they_are_held():
    """Bytes held while a slow client is still sending count against the budget (what
    ``--max-body-bytes-in-flight`` bounds and the metric reports)."""
    app = app_of()
    raw = body_of_size(3 * INLINE_BYTES)
    held: list[int] = []

    async def pieces() -> AsyncIterator[bytes]:
        held.append(app.state.server.bodies.used)
        yield raw[: 2 * INLINE_BYTES]
        held.append(app.state.server.bodies.used)  # the server asked for the next piece
        yield raw[2 * INLINE_BYTES :]

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", content=pieces(), headers=JSON)

    r = asyncio.run(post())
    assert r.status_code == 200, r.text
    assert held == [0, 2 * INLINE_BYTES]
    assert app.state.server.bodies.used == 0


def test_a_body_past_inline_bytes_is_parsed_off_the_event_loop():
    server = SimpleNamespace(parsing=FairSlot(WorkShares()))
    app = SimpleNamespace(state=SimpleNamespace(server=server))
    request = SimpleNamespace(app=app, client=None)

    async def threads() -> tuple[int, int, int]:
        here = threading.get_ident()
        at_limit = await off_loop(request, INLINE_BYTES, threading.get_ident)  # type: ignore[arg-type]
        past = await off_loop(request, INLINE_BYTES + 1, threading.get_ident)  # type: ignore[arg-type]
        return here, at_limit, past

    here, at_limit, past = asyncio.run(threads())
    assert at_limit == here and past != here


# the content type


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "Application/JSON ; charset=UTF-8",
        'application/json; charset="utf8"',
        "application/json; boundary=x",
        "application/json; boundary=x; charset=utf-8",
    ],
)
def test_json_in_utf8_is_accepted(content_type):
    r = post_raw(b'{"prompt": "x"}', {"Content-Type": content_type})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain; charset=utf-8",
        "application/x-www-form-urlencoded",
        "application/json; charset=latin-1",
        "application/json; charset=utf-8; charset=utf-16",
        "application/json; boundary=x; charset=utf-16",
    ],
)
def test_other_content_types_are_a_415(content_type):
    err = error_of(post_raw(b'{"prompt": "x"}', {"Content-Type": content_type}), 415)
    assert err["param"] == "Content-Type" and err["code"] == "unsupported_media_type"
    assert f"Content-Type {content_type!r} is not supported" in err["message"]


def test_no_content_type_is_a_415():
    r = client_of(FakePipe()).post("/v1/completions", content=b'{"prompt": "x"}')
    err = error_of(r, 415)
    assert err["param"] == "Content-Type" and err["code"] == "unsupported_media_type"


def test_a_long_content_type_is_shown_cut_at_100_characters():
    value = "text/" + "abcdefghij" * 20
    err = error_of(post_raw(b'{"prompt": "x"}', {"Content-Type": value}), 415)
    assert f"Content-Type {value[:100]!r} is not" in err["message"]


# bodies that are not UTF-8 JSON: 400, naming the field where there is one


@pytest.mark.parametrize(
    ("raw", "param", "says"),
    [
        (b'{"prompt": "\xff"}', None, "the request body is not UTF-8: invalid start byte"),
        (b'{"prompt": ', None, "the request body is not valid JSON: Expecting value"),
        (b'{"prompt": "\\ud800"}', "prompt", "a lone surrogate"),
        (b'{"prompt": "\\u00e9\\ud800"}', "prompt", "a lone surrogate"),
        (b'{"prompt": "x", "stop": ["\\udfff"]}', "stop[0]", "a lone surrogate"),
        (
            b'{"prompt": "x", "response_format": {"\\ud800": 1}}',
            "response_format.\\ud800",
            "a key that is not valid Unicode",
        ),
        (b'{"prompt": "x", "stop": ' + b"[" * 70 + b"]" * 70 + b"}", "stop", "nested deeper"),
        (b"[" * 20000 + b"]" * 20000, "body", "nested deeper than 64 levels"),
        (b'{"prompt": NaN, "stop": ' + b"[" * 20000 + b"]" * 20000 + b"}", "body", "nested deeper"),
    ],
)
def test_a_small_bad_body_is_a_400(raw, param, says):
    err = error_of(post_raw(raw), 400)
    assert err["param"] == param and says in err["message"], err


def test_nan_at_inline_bytes_is_named_and_one_byte_more_is_msgspecs_error():
    """A bad body up to ``INLINE_BYTES`` is parsed again by Python's ``json`` for a
    message naming the field; a bigger one gets msgspec's error, by position."""
    raw = body_of_size(INLINE_BYTES - len(', "seed": NaN'))[:-1] + b', "seed": NaN}'
    assert len(raw) == INLINE_BYTES
    err = error_of(post_raw(raw), 400)
    assert err["param"] == "seed" and "nan is not a finite number" in err["message"]
    raw = raw[:12] + b"x" + raw[12:]
    err = error_of(post_raw(raw), 400)
    assert err["param"] is None, err
    assert "not valid JSON (NaN, Infinity and lone surrogates" in err["message"]
