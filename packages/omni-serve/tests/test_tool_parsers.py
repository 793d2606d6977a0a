"""omni_serve.tools without a server: the tools checked where the body is parsed, the
messages a chat template gets, and each parser (Hermes, Llama 3 JSON, the forced calls'
JSON) fed whole and character by character, a malformed call coming back as text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from omni_serve.errors import APIError
from omni_serve.openai_api import ChatRequest, chat_request, parse
from omni_serve.tools import HERMES_START, ToolAnswer, ToolPlan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def plan(mode: str = "auto", parser: str = "hermes", **body: Any) -> ToolPlan:
    choice = mode if mode != "named" else {"type": "function", "function": {"name": "get_time"}}
    req = parse(
        ChatRequest, {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": choice, **body}
    )
    out = ToolPlan.of(req, parser)
    assert out is not None
    return out


def read(p: ToolPlan, text: str, step: int | None = None) -> tuple[ToolAnswer, list[str]]:
    """``text`` through ``p``'s reader, fed whole or ``step`` characters at a time; the
    content deltas it gave."""
    answer = p.answer()
    step = step or len(text) or 1
    deltas = [answer.feed(text[i : i + step])[0] for i in range(0, len(text), step)]
    deltas.append(answer.close()[0])
    return answer, [d for d in deltas if d]


def args(answer: ToolAnswer) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.calls]


@pytest.mark.parametrize("step", [None, 1, 3])
def test_hermes_calls(step):
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    answer, deltas = read(plan(), text, step)
    assert args(answer) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert answer.text == "Let me check." == "".join(deltas)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in answer.calls)
    assert len({c["id"] for c in answer.calls}) == 2
    assert answer.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("step", [None, 1])
@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not one of the tools
        '<tool_call>{"name": "get_time", "arguments": "x"}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {}, "x": 1}</tool_call>',
        '<tool_call>{"name": "get_weather", "arg',  # cut short
        "a < b and <tool_ca",  # a start that never came
        "plain text, no call",
    ],
)
def test_hermes_malformed_is_text(text, step):
    answer, deltas = read(plan(), text, step)
    assert answer.calls == [] and answer.text == text == "".join(deltas)
    assert answer.finish_reason("length") == "length"


def test_hermes_an_unclosed_block_that_reads_as_a_call():
    answer, _ = read(plan(), '<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert args(answer) == [("get_time", {})] and answer.text is None


def test_hermes_one_call_without_parallel_tool_calls():
    block = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    answer, _ = read(plan(parallel_tool_calls=False), block + block)
    assert len(answer.calls) == 1 and answer.text == block


@pytest.mark.parametrize("step", [None, 1])
def test_llama3_json_calls(step):
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "arguments": {}}'
    )
    answer, deltas = read(plan(parser="llama3_json"), text, step)
    assert args(answer) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert answer.text is None and deltas == []


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny in Oslo.",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}} and more',
        '{"name": "nope", "parameters": {}}',
        '{"name": "get_weather", "parameters": {"city": ',
        '{"answer": 42}',
    ],
)
def test_llama3_json_malformed_is_text(text):
    for step in (None, 1):
        answer, deltas = read(plan(parser="llama3_json"), text, step)
        assert answer.calls == [] and answer.text == text == "".join(deltas)


def test_plain_text_streams_at_once():
    answer = plan(parser="llama3_json").answer()
    assert answer.feed("It is")[0] == "It is"
    answer = plan().answer()
    assert answer.feed("It is <")[0] == "It is"  # "<" may start a call; " " waits for text


def test_forced_calls():
    required = plan("required")
    answer, _ = read(required, '[{"name":"get_weather","arguments":{"city":"Rome"}}]', 2)
    assert args(answer) == [("get_weather", {"city": "Rome"})]
    single = plan("required", parallel_tool_calls=False)
    answer, _ = read(single, '{"name":"get_time","arguments":{}}')
    assert args(answer) == [("get_time", {})]
    answer, _ = read(plan("named"), "{}")
    assert args(answer) == [("get_time", {})] and answer.text is None
    answer, _ = read(required, '[{"name":"get_wea')  # max_tokens cut it before a name
    assert answer.calls == [] and answer.text == '[{"name":"get_wea'
    assert answer.finish_reason("length") == "length"


def streamed_items(p: ToolPlan, text: str, step: int) -> tuple[ToolAnswer, list[dict]]:
    answer = p.answer()
    items = []
    for i in range(0, len(text), step):
        items.extend(answer.feed(text[i : i + step])[1])
    items.extend(answer.close()[1])
    return answer, items


def merged(items: list[dict]) -> dict[int, dict]:
    """The calls the ``delta.tool_calls`` items add up to, as a client merges them."""
    calls: dict[int, dict] = {}
    for d in items:
        c = calls.setdefault(d["index"], {"id": "", "name": "", "arguments": ""})
        c["id"] += d.get("id", "")
        c["name"] += d["function"].get("name", "")
        c["arguments"] += d["function"]["arguments"]
    return calls


ARGS = '{"city": "Ro\\"me}, [x]", "n": {"a": [1, {"b": "}"}]}}'


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize(
    ("mode", "body", "text"),
    [
        (
            "required",
            {},
            f'[{{"name": "get_weather", "arguments": {ARGS}}}, '
            '{"name":"get_time","arguments":{}}]',
        ),
        (
            "required",
            {"parallel_tool_calls": False},
            f'{{"name": "get_weather", "arguments": {ARGS}}}',
        ),
        ("named", {}, f"  {ARGS}"),
    ],
)
def test_forced_calls_stream_as_written(mode, body, text, step):
    """A forced answer's calls go out piece by piece: each call's id and name first (once
    its name is read), then its arguments' text as written; the pieces add up to the
    calls :meth:`close` gives, whatever the feeding (strings holding braces, quotes and
    escapes included)."""
    answer, items = streamed_items(plan(mode, **body), text, step)
    calls = merged(items)
    assert [c["function"]["name"] for c in answer.calls] == [
        calls[i]["name"] for i in sorted(calls)
    ]
    for i, c in enumerate(answer.calls):
        assert calls[i]["id"] == c["id"] and calls[i]["arguments"] == c["function"]["arguments"]
        json.loads(c["function"]["arguments"])
    assert answer.finish_reason("stop") == "tool_calls" and answer.text is None
    heads = [d for d in items if "id" in d]
    assert len(heads) == len(answer.calls) and all(d["type"] == "function" for d in heads)
    assert all(d["function"]["arguments"] for d in items if "id" not in d)  # no empty pieces
    if step == 1:  # the arguments go out before the call ends
        first_args = next(i for i, d in enumerate(items) if d["function"]["arguments"])
        assert first_args < len(items) - 2


def test_a_forced_call_cut_short_keeps_what_was_written():
    text = '[{"name": "get_weather", "arguments": {"city": "Ro'
    answer, items = streamed_items(plan("required"), text, 3)
    (call,) = answer.calls
    assert call["function"]["arguments"] == '{"city": "Ro' == merged(items)[0]["arguments"]
    assert answer.finish_reason("length") == "length" and answer.text is None


def test_a_forced_call_of_no_tool_is_text():
    text = '{"name": "rm_rf", "arguments": {}}'
    answer, items = streamed_items(plan("required", parallel_tool_calls=False), text, 1)
    assert items == [] and answer.calls == [] and answer.text == text


def test_forced_constraints():
    schema = plan("required").constraint()["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    one = plan("required", parallel_tool_calls=False).constraint()["json"]
    assert "anyOf" in one
    assert plan("named").constraint() == {"json": {"type": "object", "properties": {}}}


def test_messages_for_the_template():
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {
                "role": "tool",
                "tool_call_id": "call_2",
                "content": [{"type": "text", "text": "9am"}],
            },
        ],
        "tools": [WEATHER, TIME],
    }
    req = parse(ChatRequest, body)
    msgs = chat_request(req, None, tools=ToolPlan.of(req))["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert (
        msgs[0]["content"].startswith("Be brief.\n\n# Tools") and "get_time" in msgs[0]["content"]
    )
    assert msgs[2]["content"].startswith(HERMES_START) and '"city": "Paris"' in msgs[2]["content"]
    assert (
        msgs[3]["content"]
        == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n9am\n</tool_response>"
    )
    assert all(isinstance(m["content"], str) for m in msgs)
    req = parse(ChatRequest, {**body, "tool_choice": "none"})
    msgs = chat_request(req, None, tools=ToolPlan.of(req, "llama3_json"), parser="llama3_json")
    assert [m["role"] for m in msgs["messages"]] == [
        "system",
        "user",
        "assistant",
        "ipython",
        "ipython",
    ]
    assert "Tools" not in msgs["messages"][0]["content"]  # none: not described


def bad(body: dict[str, Any], parser: str = "hermes") -> APIError:
    with pytest.raises(APIError) as e:
        req = parse(ChatRequest, {"messages": USER, **body})
        chat_request(req, None, tools=ToolPlan.of(req, parser))
    assert e.value.status == 400
    return e.value


def fn(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [fn(name="bad name!")]}, "tools[0].function.name"),
        ({"tools": [fn(name="x" * 65)]}, "tools[0].function.name"),
        ({"tools": [fn(parameters="{}")]}, "tools[0].function.parameters"),
        ({"tools": [fn(parameters={"type": "string"})]}, "tools[0].function.parameters"),
        (
            {"tools": [fn(parameters={"type": "object", "properties": {"a": {"type": "str"}}})]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [fn(parameters={"type": "object", "description": "x" * 70000})]},
            "tools[0].function.parameters",
        ),
        ({"tools": [fn(), fn()]}, "tools[1].function.name"),
        ({"tools": [fn()], "tool_choice": "any"}, "tool_choice"),
        (
            {"tools": [fn()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [fn()], "parallel_tool_calls": 1}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {
                "tools": [fn()],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
    ],
)
def test_bad_tools_name_the_field(body, param):
    assert bad(body).param == param


def test_the_role_chunk_goes_out_with_the_first_token_of_a_held_call():
    """A streamed chat whose text a reader holds (a forced call whose name is not read
    yet) still sends its role chunk at the first token, as vLLM's server does; the call
    head follows once the name is read."""
    from omni_core.events import Segment
    from omni_serve.routes.text import TextChunks

    chunks = TextChunks({"id": "x", "created": 0, "model": "m"}, "rid", "/v1/chat", True, False)
    chunks.tools = plan("required").answer()

    def text(t: str) -> list[dict]:
        ev = Segment(request_id="r", tokens=[1], payload={"text": t})
        return [json.loads(b.decode()[len("data: ") :]) for b in chunks.chunks(0, ev)]

    (role,) = text('[{"')
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert text("name") == []  # nothing more to show yet
    (head,) = text('": "get_time", "arguments": {')
    call = head["choices"][0]["delta"]["tool_calls"][0]
    assert call["function"] == {"name": "get_time", "arguments": "{"} and call["index"] == 0


def test_a_call_whose_name_follows_its_arguments_goes_out_whole_once_named():
    """Where the model writes ``arguments`` before ``name`` (a grammar need not order
    them), nothing goes out until the name is read; then the head carries the arguments
    written so far."""
    text = '{"arguments": {"city": "Rome"}, "name": "get_weather"}'
    answer, items = streamed_items(plan("required", parallel_tool_calls=False), text, 1)
    (head,) = items
    assert head["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert args(answer) == [("get_weather", {"city": "Rome"})]
