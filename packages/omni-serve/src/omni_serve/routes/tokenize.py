"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt (or a chat) as the token
ids the pipeline's text model is fed, and token ids back as text.

The ids come from the pipeline's own source stage (an ``ar.intake``), built here in the
server as the pipeline builds it (its kind's class from the registry, its options from
the config) and loaded tokenizer-only, once, on first use: a request is read by the
stage's own parsing (``chat``, ``system_prompt`` and ``examples`` included) and encoded
by its engine (the chat template included), so ``count`` is what the model is fed. A
chat's messages go through the chat route's own conversion (:func:`chat_request`: parts,
tool calls and results, the tools described) first. Texts are held to the chat and
completion routes' character limits, token ids to the tokenizer's vocabulary."""

from __future__ import annotations

import asyncio
import functools
from typing import Any, ClassVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from omni_core.registry import load_stage_class
from omni_core.stage import StageContext
from pydantic import BaseModel, ConfigDict, Field

from omni_serve.auth import require_api_key
from omni_serve.body import json_body, off_loop, parse_json
from omni_serve.errors import APIError, bad_field
from omni_serve.middleware import started_at
from omni_serve.openai_api import ChatMessage, ChatRequest, Tool, chat_request, parse
from omni_serve.server import Server, ServerDep
from omni_serve.tools import ToolPlan, parser_of

router = APIRouter(dependencies=[Depends(require_api_key)])

TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
# source stage kinds whose tokenizer these endpoints use (their engine's ``encode``)
TOKENIZER_SOURCES = {"ar.intake"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    unsupported: ClassVar[dict[str, str]] = {}
    model: str | None = None


class PromptTokenize(_Body):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTokenize(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class Detokenize(_Body):
    tokens: list[int]


class Tokenizer:
    """The pipeline's source stage, loaded tokenizer-only in the server (see the module)."""

    def __init__(self, server: Server) -> None:
        targets = {e.target for e in server.pipe.config.edges}
        sources = [s for s in server.pipe.config.stages if s.name not in targets]
        text = [s for s in sources if s.kind in TOKENIZER_SOURCES]
        if not text:
            kinds = ", ".join(sorted({s.kind for s in sources})) or "none"
            raise APIError(
                404,
                f"pipeline {server.pipe.config.name!r} has no text model to tokenize with: "
                f"its source stages are of kinds {kinds}, and /tokenize and /detokenize "
                f"use an {' or '.join(sorted(TOKENIZER_SOURCES))} source's tokenizer",
                code="unsupported_endpoint",
            )
        spec = text[0]
        options = spec.options if isinstance(spec.options, dict) else {}
        self.stage = load_stage_class(spec.kind)(StageContext(spec.name, spec.kind, options))
        self.stage.load()  # the intake's load: its engine, tokenizer only, on the CPU
        self.tok = self.stage.engine.tokenizer
        self.vocab = len(self.tok)
        self.max_model_len = int(self.stage.options.max_prompt_tokens)

    def source(self, preq: dict[str, Any]) -> Any:
        """The prompt (a str) or the chat (messages) the intake reads from ``preq``."""
        return self.stage.read({**preq, "max_tokens": 1})[0]

    def prompt_ids(self, preq: dict[str, Any], special: bool) -> list[int]:
        source = self.source(preq)
        if isinstance(source, str) and not special:
            return list(self.tok(source, add_special_tokens=False)["input_ids"])
        return list(self.stage.engine.encode(source))

    def check_ids(self, where: str, ids: list[int]) -> None:
        """A 400 naming ``where[i]`` at the first id outside the vocabulary."""
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab:
                raise bad_field(
                    f"{where}[{i}]", f"{t} is not a token id of this model (0..{self.vocab - 1})"
                )

    def chat_ids(self, preq: dict[str, Any], req: ChatTokenize) -> list[int]:
        source = self.source(preq)
        defaults = req.add_generation_prompt and not req.continue_final_message
        if defaults and not req.add_special_tokens:
            return list(self.stage.engine.encode(source))  # the intake's own call
        text = self.tok.apply_chat_template(
            source,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tokenize=False,
        )
        return list(self.tok(text, add_special_tokens=req.add_special_tokens)["input_ids"])


