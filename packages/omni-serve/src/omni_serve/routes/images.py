"""``POST /v1/images/generations``: ``n`` images are ``n`` pipeline requests (seeds
``seed + i``), merged into one answer; ``stream: true`` answers with SSE events (previews,
the final images and, for a mixed pipeline, the expanded prompt's text)."""

from __future__ import annotations

import base64
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from omni_core.client.image_files import png_bytes
from omni_core.events import AnyEvent, ImageProgress
from omni_core.media import media_type_of, subtype

from omni_serve.auth import require_api_key
from omni_serve.body import check_values, json_body, off_loop, parse_json
from omni_serve.errors import APIError
from omni_serve.middleware import request_id_of, started_at
from omni_serve.openai_api import IMAGE_PARAMS, ImageRequest, image_requests, parse
from omni_serve.server import Server, ServerDep, pipeline_id
from omni_serve.sse import SSEAnswer, merged, sse
from omni_serve.streams import TextState, collect, first_event

log = logging.getLogger("omni.serve")
router = APIRouter(dependencies=[Depends(require_api_key)])

IMAGES = "/v1/images/generations"
NO_USAGE = {
    "input_tokens": 0,
    "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    "output_tokens": 0,
    "total_tokens": 0,
}


def final_of(ev: AnyEvent) -> dict[str, Any] | None:
    """The final image an event carries: ``b64_json``, ``output_format``, ``size``."""
    if not (isinstance(ev, ImageProgress) and ev.is_last):
        return None
    data = ev.arrays.get("image")
    payload = ev.payload if isinstance(ev.payload, dict) else {}
    if not isinstance(data, bytes):
        return None
    media_type = media_type_of(payload)  # the core's contract for encoded bytes
    return {
        "b64_json": base64.b64encode(data).decode(),
        "output_format": subtype(media_type) if media_type else "png",
        "size": f"{payload.get('width', 0)}x{payload.get('height', 0)}",
    }


def prepare(server: Server, raw: bytearray) -> tuple[ImageRequest, list[dict[str, Any]]]:
    """The body as the OpenAI request and its pipeline requests, every value checked
    (run by :func:`off_loop`: in a worker thread for a big body)."""
    req = parse(ImageRequest, parse_json(raw))
    server.check_model(req.model, IMAGES)
    server.check_priority(req.priority)
    s = server.settings
    preqs = image_requests(
        req, s.max_image_pixels, s.max_images, server.max_tokens_limit, server.prompt_limits
    )
    for preq in preqs:
        check_values(preq, IMAGE_PARAMS)
    return req, preqs


@router.post(IMAGES)
async def images(request: Request, server: ServerDep) -> Response:
    t0 = started_at(request)
    async with json_body(request, server.settings.max_body_bytes) as raw:
        req, preqs = await off_loop(request, len(raw), functools.partial(prepare, server, raw))
    del raw  # held against the body budget no longer
    rid = request_id_of(request)
    pid = pipeline_id(request)
    pids = [pid if len(preqs) == 1 else f"{pid}-{i}" for i in range(len(preqs))]
    log.info(
        "%s: request started (n=%d, pipeline id %s)",
        IMAGES,
        len(preqs),
        pid,
        extra={"request_id": rid},
    )
    stream = merged(server.pipe, preqs, pids, server.timeout_of(req.timeout_s))
    if not req.stream:
        per = await collect(request, stream, len(preqs), rid, IMAGE_PARAMS)
        return complete(server, t0, rid, per)
    first = await first_event(request, stream, rid, IMAGE_PARAMS)
    writer = ImageChunks(rid, [TextState() for _ in preqs], req.partial_images)
    return SSEAnswer(server, IMAGES, t0, rid, IMAGE_PARAMS).response(first, stream, writer)


def complete(server: Server, t0: float, rid: str, per: list[list[AnyEvent]]) -> Response:
    """The non-streaming answer: every image (and its revised prompt)."""
    data, fmt, size = [], None, None
    for events in per:
        finals = [f for f in map(final_of, events) if f is not None]
        text = TextState()
        for ev in events:
            text.add(ev)
        if not finals:
            raise APIError(
                500, f"the pipeline made no image; request id {rid}", type="server_error"
            )
        item: dict[str, Any] = {"b64_json": finals[-1]["b64_json"]}
        if text.text:
            item["revised_prompt"] = text.text
        data.append(item)
        fmt, size = finals[-1]["output_format"], finals[-1]["size"]
    log.info("%s: request completed", IMAGES, extra={"request_id": rid})
    server.observe(IMAGES, 200, t0)
    return JSONResponse(
        {"created": int(time.time()), "data": data, "output_format": fmt, "size": size}
    )


@dataclass
class ImageChunks:
    """An image request's SSE events: OpenAI's ``image_generation.partial_image`` (at most
    ``limit`` per image) and ``image_generation.completed``, and ``omni.text.delta``."""

    rid: str
    texts: list[TextState]
    limit: int | None
    partials: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.partials = [0] * len(self.texts)

    def chunks(self, i: int, ev: AnyEvent) -> list[bytes]:
        delta = self.texts[i].add(ev)
        if delta:
            return [sse({"type": "omni.text.delta", "index": i, "delta": delta})]
        final = final_of(ev)
        if final is not None:
            return [self.completed(i, final)]
        preview = ev.arrays.get("preview") if isinstance(ev, ImageProgress) else None
        if preview is None or (self.limit is not None and self.partials[i] >= self.limit):
            return []
        self.partials[i] += 1
        h, w = preview.shape[:2]
        part = {
            "type": "image_generation.partial_image",
            "b64_json": base64.b64encode(png_bytes(preview)).decode(),
            "partial_image_index": self.partials[i] - 1,
            "created_at": int(time.time()),
            "output_format": "png",
            "size": f"{w}x{h}",
            "background": "opaque",
            "quality": "auto",
            "index": i,
            "step": ev.step,
        }
        return [sse(part, part["type"])]

    def completed(self, i: int, final: dict[str, Any]) -> bytes:
        done = {
            "type": "image_generation.completed",
            "created_at": int(time.time()),
            "background": "opaque",
            "quality": "auto",
            "usage": NO_USAGE,
            "index": i,
            **final,
        }
        if self.texts[i].text:
            done["revised_prompt"] = self.texts[i].text
        return sse(done, done["type"])

    def closing(self) -> list[bytes]:
        log.info("%s: request completed", IMAGES, extra={"request_id": self.rid})
        return []
