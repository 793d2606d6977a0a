"""What a stage plug-in implements, and what it is handed.

A stage is a class registered under the ``omni.stages`` entry-point group. The runtime
builds it inside its own worker process, calls :meth:`Stage.load` once (models load there,
never in the orchestrator), then feeds it batches of :class:`StageInput` and forwards what
:meth:`Stage.process` yields. Between two yields the runtime may cancel a request, so a
stage that yields often can be stopped quickly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgspec

from omni_core.windows import Window


@dataclass
class StageContext:
    """Facts about the place a stage runs in, handed to its constructor."""

    name: str  # the stage's name in the pipeline
    kind: str  # its registered kind
    options: dict[str, Any]
    devices: str | None = None  # CUDA_VISIBLE_DEVICES as set for this worker
    upstream: tuple[str, ...] = ()
    downstream: tuple[str, ...] = ()
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("omni.stage"))


@dataclass
class Output:
    """One thing a stage emits for one request; the runtime turns it into an event."""

    request_id: str
    kind: Literal["segment", "image", "error"] = "segment"
    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, Any] = field(default_factory=dict)  # numpy, CPU torch, or bytes
    is_last: bool = False
    step: int = 0
    droppable: bool = False  # a preview: may be coalesced under backpressure


@dataclass
class StageInput:
    """One trigger of a stage for one request: the request itself and a window per edge."""

    request_id: str
    request: dict[str, Any]
    windows: dict[str, Window]  # by upstream stage name; empty for a source stage
    first: bool  # the first trigger for this request at this stage
    last: bool  # no more triggers will follow for this request
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        """True once the request was cancelled, timed out or failed elsewhere."""
        return self._cancelled.is_set()

    @property
    def window(self) -> Window:
        """The single upstream window (for stages with exactly one inbound edge)."""
        if len(self.windows) != 1:
            raise ValueError(
                f"request {self.request_id}: stage has {len(self.windows)} inbound windows; "
                "use .windows[edge]"
            )
        return next(iter(self.windows.values()))

    def segment(self, tokens: list[int] | None = None, **kw: Any) -> Output:
        return Output(self.request_id, "segment", tokens=tokens, **kw)

    def image(self, step: int, **kw: Any) -> Output:
        return Output(self.request_id, "image", step=step, **kw)

    def fail(self, message: str) -> Output:
        """End this request (only) with an error naming the stage."""
        return Output(self.request_id, "error", payload={"message": message})


class Stage:
    """Base class of stage plug-ins.

    Subclasses may set ``Options`` to a ``msgspec.Struct`` type: the ``options`` of the
    stage's config are validated against it when the pipeline config is loaded, and
    ``self.options`` is then an instance of it.
    """

    Options: ClassVar[type[msgspec.Struct] | None] = None
    idempotent: ClassVar[bool] = False  # lost work may be replayed after a restart

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.options: Any = (
            msgspec.convert(ctx.options, self.Options) if self.Options is not None else ctx.options
        )

    def load(self) -> None:
        """Load models and warm up; runs once, inside the worker process."""

    def process(self, batch: list[StageInput]) -> Iterator[Output]:
        """Yield outputs for the inputs in ``batch`` (one unless ``max_batch_size`` > 1)."""
        raise NotImplementedError

    def end_request(self, request_id: str) -> None:
        """Forget per-request state: the request finished here, or was cancelled."""

    def close(self) -> None:
        """Release what :meth:`load` acquired."""
