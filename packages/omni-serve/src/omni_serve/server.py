"""The state every route shares: the pipeline, the settings, the metrics, what the
pipeline serves; read by routes through the :func:`server_of` dependency."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from omni_core import Pipeline
from omni_core.errors import UserInputError
from omni_core.scheduling import PRIORITY_KEY, check_priority

from omni_serve.body import BodyBudget
from omni_serve.errors import APIError, bad_field, user_input
from omni_serve.fair import FairSlot, WorkShares
from omni_serve.limits import PromptLimits, TokenLimit, prompt_limits, token_limit
from omni_serve.metrics import ServerMetrics
from omni_serve.settings import ServeSettings
from omni_serve.shares import CLIENT, SharedPipeline, Shares

# stage kinds, read from the config (no family is imported for them)
AUDIO_SOURCES = {"speech.thinker"}  # reads audio (and image) parts
# reads `modalities`, `audio`, `voice`, `input` (the embedded voice's intake: text only)
SPEECH_SOURCES = {*AUDIO_SOURCES, "speech.voice_intake"}
TEXT_SOURCES = {"ar.intake", "ar.mm_intake", *SPEECH_SOURCES}
MM_SOURCES = {"ar.mm_intake", *AUDIO_SOURCES}  # reads chat image parts
IMAGE_STAGES = {"dit.plan"}
# encodes audio: its events carry the bytes, their MIME type as ``media_type`` (audio/*)
AUDIO_STAGES = {"speech.audio_encode"}
SPEECH = "/v1/audio/speech"


def speaks(config: Any) -> bool:
    """The pipeline answers with audio: its source reads the speech fields and a stage of
    an :data:`AUDIO_STAGES` kind streams to the caller (``client_stream: true``, or a sink
    left at its default)."""
    if not {s.kind for s in config.stages} & SPEECH_SOURCES:
        return False
    senders = {e.source for e in config.edges}
    return any(
        s.kind in AUDIO_STAGES
        and (s.client_stream is True or s.client_stream is None and s.name not in senders)
        for s in config.stages
    )


def endpoints(pipe: Pipeline) -> list[str]:
    """What the pipeline can answer: images when it has DiT stages (a mixed pipeline's
    text is the image's revised prompt), else text when its source is an AR intake or a
    speech thinker, and speech too when it :func:`speaks`."""
    kinds = {s.kind for s in pipe.config.stages}
    if kinds & IMAGE_STAGES:
        return ["/v1/images/generations"]
    if kinds & TEXT_SOURCES:
        text = ["/v1/chat/completions", "/v1/completions"]
        return [*text, SPEECH] if speaks(pipe.config) else text
    return []


@dataclass
class Server:
    """One served pipeline and what the routes need around it."""

    pipe: Pipeline
    settings: ServeSettings
    metrics: ServerMetrics = field(init=False)
    served: list[str] = field(init=False)
    images: bool = field(init=False)  # chat requests may carry images
    # the source reads audio parts and `modalities` (a speech thinker)
    audio_in: bool = field(init=False)
    audio_out: bool = field(init=False)  # an audio stage streams to the caller
    # the largest max_tokens, as the pipeline's stages declare it (None: none declares it)
    max_tokens_limit: TokenLimit | None = field(init=False)
    # the characters of a prompt, a chat and a negative prompt, from the stages' limits
    prompt_limits: PromptLimits = field(init=False)
    bodies: BodyBudget = field(init=False)  # request bodies held at once, server-wide
    shares: Shares = field(init=False)  # what each client holds (omni_serve.shares)
    created: int = field(default_factory=lambda: int(time.time()))
    # each client's heavy body work (both slots below), held to its share (omni_serve.fair)
    work: WorkShares = field(init=False)
    # big bodies are parsed off the event loop one at a time (omni_serve.body.off_loop)
    parsing: FairSlot = field(init=False)
    # chat images' headers are read in a slot of their own (omni_serve.media.check_images)
    image_headers: FairSlot = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.pipe)
        self.served = endpoints(self.pipe)
        kinds = {s.kind for s in self.pipe.config.stages}
        self.images = bool(kinds & MM_SOURCES)
        self.audio_in = bool(kinds & AUDIO_SOURCES)
        self.audio_out = speaks(self.pipe.config)
        self.max_tokens_limit = token_limit(self.pipe.config.stages)
        self.prompt_limits = prompt_limits(self.pipe.config.stages, self.pipe.config.edges)
        assert self.settings.max_body_bytes_in_flight is not None  # set by ServeSettings
        self.bodies = BodyBudget(self.settings.max_body_bytes_in_flight)
        self.work = WorkShares(self.settings.body_work_share)
        self.parsing, self.image_headers = FairSlot(self.work), FairSlot(self.work)
        self.metrics.body_bytes.set_function(lambda: self.bodies.used)
        s = self.settings
        self.shares = Shares(
            s.keys, s.max_connections_per_address, self.metrics, s.max_running_requests
        )
        if s.keys:  # each pipeline request counted against its key (max_queued)
            self.metrics.track_shares(self.shares.usage)
            self.pipe = SharedPipeline(self.pipe, self.shares)  # type: ignore[assignment]

    def observe(self, endpoint: str, status: int, t0: float) -> None:
        self.metrics.http_requests.labels(endpoint, str(status)).inc()
        self.metrics.http_seconds.labels(endpoint).observe(time.monotonic() - t0)

    @property
    def timeout_cap_s(self) -> float | None:
        """The longest a request may run: ``--request-timeout``, else the config's."""
        cap = self.settings.request_timeout_s
        return cap if cap is not None else self.pipe.config.request_timeout_s

    def timeout_of(self, body_timeout: float | None) -> float | None:
        """A request's timeout: its ``timeout_s`` may lower the cap, never raise it."""
        cap = self.timeout_cap_s
        if body_timeout is None:
            return cap
        return body_timeout if cap is None else min(body_timeout, cap)

    def check_model(self, name: str | None, path: str) -> None:
        if path not in self.served:
            offer = ", ".join(self.served) or "no OpenAI endpoint (a pipeline of other stages)"
            raise APIError(
                404,
                f"pipeline {self.pipe.config.name!r} does not serve {path}; it serves {offer}",
                code="unsupported_endpoint",
            )
        if name not in (None, "", self.settings.model_name):
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_priority(self, priority: int) -> None:
        """A 400 naming ``priority`` where the pipeline would refuse it (not 0 while no
        stage schedules by priority, as vLLM's server refuses it without priority
        scheduling) or the request's key may not ask for it (better than its
        ``best_priority``, which is at most 0), before any request of the body is
        submitted."""
        if priority == 0:
            return
        key = CLIENT.get()
        if key is not None and key.best_priority is not None and priority < key.best_priority:
            self.metrics.refusals.labels(key.name, "priority").inc()
            raise bad_field(
                "priority",
                f"{priority} is better than key {key.name!r} may ask for: its best_priority "
                f"is {key.best_priority} (lower runs first)",
            )
        try:
            check_priority({PRIORITY_KEY: priority}, self.pipe.config)
        except UserInputError as e:
            raise user_input(str(e)) from None

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.settings.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "omni",
            "omni": {
                "pipeline": self.pipe.config.name,
                "endpoints": self.served,
                "stages": [s.name for s in self.pipe.config.stages],
            },
        }


def pipeline_id(request: Request) -> str:
    """The pipeline's id for this request, unique among open requests: the request id
    when the server made it, else the client's id with a unique suffix."""
    state = request.scope.get("state", {})
    rid = str(state.get("request_id") or "")
    if rid and not state.get("client_request_id"):
        return rid
    return f"{rid}-{uuid.uuid4().hex[:12]}" if rid else uuid.uuid4().hex


def server_of(request: Request) -> Server:
    return request.app.state.server  # type: ignore[no-any-return]


ServerDep = Annotated[Server, Depends(server_of)]
