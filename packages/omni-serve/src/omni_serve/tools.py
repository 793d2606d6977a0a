"""Tool calling in chat completions: the tools described to the model, the calls read
back from what it writes, as OpenAI answers them.

``tool_choice`` decides how a call is made:

* ``none``: the model answers in text (the tools are not described to it);
* ``required`` and a named function: the answer is held, by the structured-output
  machinery the AR stages have (a ``json`` constraint), to the JSON of a call:
  ``{"name": const, "arguments": <its parameters>}`` for one of the tools (an array of
  them, at least one, with ``parallel_tool_calls``), or the named function's arguments;
  streamed as it comes (:class:`ForcedParser`: each call's id and name once its name is
  written, then its arguments' text as the model writes it), as OpenAI streams calls;
* ``auto``: the model writes freely and the pipeline's parser (the intake's option
  ``tool_call_parser``, as vLLM names it: :data:`PARSERS`) reads the calls in what it
  wrote; what is not a well-formed call of one of the tools stays text.

The chat template sees plain messages: the tools, the assistant's earlier calls and the
tools' results are written into them here in the parser's format
(:func:`render_messages`), as the Qwen2.5 (Hermes) and Llama 3.1 templates write them.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from omni_serve.errors import bad_field

if TYPE_CHECKING:
    from omni_serve.openai_bodies import ChatRequest

log = logging.getLogger("omni.serve")

ToolMode = Literal["none", "auto", "required", "named"]
PARSER_OPTION = "tool_call_parser"  # the AR intake's option naming the parser
DEFAULT_PARSER = "hermes"
INTAKE_KINDS = ("ar.intake", "ar.mm_intake")
MAX_TOOLS = 128  # OpenAI's limit
MAX_PARAMETERS_CHARS = 65536  # a tool's parameters schema as JSON, at most (as a json_schema's)
MAX_SCHEMA_DEPTH = 64
JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's marker before a call (often dropped as special)

_HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_LLAMA3_USER = (
    "Given the following functions, please respond with a JSON for a function call with "
    "its proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tools}\n\n"
)


def call_id() -> str:
    """A tool call's id, as OpenAI's: ``call_`` and 24 random characters."""
    return f"call_{secrets.token_hex(12)}"


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A call as a message's ``tool_calls`` item (``arguments``: JSON text)."""
    args = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def parser_of(config: Any) -> str:
    """The ``tool_call_parser`` option of the pipeline's AR intake (``hermes`` where it
    sets none)."""
    for spec in config.stages:
        if spec.kind in INTAKE_KINDS:
            options = spec.options if isinstance(spec.options, dict) else {}
            return str(options.get(PARSER_OPTION) or DEFAULT_PARSER)
    return DEFAULT_PARSER


# -- checking the request's tools ---------------------------------------------------------


