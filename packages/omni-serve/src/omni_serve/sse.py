"""Server-sent events: the wire format, the events of several pipeline requests merged
into one stream, and the streaming answer that turns them into SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi.responses import StreamingResponse
from omni_core import Pipeline
from omni_core.events import AnyEvent, Cancelled, Error

from omni_serve.errors import from_terminal, submit_error
from omni_serve.server import Server

log = logging.getLogger("omni.serve")

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


MERGE_WINDOW = 8  # events per request taken from its inbox ahead of the client


async def merged(
    pipe: Pipeline, requests: list[dict[str, Any]], rids: list[str], timeout_s: float | None
) -> AsyncIterator[tuple[int, AnyEvent]]:
    """The events of several requests as ``(index, event)``, in arrival order.

    Each request is read by its own task; closing this generator (or cancelling its
    reader) cancels those tasks, and each cancelled ``astream`` cancels its request in the
    pipeline. A request the pipeline refuses raises here (the others are cancelled).

    At most ``MERGE_WINDOW`` events per request wait here: a slow client leaves the rest
    in each request's own inbox, where they coalesce (``omni_core.client.delivery``)."""
    q: asyncio.Queue[tuple[int, AnyEvent | BaseException | None]] = asyncio.Queue()
    room = asyncio.Semaphore(MERGE_WINDOW * len(requests))

    async def pump(i: int) -> None:
        try:
            async for ev in pipe.astream(requests[i], rids[i], timeout_s):
                await room.acquire()
                q.put_nowait((i, ev))
        except Exception as e:  # submit refused: overloaded, closed, a stage dead
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
                room.release()
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # a no-op for a finished one


class Chunks(Protocol):
    """How one endpoint writes its events as SSE chunks."""

    def chunks(self, index: int, ev: AnyEvent) -> list[bytes]: ...

    def closing(self) -> list[bytes]: ...


class SSEAnswer:
    """A streaming answer: the first event (already read), then the rest of ``stream``,
    each written by ``writer``; a failure mid-stream is an SSE ``error`` event. The
    endpoint's status (200, the error's, or 499 when the client went away) is counted
    when the stream ends."""

    def __init__(
        self,
        server: Server,
        endpoint: str,
        t0: float,
        rid: str,
        params: dict[str, str],
    ) -> None:
        self.server = server
        self.endpoint = endpoint
        self.t0 = t0
        self.rid = rid
        self.params = params

    def response(
        self,
        first: tuple[int, AnyEvent] | None,
        stream: AsyncIterator[tuple[int, AnyEvent]],
        writer: Chunks,
    ) -> StreamingResponse:
        return StreamingResponse(
            self.body(first, stream, writer), media_type="text/event-stream", headers=SSE_HEADERS
        )

    async def body(
        self,
        first: tuple[int, AnyEvent] | None,
        stream: AsyncIterator[tuple[int, AnyEvent]],
        writer: Chunks,
    ) -> AsyncIterator[bytes]:
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
                        status, event = self.error(ev)
                        yield event
                        yield SSE_DONE
                        return
                    for chunk in writer.chunks(i, ev):
                        yield chunk
                for chunk in writer.closing():
                    yield chunk
                yield SSE_DONE
                ended = True
        except Exception as e:
            err = submit_error(e, self.rid)
            status = err.status
            yield sse(err.body(self.rid), "error")
        finally:
            if not ended and status == 200:  # the client went away mid-stream
                status = 499
                self.server.metrics.disconnects.inc()
                log.info("client went away: request cancelled", extra={"request_id": self.rid})
            self.server.observe(self.endpoint, status, self.t0)

    def error(self, ev: Error | Cancelled) -> tuple[int, bytes]:
        err = from_terminal(ev, self.params, self.rid)
        log.info(
            "request ended: %d %s",
            err.status,
            err.message,
            extra={"request_id": self.rid, "stage": ev.stage},
        )
        return err.status, sse(err.body(self.rid), "error")
