"""Structured logs: request id, stage and sequence on every record that has them."""

import json
import logging

from omni_core.observability.logs import JsonFormatter, TextFormatter


def record(**extra):
    r = logging.LogRecord("omni.worker", logging.ERROR, __file__, 1, "failed %s", ("x",), None)
    r.__dict__.update(extra)
    return r


def test_json_lines_carry_the_request_fields():
    line = JsonFormatter().format(record(request_id="r1", stage="decode", sequence=3))
    out = json.loads(line)
    assert out["message"] == "failed x" and out["level"] == "ERROR"
    assert (out["request_id"], out["stage"], out["sequence"]) == ("r1", "decode", 3)
    assert "request_id" not in json.loads(JsonFormatter().format(record()))


def test_text_lines_append_them_as_key_value():
    line = TextFormatter().format(record(request_id="r1", stage="decode"))
    assert line.endswith("failed x request_id=r1 stage=decode")