def check_schema(schema: Any, where: str) -> None:
    """A tool's ``parameters``: a JSON Schema object (of type ``object`` where it says a
    type), every ``type`` in it a JSON type, at most :data:`MAX_PARAMETERS_CHARS`
    characters and :data:`MAX_SCHEMA_DEPTH` deep; else a 400 naming ``where``. (What a
    grammar makes of it is checked by the AR intake, for ``required`` and named calls.)"""
    if schema.get("type", "object") != "object":
        raise bad_field(where, f"expected a schema of type 'object', got {schema['type']!r:.40}")
    size = len(json.dumps(schema))
    if size > MAX_PARAMETERS_CHARS:
        raise bad_field(where, f"{size} characters of JSON, over {MAX_PARAMETERS_CHARS}")
    todo: list[tuple[Any, str, int]] = [(schema, "$", 1)]
    while todo:
        node, at, depth = todo.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise bad_field(where, f"nested deeper than {MAX_SCHEMA_DEPTH}")
        if isinstance(node, list):
            todo.extend((v, f"{at}[{i}]", depth + 1) for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if "type" in node and not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
            raise bad_field(where, f"'type' at {at}: expected one of {sorted(JSON_TYPES)}")
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples"):  # values, not schemas
                todo.append((value, f"{at}.{key}", depth + 1))


@dataclass
class ToolPlan:
    """How a chat request uses its tools: the ``mode``, the functions by name, the
    parser reading ``auto`` answers and whether several calls may come at once."""

    mode: ToolMode
    functions: dict[str, dict[str, Any]]  # name -> {"name", "description", "parameters"}
    parser_name: str = DEFAULT_PARSER
    parallel: bool = True
    named: str | None = None

    @classmethod
    def of(cls, req: ChatRequest, parser: str = DEFAULT_PARSER) -> ToolPlan | None:
        """The plan of ``req``, its tools checked (a 400 naming the field), or None where
        it brings no tools."""
        if parser not in PARSERS:
            raise bad_field("tools", f"the pipeline's tool_call_parser {parser!r} is unknown")
        choice = req.tool_choice
        if not req.tools:
            if choice is not None and choice != "none":
                raise bad_field("tool_choice", "only allowed when 'tools' are given")
            return None
        if len(req.tools) > MAX_TOOLS:
            raise bad_field("tools", f"at most {MAX_TOOLS} tools, got {len(req.tools)}")
        functions: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(req.tools):
            f = tool.function
            if f.name in functions:
                raise bad_field(f"tools[{i}].function.name", f"{f.name!r} is given twice")
            parameters = f.parameters if f.parameters is not None else EMPTY_PARAMETERS
            check_schema(parameters, f"tools[{i}].function.parameters")
            spec = {"name": f.name, "description": f.description, "parameters": parameters}
            functions[f.name] = {k: v for k, v in spec.items() if v is not None}
        parallel = req.parallel_tool_calls is not False
        if choice is None or isinstance(choice, str):
            return cls(choice or "auto", functions, parser, parallel)
        name = choice.function.name
        if name not in functions:
            raise bad_field(
                "tool_choice.function.name", f"{name[:64]!r} is not one of the request's tools"
            )
        return cls("named", functions, parser, parallel, name)

    @property
    def forced(self) -> bool:
        """The answer is held to a call's JSON (``required``, a named function)."""
        return self.mode in ("required", "named")

    def constraint(self) -> dict[str, Any]:
        """The ``json`` constraint of a forced answer (``structured_outputs``)."""
        if self.named is not None:
            return {"json": self.functions[self.named]["parameters"]}
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions.values()
        ]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {"json": {"type": "array", "items": one, "minItems": 1} if self.parallel else one}

    def answer(self) -> ToolAnswer:
        """A reader of this request's answer, fed its text as it comes."""
        if self.forced:
            return ToolAnswer(ForcedParser(self))
        if self.mode == "auto":
            return ToolAnswer(PARSERS[self.parser_name](self))
        return ToolAnswer(CallParser(self))


# -- the prompt --------------------------------------------------------------------------


def _call_text(call: dict[str, Any], parser: str) -> str:
    """An earlier call of the assistant as the model writes one."""
    f = call["function"]
    try:
        args = json.loads(f["arguments"])
    except ValueError:
        args = f["arguments"]
    if parser == "llama3_json":
        return json.dumps({"name": f["name"], "parameters": args}, ensure_ascii=False)
    body = json.dumps({"name": f["name"], "arguments": args}, ensure_ascii=False)
    return f"{HERMES_START}\n{body}\n{HERMES_END}"


