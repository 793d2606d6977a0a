"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one pipeline request per
answer, read with ``Pipeline.astream``; ``stream: true`` answers with SSE chunks. A chat
that asks for audio (``modalities: ["text", "audio"]``, a pipeline that speaks) answers
as OpenAI's API does: ``message.audio`` (``id``, ``data``, ``transcript``, ``expires_at``;
``content`` null), streamed as ``delta.audio`` chunks (``transcript`` deltas, ``data``
chunks in base64 that concatenate to one file, last ``expires_at``)."""

from __future__ import annotations

import base64
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from omni_core.events import AnyEvent

from omni_serve.audio import AudioAnswer
from omni_serve.auth import require_api_key
from omni_serve.body import check_values, json_body, off_loop, parse_json
from omni_serve.media import check_images
from omni_serve.middleware import request_id_of, started_at
from omni_serve.openai_api import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    parse,
)
from omni_serve.server import Server, ServerDep, pipeline_id
from omni_serve.sse import SSEAnswer, merged, sse
from omni_serve.streams import TextState, TokenLogprob, collect, first_event
from omni_serve.tools import ToolAnswer, ToolPlan, delta_calls, parser_of

log = logging.getLogger("omni.serve")
router = APIRouter(dependencies=[Depends(require_api_key)])

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@router.post(CHAT)
async def chat_completions(request: Request, server: ServerDep) -> Response:
    return await answer(request, server, chat=True)


@router.post(COMPLETIONS)
async def completions(request: Request, server: ServerDep) -> Response:
    return await answer(request, server, chat=False)


@dataclass
class TextChunks:
    """A text request's SSE chunks: OpenAI's ``chat.completion.chunk`` (chat) or
    ``text_completion`` objects, and the usage chunk when asked for."""

    head: dict[str, Any]  # id, created, model
    rid: str
    path: str
    chat: bool
    include_usage: bool
    logprobs: bool = False
    top_logprobs: bool = False  # completions: top_logprobs is a list (else null)
    state: TextState = field(default_factory=TextState)
    opening: list[bytes] = field(default_factory=list)  # chat: the role, before any text
    offset: int = 0  # completions: the text offset of the next chunk's first token
    tools: ToolAnswer | None = None  # chat with tools: the calls read from the text
    audio: AudioAnswer | None = None  # chat with audio: the text is its transcript

    def __post_init__(self) -> None:
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            self.opening.append(self.chunk({"role": "assistant", "content": ""}, None))

    def chunk(
        self,
        delta: dict[str, Any] | str,
        finish: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
        c["delta" if self.chat else "text"] = delta
        extra = {"usage": None} if self.include_usage else {}
        return sse({**self.head, "object": self.object, "choices": [c], **extra})

    def chunks(self, _index: int, ev: AnyEvent) -> list[bytes]:
        if self.audio is not None and (data := self.audio.add(ev)):
            return self._audio({"data": base64.b64encode(data).decode()})
        delta = self.state.add(ev)
        new = self.state.new_logprobs if self.logprobs else []
        calls: list[dict[str, Any]] = []
        if self.tools is not None and delta:
            delta, calls = self.tools.feed(delta)
        if not delta and not new:
            return self._calls(calls)
        lps = None
        if self.logprobs:
            lps = (
                chat_logprobs(new)
                if self.chat
                else completion_logprobs(new, self.offset, self.top_logprobs)
            )
            self.offset += sum(len(t.token) for t in new)
        delta = delta or ""
        body: dict[str, Any] | str = {"content": delta} if self.chat else delta
        if self.audio is not None:
            body = {"audio": self.audio.delta(transcript=delta)}
        out = [*self.opening, self.chunk(body, None, lps), *self._calls(calls)]
        self.opening.clear()
        return out

    def _audio(self, fields: dict[str, Any]) -> list[bytes]:
        """A chunk of ``delta.audio`` (its id and ``fields``)."""
        assert self.audio is not None
        out = [*self.opening, self.chunk({"audio": self.audio.delta(**fields)}, None)]
        self.opening.clear()
        return out

    def _calls(self, calls: list[dict[str, Any]]) -> list[bytes]:
        """A chunk of ``delta.tool_calls`` (none without ``calls``)."""
        if not calls:
            return []
        assert self.tools is not None
        first = len(self.tools.calls) - len(calls)
        out = [*self.opening, self.chunk({"tool_calls": delta_calls(calls, first)}, None)]
        self.opening.clear()
        return out

    def closing(self) -> list[bytes]:
        finish = self.state.finish_reason
        out, self.opening = self.opening, []
        if self.tools is not None:
            text, calls = self.tools.close()
            if text:
                out.append(self.chunk({"content": text}, None))
            out.extend(self._calls(calls))
            finish = self.tools.finish_reason(finish)
        if self.audio is not None:
            out.extend(self._audio({"expires_at": self.audio.expires_at}))
        out.append(self.chunk({} if self.chat else "", finish))
        if self.include_usage:
            usage = self.state.usage()
            out.append(sse({**self.head, "object": self.object, "choices": [], "usage": usage}))
        log.info("%s: request completed", self.path, extra={"request_id": self.rid})
        return out


async def answer(request: Request, server: ServerDep, chat: bool) -> Response:
    t0 = started_at(request)
    path = CHAT if chat else COMPLETIONS
    req, preq, tools = await received(request, server, chat)
    rid = request_id_of(request)
    pid = pipeline_id(request)
    oid = f"{'chatcmpl' if chat else 'cmpl'}-{pid}"
    log.info("%s: request started (pipeline id %s)", path, pid, extra={"request_id": rid})
    stream = merged(server.pipe, [preq], [pid], server.timeout_of(req.timeout_s))
    head = {"id": oid, "created": int(time.time()), "model": server.settings.model_name}
    wants_logprobs = bool(preq.get("logprobs"))
    top = "top_logprobs" in preq
    # a forced call's schema is the tools': the intake's error about it names them
    params = {"structured_outputs.json": "tools"} if tools is not None and tools.forced else {}
    reader = tools.answer() if tools is not None and tools.mode != "none" else None
    audio = AudioAnswer() if isinstance(req, ChatRequest) and req.speak else None
    if not req.stream:
        events = (await collect(request, stream, 1, rid, params))[0]
        return complete(
            server, path, t0, rid, head, events, chat, wants_logprobs, top, reader, audio
        )
    first = await first_event(request, stream, rid, params)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    writer = TextChunks(
        head, rid, path, chat, usage, wants_logprobs, top, tools=reader, audio=audio
    )
    return SSEAnswer(server, path, t0, rid, params).response(first, stream, writer)


async def received(
    request: Request, server: Server, chat: bool
) -> tuple[ChatRequest | CompletionRequest, dict[str, Any], ToolPlan | None]:
    """The body read, parsed and checked (its bytes held against the server's body
    budget meanwhile, and dropped after), then a chat's images counted, fetched (the
    client going away cancels) and their sizes checked."""
    async with json_body(request, server.settings.max_body_bytes) as raw:
        size = len(raw)
        req, preq, tools = await off_loop(
            request, size, functools.partial(prepare, server, raw, chat)
        )
    del raw  # neither held nor counted while images are fetched
    if chat:
        await check_images(request, preq, server.settings)
    if chat and server.settings.allow_remote_images:
        await off_loop(request, size, lambda: check_values(preq))
    return req, preq, tools


def prepare(
    server: Server, raw: bytearray, chat: bool
) -> tuple[ChatRequest | CompletionRequest, dict[str, Any], ToolPlan | None]:
    """The body as the OpenAI request, the pipeline request and a chat's tool plan, every
    value checked (run by :func:`off_loop`: in a worker thread for a big body)."""
    body = parse_json(raw)
    req: ChatRequest | CompletionRequest
    tools = None
    if chat:
        req = parse(ChatRequest, body)
        server.check_model(req.model, CHAT)
        server.check_priority(req.priority)
        remote = server.settings.allow_remote_images
        limits = server.prompt_limits
        parser = parser_of(server.pipe.config)
        tools = ToolPlan.of(req, parser)
        preq = chat_request(
            req,
            server.max_tokens_limit,
            server.images,
            remote,
            limits,
            tools,
            parser,
            server.audio_in,
            server.audio_out,
        )
    else:
        req = parse(CompletionRequest, body)
        server.check_model(req.model, COMPLETIONS)
        server.check_priority(req.priority)
        preq = completion_request(req, server.max_tokens_limit, server.prompt_limits)
        if server.audio_in:  # a speech source speaks unless told not to
            preq["modalities"] = ["text"]
    check_values(preq)
    return req, preq, tools


def complete(
    server: Server,
    path: str,
    t0: float,
    rid: str,
    head: dict[str, Any],
    events: list[AnyEvent],
    chat: bool,
    logprobs: bool = False,
    top_logprobs: bool = False,
    tools: ToolAnswer | None = None,
    audio: AudioAnswer | None = None,
) -> Response:
    """The non-streaming answer: the whole text (and with ``tools`` the calls read from
    it, with ``audio`` the audio, the text its transcript), its finish reason and usage."""
    state = TextState()
    for ev in events:
        state.add(ev)
        if audio is not None:
            audio.add(ev)
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": state.finish_reason,
        "logprobs": None,
    }
    message: dict[str, Any] = {"role": "assistant", "content": state.text}
    if tools is not None:
        tools.feed(state.text)
        tools.close()
        message["content"] = tools.text
        if tools.calls:
            message["tool_calls"] = tools.calls
        choice["finish_reason"] = tools.finish_reason(state.finish_reason)
    if audio is not None:
        message.update(content=None, audio=audio.message(state.text))
    if logprobs:
        lps = state.logprobs
        choice["logprobs"] = (
            chat_logprobs(lps) if chat else completion_logprobs(lps, 0, top_logprobs)
        )
    if chat:
        choice["message"] = message
    else:
        choice["text"] = state.text
    log.info("%s: request completed", path, extra={"request_id": rid})
    obj = "chat.completion" if chat else "text_completion"
    server.observe(path, 200, t0)
    return JSONResponse({**head, "object": obj, "choices": [choice], "usage": state.usage()})


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: each token's text, logprob and UTF-8 bytes, and its
    ``top_logprobs`` alternatives in the same shape (empty unless asked for)."""
    content = [
        {**_token(t.token, t.logprob), "top_logprobs": [_token(a, lp) for a, lp in t.top]}
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokens: list[TokenLogprob], offset: int, top: bool = False
) -> dict[str, Any]:
    """A (legacy) completion choice's ``logprobs``; ``offset``: of the first token in
    the whole completion text; ``top``: the request's ``logprobs`` was N > 0, so
    ``top_logprobs`` holds a ``{text: logprob}`` per token (tokens of equal text keep
    the likelier), else null."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    tops: list[dict[str, float]] | None = None
    if top:
        tops = [{} for _ in tokens]
        for t, alternatives in zip(tokens, tops, strict=True):
            for a, lp in t.top:
                alternatives.setdefault(a, lp)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
