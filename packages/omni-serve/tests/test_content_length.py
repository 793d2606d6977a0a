"""A request's ``Content-Length`` over HTTP: up to 20 digits (leading zeros counted) it is
the body's length; past them, or thousands of leading zeros (past Python's integer digit
limit), it is a 400 naming the header, never a 500 with a traceback."""

from __future__ import annotations

import json
import socket

import pytest
from omni_serve.body import MAX_LENGTH_DIGITS
from omni_testing.configs import chain

from .conftest import start_server, stop_server
from .test_server_limits import address

BODY = json.dumps({"prompt": "x"}).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = chain(("source", "synthetic.source", {"tokens": 4}), name="length")
    s = start_server(cfg, tmp_path_factory.mktemp("length"))
    yield s
    stop_server(s)


def post(url: str, length: str, body: bytes = BODY) -> tuple[int, dict]:
    """The status and JSON answer of a completion posted with ``Content-Length: length``."""
    host, port = address(url)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(head.encode() + body)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    status = int(got.split(b" ", 2)[1])
    return status, json.loads(got.split(b"\r\n\r\n", 1)[1] or b"{}")


def padded(n: int, digits: int) -> str:
    return str(n).rjust(digits, "0")


def test_a_length_of_20_digits_is_the_body_s_and_21_digits_a_400(server):
    assert MAX_LENGTH_DIGITS == 20
    # at the limit: the pipeline (no text endpoint) is what answers, as without zeros
    assert post(server.url, str(len(BODY)))[0] == 404
    assert post(server.url, padded(len(BODY), 20))[0] == 404
    for digits in (21, 5000):
        status, answer = post(server.url, padded(len(BODY), digits))
        assert status == 400, answer
        err = answer["error"]
        assert err["param"] == "Content-Length" and "Content-Length" in err["message"], err
    # a length past the body limit stays a 413 (read no further)
    assert post(server.url, "1" + "0" * 19, b"")[0] == 413
    assert "Traceback" not in server.log()
    assert server.health().status_code == 200