def render_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, parser: str = DEFAULT_PARSER
) -> list[dict[str, Any]]:
    """``messages`` (roles ``system``, ``user``, ``assistant`` with ``tool_calls``,
    ``tool``) as plain ones a chat template takes: with the parser's format, the tools
    described (Hermes: in the system message; Llama 3: in the first user message; not with
    ``tool_choice: none``), an assistant's calls written into its content, and the tools'
    results as a user turn of ``<tool_response>`` blocks (Hermes) or ``ipython`` turns
    (Llama 3)."""
    if plan is not None:
        parser = plan.parser_name
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content")
        if role == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c, parser) for c in m["tool_calls"]]
            sep = ";" if parser == "llama3_json" else "\n"
            text = sep.join(calls)
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif role == "tool" and parser == "llama3_json":
            out.append({"role": "ipython", "content": content})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += f"\n{block}"
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({"role": role, "content": "" if content is None else content})
    for m in out:
        m.pop("tool_results", None)
    if plan is None or plan.mode == "none":
        return out
    described = "\n".join(
        json.dumps({"type": "function", "function": f}, ensure_ascii=False)
        for f in plan.functions.values()
    )
    if parser == "llama3_json":
        for m in out:
            if m["role"] == "user" and isinstance(m["content"], str):
                m["content"] = _LLAMA3_USER.format(tools=described) + m["content"]
                break
        return out
    system = _HERMES_SYSTEM.format(tools=described)
    if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
        out[0]["content"] = f"{out[0]['content']}\n\n{system}"
        return out
    return [{"role": "system", "content": system}, *out]


# -- reading the answer ------------------------------------------------------------------


@dataclass
class CallDelta:
    """A piece of a call streamed as it is written (``delta.tool_calls[i]``): the call's
    ``index`` in the answer, its id and name the first time, then more of its arguments'
    text."""

    index: int
    arguments: str
    head: tuple[str, str] | None = None  # (id, name): the call's first delta

    def item(self) -> dict[str, Any]:
        if self.head is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        cid, name = self.head
        function = {"name": name, "arguments": self.arguments}
        return {"index": self.index, "id": cid, "type": "function", "function": function}


# text, a whole tool call (a ``tool_calls`` item) or a piece of one streamed as it comes
Piece = str | dict[str, Any] | CallDelta


@dataclass
class CallParser:
    """Reads an answer fed as it comes: :meth:`feed` and :meth:`close` give its pieces
    (text, calls) as soon as each is certain; this base class: all of it is text."""

    plan: ToolPlan
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> list[Piece]:
        return [text] if text else []

    def close(self) -> list[Piece]:
        return []

    def call(self, obj: Any, key: str = "arguments") -> dict[str, Any] | None:
        """``obj`` as a call of one of the tools, or None where it is not one: a name
        the request gave, its arguments an object; past the first call, only with
        ``parallel_tool_calls``."""
        if not isinstance(obj, dict) or set(obj) != {"name", key}:
            return None
        name, args = obj["name"], obj[key]
        if not isinstance(name, str) or name not in self.plan.functions:
            return None
        if not isinstance(args, dict) or (self.calls and not self.plan.parallel):
            return None
        out = tool_call(name, args)
        self.calls.append(out)
        return out


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


@dataclass
class _Written:
    """A forced call as the model writes it: its name once read, its arguments' text so
    far (from its opening brace), how much of that went out."""

    cid: str = field(default_factory=call_id)
    name: str | None = None
    arguments: str = ""
    sent: int = -1  # -1: not announced yet (no head sent)
    open: bool = False  # inside its arguments


