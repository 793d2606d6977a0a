"""``omni bench serve --constraint``: its pure parts (no servers): the arguments, the
request both servers get, the vLLM command lines and the counting of valid answers."""

from __future__ import annotations

import json
import math

import pytest
from omni_bench.prompts import PROMPTS
from omni_bench.serve import (
    OMNI_STRUCTURED_OUTPUTS,
    compare,
    parse_args,
    valid_share,
    vllm_command,
)
from omni_bench.serve_load import (
    PERSON_SCHEMA,
    WEATHER_TOOL,
    classify,
    classify_calls,
    count_verdicts,
    request_body,
)


def test_constraint_argument():
    assert parse_args([]).constraint == "none"  # today's behaviour by default
    args = parse_args(["--constraint", "json_schema", "--concurrency", "1,8"])
    assert args.constraint == "json_schema" and args.levels == [1, 8]
    with pytest.raises(SystemExit):
        parse_args(["--constraint", "regex"])
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "x"])


def test_request_without_constraint_is_unchanged():
    body = request_body(9, 64)
    assert body["extra_body"] == {"ignore_eos": True} and body["max_tokens"] == 64
    assert "response_format" not in body
    assert body["messages"] == [{"role": "user", "content": PROMPTS[9 % len(PROMPTS)]}]


def test_structured_request():
    body = request_body(2, 48, "json_schema")
    # no ignore_eos: past the finished grammar vLLM samples unconstrained text
    assert "extra_body" not in body and body["max_tokens"] == 48
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == PERSON_SCHEMA
    assert body["stream_options"] == {"include_usage": True}  # tokens from usage
    assert body["temperature"] == 0
    with pytest.raises(ValueError):
        request_body(0, 8, "yaml")


def test_tool_request_requires_a_call_of_its_one_tool():
    body = request_body(3, 32, "tools")
    assert body["tools"] == [WEATHER_TOOL] and body["tool_choice"] == "required"
    assert "extra_body" not in body and "response_format" not in body
    assert parse_args(["--constraint", "tools"]).constraint == "tools"


def test_classify_calls():
    good = {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}
    assert classify_calls({0: good}, "tool_calls") == "valid"
    assert classify_calls({0: good, 1: good}, "tool_calls") == "valid"  # parallel calls
    assert classify_calls({}, "stop") == "invalid"  # no call at all
    other = {**good, "name": "get_time"}
    assert classify_calls({0: good, 1: other}, "tool_calls") == "invalid"
    bad_unit = {**good, "arguments": '{"city": "Oslo", "unit": "kelvin"}'}
    assert classify_calls({0: bad_unit}, "tool_calls") == "invalid"
    cut = {**good, "arguments": '{"city": "Os'}
    assert classify_calls({0: cut}, "length") == "cut"
    assert classify_calls({0: cut}, "tool_calls") == "invalid"


def test_the_tool_is_one_omni_accepts():
    from omni_ar.structured import check_constraint

    schema = WEATHER_TOOL["function"]["parameters"]
    assert check_constraint({"json": schema}) == {"json": schema}


def test_schema_is_one_omni_accepts():
    from omni_ar.params import check_response_format
    from omni_ar.structured import check_constraint

    fmt = request_body(0, 8, "json_schema")["response_format"]
    check_response_format(fmt)  # raises on a body omni's intake would refuse
    assert check_constraint({"json": PERSON_SCHEMA}) == {"json": PERSON_SCHEMA}


def test_vllm_commands():
    default = vllm_command("/m", 8000)
    assert "--structured-outputs-config" not in default
    assert not {"--dtype", "--enforce-eager"} & set(default)  # vLLM's own choices
    assert default[-2:] == ["--gpu-memory-utilization", "0.5"]  # what its error asks for
    base = default[:-2]
    same = vllm_command("/m", 8000, OMNI_STRUCTURED_OUTPUTS)
    i = same.index("--structured-outputs-config")
    assert json.loads(same[i + 1]) == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert same[:i] == base
    tuned = vllm_command("/m", 8000, dtype="bfloat16")
    assert tuned[: len(base)] == base
    flags = ["--enforce-eager", "--dtype", "bfloat16", "--disable-log-stats"]
    assert tuned[len(base) :] == flags


