"""``POST /v1/audio/speech``: OpenAI's text to speech on a pipeline that speaks. One
pipeline request (``input`` said as it is); the audio stage's bytes stream out as they
come (chunked), with their media type as ``Content-Type``, or with ``stream_format:
"sse"`` as ``speech.audio.delta`` events and a last ``speech.audio.done``.

Nothing is sent before the first audio bytes: a request the pipeline refuses (a voice the
model lacks, named by the source stage) is a proper 4xx. A failure after that cannot
change the status any more: the connection is cut before the chunked body ends, so a
client sees a broken download, never a short file that looks whole."""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from omni_core.events import AnyEvent, Cancelled, Error

from omni_serve.audio import audio_bytes
from omni_serve.auth import require_api_key
from omni_serve.body import check_values, json_body, off_loop, parse_json
from omni_serve.errors import APIError, from_terminal
from omni_serve.middleware import request_id_of, started_at
from omni_serve.openai_api import SpeechRequest, parse, speech_request
from omni_serve.server import SPEECH, Server, ServerDep, pipeline_id
from omni_serve.sse import SSE_HEADERS, SSEAnswer, merged, sse
from omni_serve.streams import Stream, TextState, first_event

log = logging.getLogger("omni.serve")
router = APIRouter(dependencies=[Depends(require_api_key)])


class AudioCut(Exception):
    """The pipeline failed after the audio began: the answer's connection is cut."""


def prepare(server: Server, raw: bytearray) -> tuple[SpeechRequest, dict[str, Any]]:
    """The body as the OpenAI request and the pipeline request, every value checked."""
    req = parse(SpeechRequest, parse_json(raw))
    server.check_model(req.model, SPEECH)
    server.check_priority(req.priority)
    preq = speech_request(req)
    check_values(preq)
    return req, preq


@router.post(SPEECH)
async def speech(request: Request, server: ServerDep) -> Response:
    t0 = started_at(request)
    async with json_body(request, server.settings.max_body_bytes) as raw:
        req, preq = await off_loop(request, len(raw), functools.partial(prepare, server, raw))
    del raw
    rid = request_id_of(request)
    pid = pipeline_id(request)
    log.info("%s: request started (pipeline id %s)", SPEECH, pid, extra={"request_id": rid})
    stream = merged(server.pipe, [preq], [pid], server.timeout_of(req.timeout_s))
    if req.stream_format == "sse":
        first = await first_event(request, stream, rid, {})
        return SSEAnswer(server, SPEECH, t0, rid, {}).response(first, stream, SpeechEvents(rid))
    while True:  # the text (the transcript) comes first: not sent here
        item = await first_event(request, stream, rid, {})
        found = None if item is None else audio_bytes(item[1])
        if item is None or found is not None and found[0]:
            break
    if found is None:
        raise APIError(500, f"the pipeline made no audio; request id {rid}", type="server_error")
    data, media_type = found
    body = audio_body(server, t0, rid, data, stream)
    return StreamingResponse(body, media_type=media_type, headers=SSE_HEADERS)


async def audio_body(
    server: Server, t0: float, rid: str, first: bytes, stream: Stream
) -> AsyncIterator[bytes]:
    """The audio bytes: ``first``, then each audio event's as it comes; a failure raises
    :class:`AudioCut` (the server cuts the connection). The status is counted at the end
    (499 when the client went away)."""
    status, ended = 200, False
    try:
        async with contextlib.aclosing(stream):
            yield first
            async for _, ev in stream:
                if isinstance(ev, (Error, Cancelled)):
                    err = from_terminal(ev, {}, rid)
                    status = err.status
                    log.info(
                        "request ended mid-answer: %d %s",
                        err.status,
                        err.message,
                        extra={"request_id": rid, "stage": ev.stage},
                    )
                    raise AudioCut(err.message)
                found = audio_bytes(ev)
                if found is not None and found[0]:
                    yield found[0]
            ended = True
            log.info("%s: request completed", SPEECH, extra={"request_id": rid})
    finally:
        if not ended and status == 200:  # the client went away mid-answer
            status = 499
            server.metrics.disconnects.inc()
            log.info("client went away: request cancelled", extra={"request_id": rid})
        server.observe(SPEECH, status, t0)


@dataclass
class SpeechEvents:
    """``stream_format: "sse"``: OpenAI's ``speech.audio.delta`` (``audio``: base64
    bytes) per audio chunk, and ``speech.audio.done`` with the usage."""

    rid: str
    text: TextState = field(default_factory=TextState)

    def chunks(self, _index: int, ev: AnyEvent) -> list[bytes]:
        self.text.add(ev)
        found = audio_bytes(ev)
        if found is None or not found[0]:
            return []
        delta = {"type": "speech.audio.delta", "audio": base64.b64encode(found[0]).decode()}
        return [sse(delta, delta["type"])]

    def closing(self) -> list[bytes]:
        u = self.text.usage()
        usage = {
            "input_tokens": u["prompt_tokens"],
            "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
        }
        log.info("%s: request completed", SPEECH, extra={"request_id": self.rid})
        return [sse({"type": "speech.audio.done", "usage": usage}, "speech.audio.done")]
