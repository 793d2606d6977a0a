"""The ``Host`` check at its edges: which names are loopback, how a ``Host`` header's
name is read, and what a refused client sees (the status, and the header cut to 200
characters in the message)."""

from __future__ import annotations

import pytest
from omni_serve.middleware import RequestContext, allowed_hosts, host_name, is_loopback
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LOCALHOST.", True),
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("10.0.0.1", False),
        ("example.com", False),  # not an address at all: not loopback, no error
        ("localhost.example", False),
        ("", False),
    ],
)
def test_which_binds_are_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("[::1]:8000", "[::1]"),
        ("[::1]", "[::1]"),
        ("[]:80", "[]"),  # the shortest bracketed name keeps its brackets, drops the port
        ("[::1", "[::1"),  # no closing bracket: the value as it is
        ("API.Test.:443", "api.test"),
        ("127.0.0.1:1", "127.0.0.1"),
        (" localhost ", "localhost"),
        ("::1", "::1"),  # a bare IPv6 address: its colons are not a port
    ],
)
def test_a_host_headers_name(header: str, name: str) -> None:
    assert host_name(header) == name


def test_a_loopback_bind_answers_its_own_names_only() -> None:
    assert allowed_hosts("0.0.0.0") is None  # a public bind checks nothing unless told
    assert allowed_hosts("0.0.0.0", ["*"]) is None
    assert allowed_hosts("::1") == ("localhost", "127.0.0.1", "[::1]")
    assert allowed_hosts("127.0.0.1", ["API.test:8000"]) == (
        "localhost",
        "127.0.0.1",
        "[::1]",
        "api.test",
    )


def _client() -> TestClient:
    async def ok(request):  # noqa: ANN001, ANN202
        return PlainTextResponse("ok")

    app = RequestContext(Starlette(routes=[Route("/", ok)]), allowed_hosts("127.0.0.1"))
    return TestClient(app, base_url="http://127.0.0.1")


def test_a_refused_host_is_a_400_naming_the_header_cut_at_200_characters() -> None:
    client = _client()
    assert client.get("/").status_code == 200
    for length in (200, 201, 500):
        host = "h" * length
        r = client.get("/", headers={"Host": host})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "Host" and err["code"] == "host_not_allowed"
        assert err["request_id"] == r.headers["x-request-id"]
        assert f"Host {'h' * 200!r} is not allowed" in err["message"]  # exactly 200 kept
        assert "127.0.0.1" in err["message"] and "--allowed-host" in err["message"]
