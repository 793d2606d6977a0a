"""Tool calling over HTTP with the ``openai`` client against ``omni serve
configs/ar_chat.yaml`` (SmolLM2): ``required`` and a named function give calls whose
arguments hold to the tool's schema, streamed and not (the chunks reassemble to the same
call), ``none`` gives text, a tool's result fed back is taken, and bad tools are 400s
naming the field."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest

from .conftest import Server, start_server, stop_server

pytest.importorskip("transformers")
from omni_ar.models import packaged_model_ready  # noqa: E402

pytestmark = pytest.mark.skipif(
    not packaged_model_ready("smollm2"), reason="SmolLM2 is not pulled (`hatch run setup`)"
)
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ar_chat.yaml"
WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_ARGS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
KW: dict[str, Any] = {"model": "ar_chat", "temperature": 0, "max_tokens": 80}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``configs/ar_chat.yaml`` with SmolLM2 as this process resolves it (a directory): the
    server's cache is a fresh one (``start_server``), which could only convert the model
    where its package is installed."""
    import yaml
    from omni_ar.models import resolve_model

    cfg = yaml.safe_load(CONFIG.read_text())
    path = resolve_model("smollm2")
    for stage in cfg["stages"]:
        if stage["options"].get("model") == "smollm2":
            stage["options"] = {**stage["options"], "model": path}
    s = start_server(cfg, tmp_path_factory.mktemp("tools-server"))
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def check_calls(calls: list[Any], names: set[str] | None = None) -> list[tuple[str, Any]]:
    """Each call's (name, arguments), its id OpenAI-shaped and its arguments valid under
    its tool's schema."""
    out = []
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        assert names is None or c.function.name in names
        out.append((c.function.name, args))
    assert len({c.id for c in calls}) == len(calls)
    return out


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str | None, list[dict[str, Any]], str]:
    """(content, calls reassembled from ``delta.tool_calls`` by index, finish reason)."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls(client, parallel):
    kw = {**KW, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    kw["parallel_tool_calls"] = parallel
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None and choice.message.tool_calls
    calls = check_calls(choice.message.tool_calls)
    assert parallel or len(calls) == 1
    content, chunks, finish = streamed(client, **kw)
    assert finish == "tool_calls" and content is None
    again = [(c["name"], json.loads(c["arguments"])) for c in chunks]
    assert again == calls  # greedy: the same calls, reassembled from the chunks
    assert all(c["id"].startswith("call_") for c in chunks)


def test_a_named_function(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = {**KW, "messages": ASK, "tools": TOOLS, "tool_choice": choice}
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls"
    [(name, args)] = check_calls(out.message.tool_calls)
    assert name == "get_weather" and set(args) == {"city", "unit"}
    content, chunks, finish = streamed(client, **kw)
    assert finish == "tool_calls" and content is None
    assert [(c["name"], json.loads(c["arguments"])) for c in chunks] == [(name, args)]


def test_n_choices_each_make_valid_calls(client):
    """``n`` with ``required``: each choice its own calls (their own ids), valid under the
    schemas, whole and streamed (reassembled by choice and call index)."""
    kw = {**KW, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    kw.update(n=2, seed=5, temperature=0.8)
    out = client.chat.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1]
    whole = []
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c.message
        whole.append(check_calls(c.message.tool_calls))
    ids = [t.id for c in out.choices for t in c.message.tool_calls]
    assert len(set(ids)) == len(ids)
    calls: dict[int, dict[int, dict[str, str]]] = {0: {}, 1: {}}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = calls[c.index].setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish[c.index] = c.finish_reason or finish.get(c.index, "")
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for i in range(2):  # seeded: the same calls, streamed
        again = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls[i].items())]
        assert again == whole[i]


def test_a_forced_call_streams_its_arguments_as_written(client):
    """A named function's arguments go out over several chunks, its id and name in the
    first, before the answer ends (not one chunk at the end)."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = {**KW, "messages": ASK, "tools": TOOLS, "tool_choice": choice}
    pieces = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            pieces.append(d)
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert len([p for p in pieces if p.function.arguments]) > 3
    args = json.loads("".join(p.function.arguments or "" for p in pieces))
    jsonschema.validate(args, WEATHER_ARGS)


