"""The HTTP app: OpenAI endpoints over one running :class:`omni_core.Pipeline`, the web
page, ``/health``, ``/metrics`` and the page's live stage view.

Every request is one pipeline request per answer (``n`` images: ``n`` requests) read with
``Pipeline.astream``. A request ends in the pipeline however its HTTP side ends: a client
that goes away (streaming or not) cancels it at once, so nothing runs for a gone client.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from omni_core import Pipeline
from omni_core.errors import StageDeadError
from omni_core.events import AnyEvent, Cancelled, Error, ImageProgress, Segment
from omni_core.image_files import png_bytes
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_serve.errors import APIError, from_terminal
from omni_serve.metrics import ServerMetrics
from omni_serve.openai_api import (
    IMAGE_PARAMS,
    ChatRequest,
    CompletionRequest,
    ImageRequest,
    chat_request,
    completion_request,
    image_requests,
    parse,
)

log = logging.getLogger("omni.serve")
T = TypeVar("T")

TEXT_SOURCES = {"ar.intake", "ar.mm_intake"}
IMAGE_STAGES = {"dit.plan"}


@dataclass
class ServeSettings:
    """What ``omni serve`` lets an operator set; the defaults are the safe ones."""

    model_name: str
    api_key: str | None = None  # every endpoint but /health (and the page) needs it
    request_timeout_s: float | None = None  # default per request (None: the pipeline's)
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096
    max_image_pixels: int = 1024 * 1024
    max_images: int = 4


def endpoints(pipe: Pipeline) -> list[str]:
    """What the pipeline can answer: images when it has DiT stages (a mixed pipeline's
    text is the image's revised prompt), else text when its source is an AR intake."""
    kinds = {s.kind for s in pipe.config.stages}
    if kinds & IMAGE_STAGES:
        return ["/v1/images/generations"]
    if kinds & TEXT_SOURCES:
        return ["/v1/chat/completions", "/v1/completions"]
    return []


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


@dataclass
class TextState:
    """The text of one request so far: deltas, tokens, how it ended."""

    parts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    end: str | None = None
    prompt_tokens: int = 0  # the AR stages pass the prompt's length along

    def add(self, ev: AnyEvent) -> str | None:
        """The text delta ``ev`` carries (None when it carries none)."""
        payload = ev.payload if isinstance(ev.payload, dict) else {}
        if not isinstance(ev, Segment) or not isinstance(payload.get("text"), str):
            return None
        self.parts.append(payload["text"])
        self.tokens.extend(ev.tokens or [])
        self.prompt_tokens = int(payload.get("prompt_tokens", self.prompt_tokens))
        self.end = payload.get("finish_reason", self.end)
        return payload["text"]

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def finish_reason(self, max_tokens: int | None) -> str:
        """``stop`` (end of sequence or a stop string), or ``length`` at ``max_tokens``."""
        if self.end == "end" and max_tokens is not None and len(self.tokens) >= max_tokens:
            return "length"
        return "stop"

    def usage(self) -> dict[str, int]:
        n = len(self.tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
        }


async def merged(
    pipe: Pipeline, requests: list[dict[str, Any]], rids: list[str], timeout_s: float | None
) -> AsyncIterator[tuple[int, AnyEvent]]:
    """The events of several requests as ``(index, event)``, in arrival order.

    Each request is read by its own task; closing this generator (or cancelling its
    reader) cancels those tasks, and each cancelled ``astream`` cancels its request in the
    pipeline."""
    q: asyncio.Queue[tuple[int, AnyEvent | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for ev in pipe.astream(requests[i], rids[i], timeout_s):
                q.put_nowait((i, ev))
        except Exception as e:  # submit refused: the pipeline is closed or a stage dead
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(requests))]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # a no-op for a finished one


def _submit_error(e: BaseException) -> APIError:
    if isinstance(e, StageDeadError):
        return APIError(503, str(e), type="server_error", code="stage_dead")
    log.error("submit failed: %s: %s", type(e).__name__, e)
    return APIError(503, "the pipeline is not accepting requests", type="server_error")


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


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(pipe: Pipeline, settings: ServeSettings) -> FastAPI:
    """The ASGI app serving ``pipe`` (started, and closed, by the caller)."""
    app = FastAPI(title="omni serve", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(pipe)
    served = endpoints(pipe)
    created = int(time.time())
    page = resources.files("omni_serve").joinpath("static/index.html").read_text()

    def observe(endpoint: str, status: int, t0: float) -> None:
        metrics.http_requests.labels(endpoint, str(status)).inc()
        metrics.http_seconds.labels(endpoint).observe(time.monotonic() - t0)

    def check_auth(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), settings.api_key.encode()
        ):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )

    async def read_body(request: Request) -> Any:
        limit = settings.max_body_bytes
        too_big = APIError(413, f"the request body is over {limit} bytes", code="body_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        try:
            return json.loads(body)
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    def check_model(name: str | None, path: str) -> None:
        if path not in served:
            offer = ", ".join(served) or "no OpenAI endpoint (a pipeline of other stages)"
            raise APIError(
                404,
                f"pipeline {pipe.config.name!r} does not serve {path}; it serves {offer}",
                code="unsupported_endpoint",
            )
        if name not in (None, "", settings.model_name):
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def timeout_of(body_timeout: float | None) -> float | None:
        return body_timeout if body_timeout is not None else settings.request_timeout_s

    async def handle(
        request: Request,
        endpoint: str,
        answer: Callable[[Request, Any, float], Awaitable[Response]],
    ) -> Response:
        """Auth, body, errors and metrics around one endpoint's ``answer``."""
        t0 = time.monotonic()
        try:
            check_auth(request)
            response = await answer(request, await read_body(request), t0)
        except APIError as e:
            log.info("%s: %d %s", endpoint, e.status, e.message)
            observe(endpoint, e.status, t0)
            return JSONResponse(e.body(), status_code=e.status)
        except ClientGone:
            metrics.disconnects.inc()
            observe(endpoint, 499, t0)
            return Response(status_code=499)
        if not isinstance(response, StreamingResponse):
            observe(endpoint, response.status_code, t0)
        return response

    async def first_events(
        request: Request, stream: AsyncIterator[tuple[int, AnyEvent]]
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
            raise _submit_error(e) from None
        if first is not None and isinstance(first[1], (Error, Cancelled)):
            await stream.aclose()
            raise from_terminal(first[1], IMAGE_PARAMS)
        return first

    def streaming(
        endpoint: str,
        t0: float,
        first: tuple[int, AnyEvent] | None,
        stream: AsyncIterator[tuple[int, AnyEvent]],
        chunks: Callable[[int, AnyEvent], list[bytes]],
        closing: Callable[[], list[bytes]],
        rid: str,
    ) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            status = 200
            ended = False
            try:
                async with contextlib.aclosing(stream):
                    pending = [first] if first is not None else []
                    while True:
                        item = pending.pop() if pending else await anext(stream, None)
                        if item is None:
                            break
                        i, ev = item
                        if isinstance(ev, (Error, Cancelled)):
                            err = from_terminal(ev, IMAGE_PARAMS)
                            status = err.status
                            log.info(
                                "request ended: %s",
                                err.message,
                                extra={"request_id": rid, "stage": ev.stage},
                            )
                            yield sse(err.body(), "error")
                            yield SSE_DONE
                            return
                        for chunk in chunks(i, ev):
                            yield chunk
                    for chunk in closing():
                        yield chunk
                    yield SSE_DONE
                    ended = True
            except Exception as e:
                status = 500
                yield sse(_submit_error(e).body(), "error")
            finally:
                if not ended and status == 200:  # the client went away mid-stream
                    status = 499
                    metrics.disconnects.inc()
                    log.info("client went away: request cancelled", extra={"request_id": rid})
                observe(endpoint, status, t0)

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, "X-Request-Id": rid},
        )

    async def collect(
        request: Request, stream: AsyncIterator[tuple[int, AnyEvent]], n: int, rid: str
    ) -> list[list[AnyEvent]]:
        """Every event of ``n`` requests, or the first failure as an APIError."""

        async def read() -> list[list[AnyEvent]]:
            out: list[list[AnyEvent]] = [[] for _ in range(n)]
            async with contextlib.aclosing(stream):
                async for i, ev in stream:
                    if isinstance(ev, (Error, Cancelled)):
                        log.info(
                            "request ended: %s %s",
                            ev.event_type,
                            getattr(ev, "message", ""),
                            extra={"request_id": rid, "stage": ev.stage, "sequence": ev.sequence},
                        )
                        raise from_terminal(ev, IMAGE_PARAMS)
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
            raise _submit_error(e) from None

    # ------------------------------------------------------------------ text
    async def text_answer(request: Request, body: Any, t0: float, chat: bool) -> Response:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        req: ChatRequest | CompletionRequest
        if chat:
            req = parse(ChatRequest, body)
            check_model(req.model, path)
            preq = chat_request(req, settings.max_tokens)
        else:
            req = parse(CompletionRequest, body)
            check_model(req.model, path)
            preq = completion_request(req, settings.max_tokens)
        rid = uuid.uuid4().hex
        oid = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        max_tokens = preq.get("max_tokens")
        log.info("%s: request started", path, extra={"request_id": rid})
        stream = merged(pipe, [preq], [rid], timeout_of(req.timeout_s))
        state = TextState()
        now = int(time.time())
        head = {"id": oid, "created": now, "model": settings.model_name}

        if not req.stream:
            events = (await collect(request, stream, 1, rid))[0]
            for ev in events:
                state.add(ev)
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": state.finish_reason(max_tokens),
                "logprobs": None,
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": state.text}
            else:
                choice["text"] = state.text
            log.info("%s: request completed", path, extra={"request_id": rid})
            obj = "chat.completion" if chat else "text_completion"
            return JSONResponse(
                {**head, "object": obj, "choices": [choice], "usage": state.usage()},
                headers={"X-Request-Id": rid},
            )

        first = await first_events(request, stream)
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict[str, Any] | str, finish: str | None) -> bytes:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                c["delta"] = delta
            else:
                c["text"] = delta
            extra = {"usage": None} if include_usage else {}
            return sse({**head, "object": obj, "choices": [c], **extra})

        opening = [chunk({"role": "assistant", "content": ""}, None)] if chat else []

        def chunks(_i: int, ev: AnyEvent) -> list[bytes]:
            delta = state.add(ev)
            if not delta:
                return []
            out = [*opening, chunk({"content": delta} if chat else delta, None)]
            opening.clear()
            return out

        def closing() -> list[bytes]:
            out = [*opening, chunk({} if chat else "", state.finish_reason(max_tokens))]
            if include_usage:
                out.append(sse({**head, "object": obj, "choices": [], "usage": state.usage()}))
            log.info("%s: request completed", path, extra={"request_id": rid})
            return out

        return streaming(path, t0, first, stream, chunks, closing, rid)

    # ------------------------------------------------------------------ images
    async def image_answer(request: Request, body: Any, t0: float) -> Response:
        path = "/v1/images/generations"
        req = parse(ImageRequest, body)
        check_model(req.model, path)
        preqs = image_requests(
            req, settings.max_image_pixels, settings.max_images, settings.max_tokens
        )
        rid = uuid.uuid4().hex
        rids = [rid if len(preqs) == 1 else f"{rid}-{i}" for i in range(len(preqs))]
        log.info("%s: request started (n=%d)", path, len(preqs), extra={"request_id": rid})
        stream = merged(pipe, preqs, rids, timeout_of(req.timeout_s))
        texts = [TextState() for _ in preqs]

        def final_of(ev: AnyEvent) -> dict[str, Any] | None:
            if not (isinstance(ev, ImageProgress) and ev.is_last):
                return None
            data = ev.arrays.get("image")
            payload = ev.payload if isinstance(ev.payload, dict) else {}
            if not isinstance(data, bytes):
                return None
            return {
                "b64_json": base64.b64encode(data).decode(),
                "output_format": payload.get("format", "png"),
                "size": f"{payload.get('width', 0)}x{payload.get('height', 0)}",
            }

        if not req.stream:
            per = await collect(request, stream, len(preqs), rid)
            data, fmt, size = [], None, None
            for i, events in enumerate(per):
                finals = [f for f in map(final_of, events) if f is not None]
                for ev in events:
                    texts[i].add(ev)
                if not finals:
                    raise APIError(500, "the pipeline made no image", type="server_error")
                item: dict[str, Any] = {"b64_json": finals[-1]["b64_json"]}
                if texts[i].text:
                    item["revised_prompt"] = texts[i].text
                data.append(item)
                fmt, size = finals[-1]["output_format"], finals[-1]["size"]
            log.info("%s: request completed", path, extra={"request_id": rid})
            return JSONResponse(
                {"created": int(time.time()), "data": data, "output_format": fmt, "size": size},
                headers={"X-Request-Id": rid},
            )

        first = await first_events(request, stream)
        partials = [0] * len(preqs)
        limit = req.partial_images

        def chunks(i: int, ev: AnyEvent) -> list[bytes]:
            now = int(time.time())
            delta = texts[i].add(ev)
            if delta:
                return [sse({"type": "omni.text.delta", "index": i, "delta": delta})]
            final = final_of(ev)
            if final is not None:
                done = {
                    "type": "image_generation.completed",
                    "created_at": now,
                    "background": "opaque",
                    "quality": "auto",
                    "usage": {
                        "input_tokens": 0,
                        "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
                        "output_tokens": 0,
                        "total_tokens": 0,
                    },
                    "index": i,
                    **final,
                }
                if texts[i].text:
                    done["revised_prompt"] = texts[i].text
                return [sse(done, done["type"])]
            preview = ev.arrays.get("preview") if isinstance(ev, ImageProgress) else None
            if preview is None or (limit is not None and partials[i] >= limit):
                return []
            partials[i] += 1
            h, w = preview.shape[:2]
            part = {
                "type": "image_generation.partial_image",
                "b64_json": base64.b64encode(png_bytes(preview)).decode(),
                "partial_image_index": partials[i] - 1,
                "created_at": now,
                "output_format": "png",
                "size": f"{w}x{h}",
                "background": "opaque",
                "quality": "auto",
                "index": i,
                "step": ev.step,
            }
            return [sse(part, part["type"])]

        def closing() -> list[bytes]:
            log.info("%s: request completed", path, extra={"request_id": rid})
            return []

        return streaming(path, t0, first, stream, chunks, closing, rid)

    # ------------------------------------------------------------------ routes
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(
            request, "/v1/chat/completions", lambda r, b, t: text_answer(r, b, t, chat=True)
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(
            request, "/v1/completions", lambda r, b, t: text_answer(r, b, t, chat=False)
        )

    @app.post("/v1/images/generations")
    async def images(request: Request) -> Response:
        return await handle(request, "/v1/images/generations", image_answer)

    def guarded(endpoint: str, request: Request, make: Callable[[], Any]) -> Response:
        """A GET endpoint behind the API key, counted in the HTTP metrics."""
        t0 = time.monotonic()
        try:
            check_auth(request)
        except APIError as e:
            observe(endpoint, e.status, t0)
            return JSONResponse(e.body(), status_code=e.status)
        out = make()
        response = out if isinstance(out, Response) else JSONResponse(out)
        observe(endpoint, response.status_code, t0)
        return response

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        def make() -> dict[str, Any]:
            model = {
                "id": settings.model_name,
                "object": "model",
                "created": created,
                "owned_by": "omni",
                "omni": {
                    "pipeline": pipe.config.name,
                    "endpoints": served,
                    "stages": [s.name for s in pipe.config.stages],
                },
            }
            return {"object": "list", "data": [model]}

        return guarded("/v1/models", request, make)

    @app.get("/v1/omni/stats")
    async def stats(request: Request) -> Response:
        """The page's live view: per stage state, queue depth, in-flight and rates."""

        def make() -> dict[str, Any]:
            m = pipe.metrics()
            health = pipe.health()
            keys = ("queue_depth", "inflight", "enqueue_per_s", "dequeue_per_s", "completed")
            rows = [
                {
                    "name": name,
                    "state": health[name]["state"],
                    **{k: st.get(k, 0) for k in (*keys, "errors", "dropped", "restarts")},
                }
                for name, st in m["stages"].items()
            ]
            return {"stages": rows, "in_flight": m["in_flight"], "counts": m["counts"]}

        return guarded("/v1/omni/stats", request, make)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        return guarded(
            "/metrics",
            request,
            lambda: Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST),
        )

    @app.get("/health")
    async def health() -> Response:
        """200 only when every stage is ready: starting, restarting and dead are 503."""
        stages = {
            name: {k: h.get(k) for k in ("state", "healthy", "restarts", "pid", "exit")}
            for name, h in pipe.health().items()
        }
        ok = all(h["healthy"] for h in stages.values())
        body = {"status": "ok" if ok else "unhealthy", "stages": stages}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        # static HTML holding no data: everything it fetches needs the API key
        return HTMLResponse(page)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        e = APIError(exc.status_code, str(exc.detail), code="not_found")
        return JSONResponse(e.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        e = APIError(500, "internal server error", type="server_error")
        return JSONResponse(e.body(), status_code=500)

    return app
