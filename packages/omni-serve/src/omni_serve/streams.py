"""Reading a request's events while watching its HTTP client: a client that goes away
cancels the work at once; a request that ends in error before anything was sent becomes
an HTTP error."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from fastapi import Request
from omni_core.events import AnyEvent, Cancelled, Error, Segment

from omni_serve.errors import APIError, from_terminal, submit_error

log = logging.getLogger("omni.serve")
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or :class:`ClientGone` (``work`` cancelled) if the client goes
    away first. The body must have been read already."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (shutdown): so is the work
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


MIN_LOGPROB = -9999.0  # JSON has no -inf: a token the model gave no chance gets this


class TokenLogprob(NamedTuple):
    """One generated token's text and logprob, and (with ``top_logprobs``) the most
    likely alternatives at its position, most likely first."""

    token: str
    logprob: float | None  # None: a prompt's first token (echo), which nothing predicts
    top: list[tuple[str, float]] | None


def clamp_logprob(value: Any) -> float:
    """A logprob as JSON carries it (:data:`MIN_LOGPROB` for -inf)."""
    return max(float(value), MIN_LOGPROB)


def prompt_entries(sent: dict[str, Any]) -> list[TokenLogprob]:
    r"""The AR stages' ``prompt_logprobs`` (each prompt token's text, its logprob and its
    alternatives as ``[text, logprob]``; None for the first) as :class:`TokenLogprob`\ s."""
    out = []
    for t, lp, top in zip(sent["tokens"], sent["logprobs"], sent["top"], strict=True):
        alts = None if top is None else [(str(a), clamp_logprob(b)) for a, b in top]
        out.append(TokenLogprob(str(t), None if lp is None else clamp_logprob(lp), alts))
    return out


@dataclass
class TextState:
    """The text of one request so far: deltas, tokens, their logprobs, how it ended."""

    parts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    end: str | None = None  # the finish reason the stages sent
    prompt_tokens: int = 0  # the AR stages pass the prompt's length along
    # each token's logprob, when the request asked for logprobs
    logprobs: list[TokenLogprob] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the last add
    # the prompt's tokens with their logprobs, when the request asked (echo), as the AR
    # stages send them with the first text: {tokens, logprobs, top}
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_sent: dict[str, Any] | None = None  # the same as sent (ids, ranks: vLLM's field)

    def add(self, ev: AnyEvent) -> str | None:
        """The text delta ``ev`` carries (None when it carries none); its tokens'
        logprobs are in ``new_logprobs``."""
        self.new_logprobs = []
        payload = ev.payload if isinstance(ev.payload, dict) else {}
        if not isinstance(ev, Segment) or not isinstance(payload.get("text"), str):
            return None
        self.parts.append(payload["text"])
        if self.prompt_logprobs is None and isinstance(payload.get("prompt_logprobs"), dict):
            self.prompt_sent = payload["prompt_logprobs"]
            self.prompt_logprobs = prompt_entries(self.prompt_sent)
        tokens = ev.tokens or []
        self.tokens.extend(tokens)
        self.prompt_tokens = int(payload.get("prompt_tokens", self.prompt_tokens))
        self.end = payload.get("finish_reason", self.end)
        texts = payload.get("token_texts")
        if ev.logprobs is not None and isinstance(texts, list) and len(texts) == len(tokens):
            # postprocess's "top_logprobs": per token, [[text, logprob], ...]
            tops = payload.get("top_logprobs")
            if not (isinstance(tops, list) and len(tops) == len(tokens)):
                tops = [[] for _ in tokens]
            self.new_logprobs = [
                TokenLogprob(
                    str(t), clamp_logprob(lp), [(str(a), clamp_logprob(b)) for a, b in top]
                )
                for t, lp, top in zip(texts, ev.logprobs, tops, strict=True)
            ]
            self.logprobs.extend(self.new_logprobs)
        return payload["text"]

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def finish_reason(self) -> str:
        """Why the text ended, as the AR stages said it with their last text (decode
        decides: ``stop`` at end of sequence or a stop string, ``length`` at
        ``max_tokens``); ``stop`` where the pipeline's stages say nothing (or something
        OpenAI's field cannot carry)."""
        return self.end if self.end in ("stop", "length") else "stop"

    def usage(self) -> dict[str, int]:
        n = len(self.tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
        }


Stream = AsyncIterator[tuple[int, AnyEvent]]


async def first_event(
    request: Request, stream: Stream, rid: str, params: dict[str, str]
) -> tuple[int, AnyEvent] | None:
    """The first event, awaited while watching for a disconnect; an error or timeout
    before anything was sent becomes a proper HTTP error."""
    try:
        first = await until_disconnect(request, anext(stream, None))
    except ClientGone:
        await stream.aclose()
        raise
    except Exception as e:
        await stream.aclose()
        raise submit_error(e, rid) from None
    if first is not None and isinstance(first[1], (Error, Cancelled)):
        await stream.aclose()
        raise from_terminal(first[1], params, rid)
    return first


async def collect(
    request: Request, stream: Stream, n: int, rid: str, params: dict[str, str]
) -> list[list[AnyEvent]]:
    """Every event of ``n`` requests, or the first failure as an APIError."""

    async def read() -> list[list[AnyEvent]]:
        out: list[list[AnyEvent]] = [[] for _ in range(n)]
        async with contextlib.aclosing(stream):
            async for i, ev in stream:
                if isinstance(ev, (Error, Cancelled)):
                    log.info(
                        "request ended: %s",
                        ev.event_type,
                        extra={"request_id": rid, "stage": ev.stage, "sequence": ev.sequence},
                    )
                    raise from_terminal(ev, params, rid)
                out[i].append(ev)
        return out

    try:
        return await until_disconnect(request, read())
    except ClientGone:
        log.info("client went away: request cancelled", extra={"request_id": rid})
        raise
    except APIError:
        raise
    except Exception as e:
        raise submit_error(e, rid) from None
