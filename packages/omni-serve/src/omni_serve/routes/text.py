"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one pipeline request per
choice (``n`` of them: vLLM's ``n``, see :func:`omni_serve.openai_api.text_choices`), read
with ``Pipeline.astream`` and merged into one answer; ``stream: true`` answers with SSE
chunks, each carrying its choice's ``index``. One choice failing (or the client going
away) cancels the others and the answer is that error, never the choices that did end. A chat
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
from omni_core.events import AnyEvent, Completed

from omni_serve.audio import AudioAnswer
from omni_serve.auth import require_api_key
from omni_serve.body import check_values, json_body, off_loop, parse_json
from omni_serve.errors import bad_field
from omni_serve.media import check_images
from omni_serve.middleware import request_id_of, started_at
from omni_serve.openai_api import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    check_choices,
    completion_requests,
    parse,
    prompts_of,
    text_choices,
)
from omni_serve.server import Server, ServerDep, pipeline_id
from omni_serve.shares import CLIENT
from omni_serve.sse import SSEAnswer, merged, sse
from omni_serve.streams import TextState, TokenLogprob, clamp_logprob, collect, first_event
from omni_serve.tools import ToolAnswer, ToolPlan, parser_of

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
    """One choice's SSE chunks: OpenAI's ``chat.completion.chunk`` (chat) or
    ``text_completion`` objects with its ``index`` (the usage chunk: :class:`TextChoices`)."""

    head: dict[str, Any]  # id, created, model
    rid: str
    path: str
    chat: bool
    include_usage: bool
    logprobs: bool = False
    top_logprobs: bool = False  # completions: top_logprobs is a list (else null)
    index: int = 0  # the choice's
    state: TextState = field(default_factory=TextState)
    opening: list[bytes] = field(default_factory=list)  # chat: the role, before any text
    offset: int = 0  # completions: the text offset of the next chunk's first token
    tools: ToolAnswer | None = None  # chat with tools: the calls read from the text
    audio: AudioAnswer | None = None  # chat with audio: the text is its transcript
    echo: str | None = None  # a completion's prompt, until its first chunk carried it

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
        c: dict[str, Any] = {"index": self.index, "finish_reason": finish, "logprobs": logprobs}
        c["delta" if self.chat else "text"] = delta
        extra = {"usage": None} if self.include_usage else {}
        return sse({**self.head, "object": self.object, "choices": [c], **extra})

    def chunks(self, _index: int, ev: AnyEvent) -> list[bytes]:
        if self.audio is not None and (data := self.audio.add(ev)):
            return self._audio({"data": base64.b64encode(data).decode()})
        delta = self.state.add(ev)
        generated = delta is not None  # a text event: the answer has begun
        new = self.state.new_logprobs if self.logprobs else []
        if self.echo is not None and delta is not None:  # the first text: the prompt first
            delta, self.echo = self.echo + delta, None
            if self.logprobs:
                new = echoed(self.state) + new
        calls: list[dict[str, Any]] = []
        if self.tools is not None and delta:
            delta, calls = self.tools.feed(delta)
        if not delta and not new:
            # the role chunk goes out with the first token, as vLLM's does, even where
            # a reader holds the text (a call not read yet)
            out = self._calls(calls)
            if not out and generated:
                out, self.opening = self.opening, []
            return out
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
        """A chunk of ``delta.tool_calls`` (``calls``: its items; none without them)."""
        if not calls:
            return []
        out = [*self.opening, self.chunk({"tool_calls": calls}, None)]
        self.opening.clear()
        return out

    def finish(self) -> list[bytes]:
        """The choice's last chunks: what its readers held back, then its finish reason."""
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
        return out