class ForcedParser(CallParser):
    """``required`` / a named function: the answer is the calls' JSON (grammar-held),
    streamed as it is written: :meth:`feed` scans the JSON (strings, escapes, nesting) and
    gives each call's head (id, name) once its name is read, then its arguments' raw text
    as it comes (:class:`CallDelta`). :meth:`close` reads the whole: the calls, their
    arguments exactly the text streamed. An answer cut short (``max_tokens``) keeps the
    calls whose name was written, their arguments as far as they came, and
    :attr:`partial` is set (the finish reason stays ``length``, as OpenAI's); one cut
    before any name is text."""

    def __init__(self, plan: ToolPlan) -> None:
        super().__init__(plan)
        self.held = ""
        self.partial = False
        self.written: list[_Written] = []
        # the scan: nesting depth, inside a string (and after a backslash), the string
        # read at a call's own level, the key whose value comes next
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.string: str | None = None
        self.key: str | None = None
        self.awaiting = False
        self.level = 0 if plan.named is not None else (2 if plan.parallel else 1)

    def feed(self, text: str) -> list[Piece]:
        self.held += text
        for c in text:
            self._scan(c)
        return self._deltas()

    def _scan(self, c: str) -> None:
        cur = self.written[-1] if self.written else None
        if cur is not None and cur.open:
            cur.arguments += c
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.string is not None:
                    self._string_read(self.string)
                    self.string = None
            elif self.string is not None:
                self.string += c
            return
        at_call = self.level and self.depth == self.level and not (cur and cur.open)
        if c == '"':
            self.in_string = True
            self.string = "" if at_call else None
        elif c in "{[":
            if self.level == 0 and self.depth == 0 and c == "{":  # named: the arguments
                self.written.append(_Written(name=self.plan.named, arguments=c, open=True))
            elif self.level and self.depth == self.level - 1 and c == "{":  # a call
                self.written.append(_Written())
                self.key, self.awaiting = None, False
            elif at_call and self.awaiting and self.key == "arguments" and cur is not None:
                cur.arguments, cur.open = c, True
            self.awaiting = False
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if cur is not None and cur.open and self.depth == max(self.level, 0):
                cur.open = False
        elif at_call and c == ":":
            self.awaiting = True
        elif at_call and c == ",":
            self.key, self.awaiting = None, False

    def _string_read(self, s: str) -> None:
        """A string at a call's own level: a key, or the value of its ``name``."""
        if not self.awaiting:
            self.key = s
            return
        self.awaiting = False
        if self.key == "name" and self.written:
            self.written[-1].name = s

    def _streamable(self) -> Iterator[tuple[int, _Written]]:
        """The calls that may go out, in order: each of the request's tools (at most one
        without ``parallel_tool_calls``), up to the first that is not (yet)."""
        for i, w in enumerate(self.written):
            if w.name not in self.plan.functions or (i and not self.plan.parallel):
                return
            yield i, w

    def _deltas(self) -> list[Piece]:
        out: list[Piece] = []
        for i, w in self._streamable():
            if w.sent < 0:
                out.append(CallDelta(i, w.arguments, (w.cid, w.name or "")))
            elif len(w.arguments) > w.sent:
                out.append(CallDelta(i, w.arguments[w.sent :]))
            w.sent = len(w.arguments)
        return out

    def close(self) -> list[Piece]:
        out = self._deltas()
        value = _json(self.held)
        if self.plan.named is not None:
            value = {"name": self.plan.named, "arguments": value}
        items = value if isinstance(value, list) and self.plan.parallel else [value]
        calls = [self.call(item) for item in items]
        streamed = list(self._streamable())
        whole = bool(items) and all(calls) and len(streamed) == len(items)
        self.calls.clear()
        if not streamed:
            return [self.held] if self.held else []
        self.partial = not whole
        for _, w in streamed:  # the calls as streamed: their ids, their arguments' text
            function = {"name": w.name, "arguments": w.arguments}
            self.calls.append({"id": w.cid, "type": "function", "function": function})
        return out