def test_a_forced_call_cut_short_is_a_partial_call(client):
    """Cut by ``max_tokens``, a named call keeps its arguments as far as they came, with
    ``finish_reason: length`` (as OpenAI and vLLM answer), whole and streamed alike."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = {**KW, "max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": choice}
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "length" and out.message.content is None
    (call,) = out.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    content, chunks, finish = streamed(client, **kw)
    assert finish == "length" and content is None
    assert [c["arguments"] for c in chunks] == [call.function.arguments]


def test_none_gives_text(client):
    out = client.chat.completions.create(
        **{**KW, "max_tokens": 16}, messages=ASK, tools=TOOLS, tool_choice="none"
    )
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_answers_text_or_valid_calls(client):
    """Whatever SmolLM2 writes in ``auto``: text, or calls of the tools whose arguments
    are JSON objects (never a 500), streamed the same."""
    kw = {**KW, "messages": ASK, "tools": TOOLS}
    choice = client.chat.completions.create(**kw).choices[0]
    content, chunks, finish = streamed(client, **kw)
    assert finish == choice.finish_reason and content == choice.message.content
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == [c["name"] for c in chunks]
    assert (finish == "tool_calls") == bool(calls)
    for c in calls:
        assert isinstance(json.loads(c.function.arguments), dict)


def test_a_tool_result_fed_back(client):
    first = client.chat.completions.create(
        **KW, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    ).choices[0]
    call = first.message.tool_calls[0]
    messages = [
        *ASK,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    out = client.chat.completions.create(
        **{**KW, "max_tokens": 24}, messages=messages, tools=TOOLS, tool_choice="none"
    )
    assert out.choices[0].message.content
    assert out.usage.prompt_tokens > 100  # the tools' result (and the earlier call) were read


def bad(client: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{**KW, "messages": ASK, **kw})
    return e.value.body


def test_bad_tools_are_400s_naming_the_field(client):
    schema = {"type": "object", "properties": {"a": {"type": "text"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = bad(client, tools=tools)
    assert body["param"] == "tools[0].function.parameters" and "'type'" in body["message"]
    body = bad(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}})
    assert body["param"] == "tool_choice.function.name" and "'g'" in body["message"]
    body = bad(client, tools=[{"type": "function", "function": {"name": "a b"}}])
    assert body["param"] == "tools[0].function.name"
    # a schema only the grammar backend refuses: the intake's 400, naming the tools
    odd = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": odd}}]
    body = bad(client, tools=tools, tool_choice="required")
    assert body["param"] == "tools" and "multipleOf" in body["message"]
    body = bad(client, tool_choice="required")
    assert body["param"] == "tool_choice"


@pytest.mark.parametrize("streamed_turn", [False, True])
def test_a_langchain_agent_loop(server, streamed_turn):
    """An agent loop as a user writes it with langchain-openai (not ours): the chat model
    bound to a Python tool calls it with arguments its schema takes, the tool runs, its
    result goes back as a ToolMessage, and the model answers from it."""
    if os.environ.get("CI") is None:  # (CI installs it: there the test must run)
        pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    ran: list[tuple[str, str]] = []

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city."""
        ran.append((city, unit))
        return json.dumps({"temperature": 21, "sky": "clear", "unit": unit})

    llm = ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",
        model="ar_chat",
        temperature=0,
        max_tokens=80,
        max_retries=0,
    )
    messages: list[Any] = [HumanMessage("What is the weather like in Paris today?")]
    agent = llm.bind_tools([get_weather], tool_choice="get_weather")
    if streamed_turn:  # the chunks add up to the calls (langchain merges tool_call_chunks)
        ai: Any = None
        for chunk in agent.stream(messages):
            ai = chunk if ai is None else ai + chunk
    else:
        ai = agent.invoke(messages)
    assert isinstance(ai, AIMessage) and ai.tool_calls and not ai.invalid_tool_calls
    messages.append(ai)
    for call in ai.tool_calls:  # each call run by the tool itself: its arguments validated
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        messages.append(get_weather.invoke(call))  # a ToolMessage with the call's id
    assert len(ran) == len(ai.tool_calls) and all(u in ("celsius", "fahrenheit") for _, u in ran)
    answer = llm.bind_tools([get_weather], tool_choice="none")
    final = answer.invoke(messages)
    assert final.content and not final.tool_calls
    assert final.response_metadata["finish_reason"] in ("stop", "length")
    used = final.response_metadata["token_usage"]["prompt_tokens"]
    asked = answer.invoke(messages[:1]).response_metadata["token_usage"]["prompt_tokens"]
    assert used > asked + 20  # the call and the tool's result were read
