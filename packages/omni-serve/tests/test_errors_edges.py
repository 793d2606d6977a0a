"""What a client sees of each way a request ends without completing: the status, the
error body's type/code/param/message and Retry-After, from the mapping functions and,
for the ends a stage or the runtime reports, through the in-process app."""

from __future__ import annotations

import math

import pytest
from omni_core.errors import OverloadedError, UserInputError
from omni_core.events import Cancelled, Error
from omni_serve.errors import APIError, from_terminal, submit_error, user_input

from .test_app_inprocess import FakePipe, client_of, post


def error(code: str, message: str = "stage 'decode': boom", stage: str = "decode") -> Error:
    return Error(request_id="r1", stage=stage, message=message, code=code)


def seen(err: APIError) -> tuple[int, str, str | None, str | None]:
    """(status, type, code, param): what the client reads besides the message."""
    body = err.body("r1")["error"]
    return err.status, body["type"], body["code"], body["param"]


# -- param: the field a UserInputError names, under the request's own name


def test_a_renamed_field_is_named_as_the_client_sent_it():
    msg = "stage 'intake': field 'image.width': 4000 is over the limit of 2048"
    ev = error(UserInputError.code, msg, stage="intake")
    err = from_terminal(ev, {"image.width": "size"})
    assert seen(err) == (400, "invalid_request_error", "invalid_value", "size")
    assert err.message == msg
    # a field the renames do not list keeps its own name
    assert from_terminal(ev, {"image.height": "size"}).param == "image.width"


def test_a_field_without_renames_is_the_pipelines_name():
    err = user_input("field 'prompt': 80 tokens, over max_prompt_tokens=64")
    assert seen(err) == (400, "invalid_request_error", "invalid_value", "prompt")
    assert user_input("no field named here").param is None


# -- cancelled and timed out


def test_a_timed_out_request_is_a_504_and_a_cancelled_one_a_499():
    err = from_terminal(Cancelled(request_id="r1", reason="timeout"))
    assert seen(err) == (504, "timeout", "timeout", None)
    assert err.message == "the request timed out"
    err = from_terminal(Cancelled(request_id="r1", reason="cancelled"))
    assert seen(err) == (499, "cancelled", "cancelled", None)
    assert err.message == "the request was cancelled"


@pytest.mark.parametrize(
    ("reason", "status", "code"), [("timeout", 504, "timeout"), ("cancelled", 499, "cancelled")]
)
def test_the_client_gets_the_timeout_or_cancel_status(reason, status, code):
    pipe = FakePipe()
    pipe.script = lambda rid: [Cancelled(request_id=rid, stage="decode", reason=reason)]
    r = post(client_of(pipe))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == (code, code)
    assert err["request_id"] == r.headers["x-request-id"]


# -- a dead stage, a runtime failure, shutting down


def test_a_dead_stage_is_a_503_naming_the_stage():
    err = from_terminal(error("stage_dead"), request_id="abc")
    assert seen(err) == (503, "server_error", "stage_dead", None)
    assert err.message == "stage 'decode' is dead; request id abc"


def test_shutting_down_is_a_503_without_a_code():
    err = from_terminal(error("pipeline_closed"), request_id="abc")
    assert seen(err) == (503, "server_error", None, None)
    assert err.message == "the server is shutting down; request id abc"


@pytest.mark.parametrize(
    ("code", "status", "says"),
    [
        ("stage_dead", 503, "stage 'decode' is dead; request id "),
        ("pipeline_closed", 503, "the server is shutting down; request id "),
    ],
)
def test_the_client_gets_the_dead_stage_or_shutdown_status(code, status, says):
    pipe = FakePipe()
    pipe.script = lambda rid: [Error(request_id=rid, stage="decode", message="boom", code=code)]
    r = post(client_of(pipe))
    assert r.status_code == status, r.text
    rid = r.headers["x-request-id"]
    assert r.json()["error"]["message"] == says + rid and "boom" not in r.text


# -- overloaded: Retry-After in whole seconds, at least 1


@pytest.mark.parametrize(
    ("retry_after_s", "header"),
    [
        (0.0, "1"),
        (-3.0, "1"),
        (0.2, "1"),
        (1.0, "1"),
        (1.01, "2"),
        (math.inf, "1"),
        (math.nan, "1"),
    ],
)
def test_retry_after_is_a_whole_second_at_least_one(retry_after_s, header):
    err = submit_error(OverloadedError("full", retry_after_s=retry_after_s))
    assert seen(err) == (429, "rate_limit_error", "overloaded", None)
    assert err.headers == {"Retry-After": header}
    assert err.message == f"the server is overloaded; retry in {header} s"


def test_the_client_gets_retry_after_one_for_a_zero_or_endless_wait():
    pipe = FakePipe()
    client = client_of(pipe)
    for retry_after_s in (0.0, math.inf):
        pipe.refuse = OverloadedError("full", retry_after_s=retry_after_s)
        r = post(client)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"


# -- a value the pipeline cannot carry


def test_a_value_that_cannot_be_serialized_is_the_requests_400():
    err = submit_error(TypeError("Type 'set' cannot be serialized"))
    assert seen(err) == (400, "invalid_request_error", None, None)
    assert err.message == "the request holds a value the pipeline cannot carry"


@pytest.mark.parametrize(
    "exc",
    [
        TypeError("unsupported operand type(s) for +: 'int' and 'str'"),
        ValueError("Type 'set' cannot be serialized"),
        RuntimeError("cannot be serialized"),
    ],
)
def test_other_refusals_are_503s_whatever_their_text(exc):
    err = submit_error(exc, "abc")
    assert seen(err) == (503, "server_error", None, None)
    assert err.message == "the pipeline is not accepting requests; request id abc"
