"""What a request body may hold, at its edges, in-process over a scripted pipeline: the
signed 64-bit integers, the largest finite number, 64 levels of nesting; one past each
is a 400 naming the field, in a typed field and inside a free-form object alike (a JSON
schema, which the server passes on as it is)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .test_app_inprocess import FakePipe, client_of

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SCHEMA = "response_format.json_schema.schema"


def with_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def post_raw(raw: bytes) -> tuple[FakePipe, Any]:
    pipe = FakePipe()
    r = client_of(pipe).post(
        "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    return pipe, r


def post(body: dict[str, Any]) -> tuple[FakePipe, Any]:
    return post_raw(json.dumps({"prompt": "x", **body}).encode())


def refused(r: Any, param: str, says: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize("value", [INT64_MAX, INT64_MIN, 0])
def test_signed_64_bit_integers_pass_whole(value):
    pipe, r = post({"seed": value, "response_format": with_schema({"maximum": value})})
    assert r.status_code == 200, r.text
    (request,) = pipe.requests
    assert request["seed"] == value
    assert request["response_format"]["json_schema"]["schema"]["maximum"] == value


@pytest.mark.parametrize("value", [INT64_MAX + 1, INT64_MIN - 1, 2**64 - 1, 2**64])
def test_one_past_64_bits_is_a_400_naming_the_field(value):
    _, r = post({"seed": value})
    refused(r, "seed", "must fit in 64 bits")
    _, r = post({"response_format": with_schema({"maximum": value})})
    refused(r, f"{SCHEMA}.maximum", "must fit in 64 bits")


def test_the_largest_finite_number_passes_inside_a_schema():
    pipe, r = post({"response_format": with_schema({"maximum": 1.7976931348623157e308})})
    assert r.status_code == 200, r.text
    assert pipe.requests[0]["response_format"]["json_schema"]["schema"]["maximum"] > 1e308


@pytest.mark.parametrize(
    ("schema", "param"),
    [
        (b'{"maximum": Infinity}', "maximum"),
        (b'{"minimum": -Infinity}', "minimum"),
        (b'{"multipleOf": NaN}', "multipleOf"),
        (b'{"maximum": 1e400}', "maximum"),  # past the largest double: inf
        (b'{"enum": [1, 2.5, Infinity]}', "enum[2]"),
        (b'{"properties": {"a": {"default": [{"x": -Infinity}]}}}', "properties.a.default[0].x"),
    ],
)
def test_a_non_finite_number_inside_a_schema_is_a_400_naming_it(schema, param):
    raw = b'{"prompt": "x", "response_format": ' + json.dumps(with_schema(0)).encode()
    raw = raw.replace(b'"schema": 0', b'"schema": ' + schema) + b"}"
    pipe, r = post_raw(raw)
    refused(r, f"{SCHEMA}.{param}", "is not a finite number")
    assert pipe.requests == []  # never reached the pipeline


def nested(levels: int) -> dict[str, Any]:
    """A body of ``levels`` nested objects and lists in all (the body itself is one)."""
    inner: Any = {}
    for i in range(levels - 4):  # the body, response_format, json_schema, schema: 4
        inner = [inner] if i % 2 else {"a": inner}
    return {"prompt": "x", "response_format": with_schema(inner)}


def test_a_body_nested_64_levels_passes_and_65_is_a_400():
    pipe, r = post_raw(json.dumps(nested(64)).encode())
    assert r.status_code == 200, r.text
    assert pipe.requests[0]["response_format"] == nested(64)["response_format"]
    pipe, r = post_raw(json.dumps(nested(65)).encode())
    refused(r, "response_format", "nested deeper than 64 levels")
    assert pipe.requests == []