async def tokenizer_of(request: Request, server: Server) -> Tokenizer:
    """The server's :class:`Tokenizer`, loaded once (in a worker thread) on first use."""
    state = request.app.state
    if getattr(state, "tokenizer_lock", None) is None:
        state.tokenizer_lock = asyncio.Lock()
    async with state.tokenizer_lock:
        if getattr(state, "tokenizer", None) is None:
            state.tokenizer = await asyncio.to_thread(Tokenizer, server)
    return state.tokenizer  # type: ignore[no-any-return]


def tokenized(server: Server, tok: Tokenizer, raw: bytearray) -> dict[str, Any]:
    """The answer of ``/tokenize`` (run by :func:`off_loop`)."""
    body = parse_json(raw)
    req: PromptTokenize | ChatTokenize
    if isinstance(body, dict) and "messages" in body:
        req = parse(ChatTokenize, body)
        server.check_model(req.model, "/v1/chat/completions")
        if req.add_generation_prompt and req.continue_final_message:
            raise bad_field(
                "continue_final_message",
                "cannot be true with add_generation_prompt (set it false)",
            )
        chat = parse(ChatRequest, {"messages": body["messages"], "tools": body.get("tools")})
        parser = parser_of(server.pipe.config)
        plan = ToolPlan.of(chat, parser)
        preq = chat_request(chat, None, chars=server.prompt_limits, tools=plan, parser=parser)
        ids = tok.chat_ids({"messages": preq["messages"]}, req)
    else:
        req = parse(PromptTokenize, body)
        server.check_model(req.model, "/v1/completions")
        server.prompt_limits.check("prompt", len(req.prompt))
        ids = tok.prompt_ids({"prompt": req.prompt, "raw_prompt": True}, req.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": tok.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = tok.tok.convert_ids_to_tokens(ids)
    return out


def detokenized(server: Server, tok: Tokenizer, raw: bytearray) -> dict[str, Any]:
    """The answer of ``/detokenize`` (run by :func:`off_loop`)."""
    req = parse(Detokenize, parse_json(raw))
    server.check_model(req.model, "/v1/completions")
    tok.check_ids("tokens", req.tokens)
    prompt = tok.tok.decode(req.tokens)
    server.prompt_limits.check("tokens", len(prompt))
    return {"prompt": prompt}


async def decoded_prompts(
    request: Request, server: Server, prompts: list[str | list[int]]
) -> list[str]:
    """Each prompt's text, as a completion's ``echo`` puts it first: a string as it is,
    token ids decoded by the pipeline's tokenizer (as vLLM does), each checked against
    its vocabulary (a 400 naming ``prompt[i]``, or ``prompt`` where the pipeline has
    no text model to decode with)."""
    try:
        tok = await tokenizer_of(request, server)
    except APIError as e:
        raise bad_field("prompt", f"token ids cannot be echoed: {e.message}") from None

    def work() -> list[str]:
        out = []
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                tok.check_ids("prompt" if len(prompts) == 1 else f"prompt[{i}]", p)
                p = tok.tok.decode(p)
            out.append(p)
        return out

    return await off_loop(request, sum(len(p) for p in prompts) * 8, work)


async def _answer(request: Request, server: Server, path: str, work: Any) -> Response:
    t0 = started_at(request)
    tok = await tokenizer_of(request, server)
    async with json_body(request, server.settings.max_body_bytes) as raw:
        out = await off_loop(request, len(raw), functools.partial(work, server, tok, raw))
    server.observe(path, 200, t0)
    return JSONResponse(out)


@router.post(TOKENIZE)
async def tokenize(request: Request, server: ServerDep) -> Response:
    return await _answer(request, server, TOKENIZE, tokenized)


@router.post(DETOKENIZE)
async def detokenize(request: Request, server: ServerDep) -> Response:
    return await _answer(request, server, DETOKENIZE, detokenized)