def test_classify():
    ok = '{"name":"Ada","age":36,"tags":["math"]}'
    assert classify(ok, "stop", PERSON_SCHEMA) == "valid"
    assert classify(ok, "length", PERSON_SCHEMA) == "valid"  # whole at the last token
    assert classify('{"name":"Ada","age":3', "length", PERSON_SCHEMA) == "cut"
    assert classify('{"name":"Ada","age":3', "stop", PERSON_SCHEMA) == "invalid"
    assert classify('{"name":"Ada","age":360,"tags":["x"]}', "stop", PERSON_SCHEMA) == "invalid"
    extra = '{"name":"Ada","age":36,"tags":["x"],"z":1}'
    assert classify(extra, "stop", PERSON_SCHEMA) == "invalid"
    assert classify(ok + " trailing", "stop", PERSON_SCHEMA) == "invalid"


def test_counting():
    assert count_verdicts([None, None]) == {}
    counts = count_verdicts(["valid", "cut", "valid", "invalid"])
    assert counts == {"valid": 2, "invalid": 1, "cut": 1}
    levels = {"c1": {"tok_per_s": 1.0, **counts}, "c8": {"valid": 4, "invalid": 0, "cut": 0}}
    share = valid_share(levels)
    assert share == {"valid_share": 0.75, "cut_share": 0.125, "valid_share_of_uncut": 0.857}
    assert math.isnan(valid_share({"c1": {"valid": 0, "invalid": 0, "cut": 0}})["valid_share"])


def test_compare_names_both_baselines():
    omni = {"c1": {"tok_per_s": 9.0, "ttft_p50_ms": 100.0}}
    same = {"c1": {"tok_per_s": 10.0, "ttft_p50_ms": 100.0}}
    default = {"c1": {"tok_per_s": 12.0, "ttft_p50_ms": 50.0}}
    res: dict = {}
    targets: dict = {}
    compare(res, targets, omni, same, [1])
    compare(res, targets, omni, default, [1], "vllm_default")
    assert res == {
        "omni_vs_vllm_tok_per_s_c1": 0.9,
        "omni_vs_vllm_ttft_p50_c1": 1.0,
        "omni_vs_vllm_default_tok_per_s_c1": 0.75,
        "omni_vs_vllm_default_ttft_p50_c1": 2.0,
    }
    assert targets["tok_per_s_c1 >= 0.9 x vllm"] is True
    assert targets["tok_per_s_c1 >= 0.9 x vllm_default (vLLM at its defaults)"] is False
    assert targets["ttft_p50_c1 <= 1.25 x vllm_default (vLLM at its defaults)"] is False
    compare(res, targets, omni, {"c1": {"tok_per_s": 9.0, "ttft_p50_ms": 100.0}}, [1], "x", 1.0)
    assert targets["tok_per_s_c1 >= 1 x x (vLLM at its defaults)"] is True  # at the target


def test_the_tools_arm_times_the_first_calls_name():
    """A streamed answer's verdict and the time to its first call's name, read from the
    chunks as the openai client parses them (a fake client: role, head, arguments)."""
    import asyncio
    import time

    from omni_bench.serve_load import drive_client
    from openai.types.chat import ChatCompletionChunk

    def chunk(delta: dict, finish: str | None = None) -> ChatCompletionChunk:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        return ChatCompletionChunk.model_validate({**body, "choices": [choice]})

    head = {"index": 0, "id": "call_1", "type": "function"}
    head["function"] = {"name": "get_weather", "arguments": '{"city": "Oslo", '}
    rest = {"index": 0, "function": {"arguments": '"unit": "celsius"}'}}
    script = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [head]}),
        chunk({"tool_calls": [rest]}),
        chunk({}, "tool_calls"),
        ChatCompletionChunk.model_validate(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [],
                "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
            }
        ),
    ]

    class Completions:
        async def create(self, **_):
            async def stream():
                for c in script:
                    time.sleep(0.01)
                    yield c

            return stream()

    class Client:
        chat = type("Chat", (), {"completions": Completions()})()

        async def close(self) -> None:
            pass

    out = asyncio.run(drive_client(Client(), 1, 2, 48, "tools"))
    assert out["valid"] == 2 and out["named_calls"] == 2
    assert 15 <= out["first_call_p50_ms"] < out["ttft_p50_ms"] + 1000
    assert out["ttft_p50_ms"] < out["first_call_p50_ms"]  # the role chunk came first