@dataclass
class TextChoices:
    """A text request's SSE chunks: each choice's (:class:`TextChunks`), its finish reason
    as soon as it ends, and after the last one the usage chunk of them all, when asked for
    (:func:`usage`)."""

    choices: list[TextChunks]
    n: int = 1  # choices a prompt (the request's n)
    ended: set[int] = field(default_factory=set)

    def chunks(self, index: int, ev: AnyEvent) -> list[bytes]:
        choice = self.choices[index]
        out = choice.chunks(index, ev)
        if isinstance(ev, Completed) and index not in self.ended:
            self.ended.add(index)
            out.extend(choice.finish())
        return out

    def closing(self) -> list[bytes]:
        out = []
        for i, choice in enumerate(self.choices):
            if i not in self.ended:  # its stream ended without saying so
                out.extend(choice.finish())
        first = self.choices[0]
        if first.include_usage:
            total = usage([c.state for c in self.choices], self.n)
            out.append(sse({**first.head, "object": first.object, "choices": [], "usage": total}))
        log.info("%s: request completed", first.path, extra={"request_id": first.rid})
        return out


def usage(states: list[TextState], n: int = 1) -> dict[str, int]:
    """The usage of a request's choices (``n`` a prompt, a prompt's together), as vLLM
    counts it: each prompt once, the completions' tokens summed."""
    prompt = sum(s.prompt_tokens for s in states[::n])
    completion = sum(s.usage()["completion_tokens"] for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def answer(request: Request, server: ServerDep, chat: bool) -> Response:
    t0 = started_at(request)
    path = CHAT if chat else COMPLETIONS
    req, prompts, tools = await received(request, server, chat)
    preq = prompts[0]
    preqs = [c for p in prompts for c in text_choices(req, p)]
    n = len(preqs)
    rid = request_id_of(request)
    pid = pipeline_id(request)
    pids = [pid if n == 1 else f"{pid}-{i}" for i in range(n)]
    oid = f"{'chatcmpl' if chat else 'cmpl'}-{pid}"
    many = f"n={n}, " if n > 1 else ""
    log.info("%s: request started (%spipeline id %s)", path, many, pid, extra={"request_id": rid})
    echoes = await echo_texts(request, server, req)
    stream = merged(server.pipe, preqs, pids, server.timeout_of(req.timeout_s))
    head = {"id": oid, "created": int(time.time()), "model": server.settings.model_name}
    wants_logprobs = bool(preq.get("logprobs"))
    top = "top_logprobs" in preq
    # a forced call's schema is the tools': the intake's error about it names them
    params = {"structured_outputs.json": "tools"} if tools is not None and tools.forced else {}
    # each choice reads its own tool calls and gathers its own audio
    readers = [
        tools.answer() if tools is not None and tools.mode != "none" else None for _ in preqs
    ]
    speak = isinstance(req, ChatRequest) and req.speak
    audios = [AudioAnswer() if speak else None for _ in preqs]
    echo = [None if echoes is None else echoes[i // req.n] for i in range(n)]
    if not req.stream:
        per = await collect(request, stream, n, rid, params)
        return complete(
            server,
            path,
            t0,
            rid,
            head,
            per,
            chat,
            wants_logprobs,
            top,
            readers,
            audios,
            echo,
            req.n,
            "prompt_logprobs" in preq and req.prompt_logprobs is not None,
        )
    first = await first_event(request, stream, rid, params)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    flags = (head, rid, path, chat, include_usage, wants_logprobs, top)
    writer = TextChoices(
        [TextChunks(*flags, i, tools=readers[i], audio=audios[i], echo=echo[i]) for i in range(n)],
        req.n,
    )
    return SSEAnswer(server, path, t0, rid, params).response(first, stream, writer)


async def received(
    request: Request, server: Server, chat: bool
) -> tuple[ChatRequest | CompletionRequest, list[dict[str, Any]], ToolPlan | None]:
    """The body read, parsed and checked (its bytes held against the server's body
    budget meanwhile, and dropped after), then a chat's images counted, fetched (the
    client going away cancels) and their sizes checked."""
    async with json_body(request, server.settings.max_body_bytes) as raw:
        size = len(raw)
        req, prompts, tools = await off_loop(
            request, size, functools.partial(prepare, server, raw, chat)
        )
    del raw  # neither held nor counted while images are fetched
    if chat:
        (preq,) = prompts
        await check_images(request, preq, server.settings)
        if server.settings.allow_remote_images:
            await off_loop(request, size, lambda: check_values(preq))
    return req, prompts, tools


async def echo_texts(
    request: Request, server: Server, req: ChatRequest | CompletionRequest
) -> list[str] | None:
    """A completion's ``echo``: each prompt's text (token ids decoded by the pipeline's
    tokenizer, as vLLM does); None for a chat, or without ``echo``. A batch's token ids
    are checked against the vocabulary here either way, where an error can name
    ``prompt[k][i]`` (the intake sees one prompt, and would name ``prompt[i]``)."""
    if not isinstance(req, CompletionRequest):
        return None
    prompts = prompts_of(req)
    texts: list[Any] = prompts
    if any(not isinstance(p, str) for p in prompts) and (req.echo or len(prompts) > 1):
        from omni_serve.routes.tokenize import decoded_prompts

        texts = await decoded_prompts(request, server, prompts)
    return texts if req.echo else None


def prepare(
    server: Server, raw: bytearray, chat: bool
) -> tuple[ChatRequest | CompletionRequest, list[dict[str, Any]], ToolPlan | None]:
    """The body as the OpenAI request, its pipeline requests (one a prompt) and a chat's
    tool plan, every value checked (run by :func:`off_loop`: in a worker thread for a
    big body)."""
    body = parse_json(raw)
    req: ChatRequest | CompletionRequest
    tools = None
    if chat:
        req = parse(ChatRequest, body)
        server.check_model(req.model, CHAT)
        server.check_priority(req.priority)
        check_n(server, req)
        remote = server.settings.allow_remote_images
        limits = server.prompt_limits
        parser = parser_of(server.pipe.config)
        tools = ToolPlan.of(req, parser)
        prompts = [
            chat_request(
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
        ]
    else:
        req = parse(CompletionRequest, body)
        server.check_model(req.model, COMPLETIONS)
        server.check_priority(req.priority)
        check_n(server, req, len(prompts_of(req)))
        prompts = completion_requests(req, server.max_tokens_limit, server.prompt_limits)
        if server.audio_in:  # a speech source speaks unless told not to
            for preq in prompts:
                preq["modalities"] = ["text"]
    for preq in prompts:
        check_values(preq)
    return req, prompts, tools


def check_n(server: Server, req: ChatRequest | CompletionRequest, prompts: int = 1) -> None:
    """A 400 naming ``n`` outside ``1..--max-n`` (:func:`check_choices`; ``prompts`` x
    ``n`` choices at most that), or past the request's key's ``max_queued``: each choice
    is a pipeline request, counted against the key's share as a request of its own would
    be, so more than that share could never all be open at once (a 429 would invite a
    retry that cannot pass)."""
    check_choices(req, server.settings.max_n, prompts)
    key = CLIENT.get()
    total = prompts * req.n
    if key is not None and key.max_queued is not None and total > key.max_queued:
        raise bad_field(
            "n" if prompts == 1 else "prompt",
            f"{total} choices are {total} pipeline requests, over the {key.max_queued} "
            f"key {key.name!r} may have open at once (its max_queued)",
        )


def complete(
    server: Server,
    path: str,
    t0: float,
    rid: str,
    head: dict[str, Any],
    per: list[list[AnyEvent]],
    chat: bool,
    logprobs: bool = False,
    top_logprobs: bool = False,
    tools: list[ToolAnswer | None] | None = None,
    audio: list[AudioAnswer | None] | None = None,
    echo: list[str | None] | None = None,
    n: int = 1,
    prompt_logprobs: bool = False,
) -> Response:
    """The non-streaming answer: each choice's (``per``: its events) whole text, its
    finish reason (and its ``tools`` calls, its ``audio``; a completion's ``echo``), and
    the :func:`usage` of all (``n`` choices a prompt); with ``prompt_logprobs`` (vLLM's
    field) the prompt's, on each completion choice or once for a chat."""
    choices, states = [], []
    for i, events in enumerate(per):
        one, state = choice(
            i,
            events,
            chat,
            logprobs,
            top_logprobs,
            tools[i] if tools else None,
            audio[i] if audio else None,
            echo[i] if echo else None,
        )
        if prompt_logprobs and not chat:
            one["prompt_logprobs"] = vllm_prompt_logprobs(state)
        choices.append(one)
        states.append(state)
    log.info("%s: request completed", path, extra={"request_id": rid})
    obj = "chat.completion" if chat else "text_completion"
    server.observe(path, 200, t0)
    out = {**head, "object": obj, "choices": choices, "usage": usage(states, n)}
    if prompt_logprobs and chat:
        out["prompt_logprobs"] = vllm_prompt_logprobs(states[0])
    return JSONResponse(out)


def choice(
    index: int,
    events: list[AnyEvent],
    chat: bool,
    logprobs: bool,
    top_logprobs: bool,
    tools: ToolAnswer | None,
    audio: AudioAnswer | None,
    echo: str | None = None,
) -> tuple[dict[str, Any], TextState]:
    """One choice of a non-streaming answer: the whole text (and with ``tools`` the calls
    read from it, with ``audio`` the audio, the text its transcript), its finish reason;
    and its text's state (its usage). ``echo``: a completion's prompt, put before its
    text (and its tokens' logprobs before the text's)."""
    state = TextState()
    for ev in events:
        state.add(ev)
        if audio is not None:
            audio.add(ev)
    out: dict[str, Any] = {
        "index": index,
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
        out["finish_reason"] = tools.finish_reason(state.finish_reason)
    if audio is not None:
        message.update(content=None, audio=audio.message(state.text))
    if logprobs:
        lps = state.logprobs
        if echo is not None:
            lps = echoed(state) + lps
        out["logprobs"] = chat_logprobs(lps) if chat else completion_logprobs(lps, 0, top_logprobs)
    if chat:
        out["message"] = message
    else:
        out["text"] = state.text if echo is None else echo + state.text
    return out, state


def echoed(state: TextState) -> list[TokenLogprob]:
    """The prompt's logprobs an echo with ``logprobs`` puts first; a pipeline that sent
    none (its AR stages do: ``prompt_logprobs``) is the server's error, not the client's."""
    if state.prompt_logprobs is None:
        raise RuntimeError("echo with logprobs: the pipeline sent no prompt_logprobs")
    return state.prompt_logprobs


def vllm_prompt_logprobs(state: TextState) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token, null for the first, else
    ``{token id: {logprob, rank, decoded_token}}`` of the token itself (its rank in the
    vocabulary) and of its likeliest alternatives (ranks 1..k)."""
    sent = state.prompt_sent
    if sent is None:
        raise RuntimeError("prompt_logprobs: the pipeline sent none")
    out: list[dict[str, dict[str, Any]] | None] = [None]
    rows = zip(
        sent["ids"][1:],
        sent["tokens"][1:],
        sent["logprobs"][1:],
        sent["ranks"][1:],
        sent["top"][1:],
        sent["top_ids"][1:],
        strict=True,
    )
    for tid, text, lp, rank, top, top_ids in rows:
        entry = {}
        for r, ((alt, alp), (aid, _)) in enumerate(zip(top, top_ids, strict=True), start=1):
            entry[str(aid)] = {"logprob": clamp_logprob(alp), "rank": r, "decoded_token": alt}
        entry[str(tid)] = {"logprob": clamp_logprob(lp), "rank": rank, "decoded_token": text}
        out.append(entry)
    return out


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
    the likelier), else null. An echoed prompt's first token has null for both."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    tops: list[dict[str, float] | None] | None = None
    if top:
        tops = []
        for t in tokens:
            alternatives: dict[str, float] | None = None if t.top is None else {}
            for a, lp in t.top or ():
                alternatives.setdefault(a, lp)  # type: ignore[union-attr]
            tops.append(alternatives)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