class HermesParser(CallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes; the
    Qwen and SmolLM families): text is passed on until a block may start, held from there,
    and a block that closes is a call, or text again where it is not one."""

    def __init__(self, plan: ToolPlan) -> None:
        super().__init__(plan)
        self.held = ""
        self.inside = False

    def feed(self, text: str) -> list[Piece]:
        self.held += text
        out: list[Piece] = []
        while True:
            if not self.inside:
                i = self.held.find(HERMES_START)
                if i < 0:
                    keep = _partial_suffix(self.held, HERMES_START)
                    out.append(self.held[: len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep :]
                    break
                out.append(self.held[:i])
                self.held, self.inside = self.held[i + len(HERMES_START) :], True
            else:
                j = self.held.find(HERMES_END)
                if j < 0:
                    break
                body = self.held[:j]
                self.held, self.inside = self.held[j + len(HERMES_END) :], False
                out.append(self.call(_json(body)) or f"{HERMES_START}{body}{HERMES_END}")
        return [p for p in out if p]

    def close(self) -> list[Piece]:
        held, self.held = self.held, ""
        if not self.inside:
            return [held] if held else []
        # a block the model did not close before it stopped: a call if it reads as one
        return [self.call(_json(held)) or f"{HERMES_START}{held}"]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class Llama3JsonParser(CallParser):
    """Llama 3's JSON calls: an answer that is (after an optional ``<|python_tag|>``) one
    or more ``{"name": ..., "parameters" | "arguments": {...}}`` objects, separated by
    ``;``. An answer that starts otherwise is text, passed on as it comes; one that starts
    as a call is held to its end and is calls only if all of it reads as calls."""

    def __init__(self, plan: ToolPlan) -> None:
        super().__init__(plan)
        self.held = ""
        self.mode: Literal["undecided", "text", "calls"] = "undecided"

    def feed(self, text: str) -> list[Piece]:
        if self.mode == "text":
            return [text] if text else []
        self.held += text
        start = self.held.lstrip()
        if self.mode == "undecided" and start:
            maybe_tag = PYTHON_TAG.startswith(start[: len(PYTHON_TAG)])
            if start.startswith("{") or start.startswith(PYTHON_TAG) or maybe_tag:
                if start.startswith("{") or start.startswith(PYTHON_TAG):
                    self.mode = "calls"
            else:
                self.mode = "text"
                held, self.held = self.held, ""
                return [held]
        return []

    def close(self) -> list[Piece]:
        held, self.held = self.held, ""
        text = held.strip().removeprefix(PYTHON_TAG)
        calls = list(self._calls(text)) if self.mode == "calls" else []
        if calls and all(calls):
            return list(calls)  # type: ignore[arg-type]
        self.calls.clear()
        return [held] if held else []

    def _calls(self, text: str) -> Iterator[dict[str, Any] | None]:
        decoder = json.JSONDecoder()
        at = 0
        while at < len(text):
            try:
                obj, at = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                yield None
                return
            key = "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments"
            yield self.call(obj, key)
            rest = text[at:].lstrip()
            rest = rest[1:].lstrip() if rest.startswith(";") else rest
            at = len(text) - len(rest)


PARSERS: dict[str, type[CallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


@dataclass
class ToolAnswer:
    """An answer read through a :class:`CallParser`: its content deltas and its calls'
    ``delta.tool_calls`` items as they become certain (:meth:`feed`, :meth:`close`; a
    whole call at once, or a forced call piece by piece), the whole of each in
    :attr:`content` and :attr:`calls`. Whitespace around calls is not content: it is held
    until text follows, and dropped at the end of an answer with calls."""

    parser: CallParser
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    blank: str = ""  # whitespace held

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(the content delta, the ``delta.tool_calls`` items) of ``text``."""
        return self._take(self.parser.feed(text), last=False)

    def close(self) -> tuple[str, list[dict[str, Any]]]:
        """(the content delta, the ``delta.tool_calls`` items) at the end of the answer."""
        return self._take(self.parser.close(), last=True)

    def _take(self, pieces: list[Piece], last: bool) -> tuple[str, list[dict[str, Any]]]:
        text, items = "", []
        for p in pieces:
            if isinstance(p, CallDelta):
                items.append(p.item())
            elif isinstance(p, dict):
                items.append({"index": len(self.calls), **p})
                self.calls.append(p)
            elif p.strip():  # its trailing whitespace held: a call may follow it
                body = p.rstrip()
                text += self.blank + body
                self.blank = p[len(body) :]
            else:
                self.blank += p
        if last and isinstance(self.parser, ForcedParser):
            self.calls = list(self.parser.calls)  # streamed piece by piece
        if last and not self.calls:
            text, self.blank = text + self.blank, ""
        self.content.append(text)
        return text, items

    @property
    def text(self) -> str | None:
        """The message's content: None where it is only calls."""
        text = "".join(self.content)
        return None if self.calls and not text.strip() else text

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` where the answer made any (whole), else the text's ``reason``."""
        partial = isinstance(self.parser, ForcedParser) and self.parser.partial
        return "tool_calls" if self.calls and not partial else reason
