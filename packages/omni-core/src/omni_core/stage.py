"""What a stage plug-in implements, and what it is handed.

A stage is a class registered under the ``omni.stages`` entry-point group. The runtime
builds it inside its own worker process, calls :meth:`Stage.load` once (models load there,
never in the orchestrator), then feeds it batches of :class:`StageInput` and forwards the
events :meth:`Stage.process` yields (the runtime stamps their sequence and stage).
Between two yields the runtime may cancel a request, so a stage that yields often can be
stopped quickly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgspec

from omni_core.dataplane.windows import Window
from omni_core.errors import UserInputError
from omni_core.events import Error, ImageProgress, Segment
from omni_core.placement import Placement, place
from omni_core.scheduling import SchedulerPolicy, request_priority

_E = TypeVar("_E", Segment, ImageProgress)

StageEvent = Segment | ImageProgress | Error
"""What :meth:`Stage.process` yields (or lists of them), made with
:meth:`StageInput.segment`, :meth:`StageInput.image` and :meth:`StageInput.fail`."""


@dataclass
class StageContext:
    """Facts about the place a stage runs in, handed to its constructor."""

    name: str
    """The stage's name in the pipeline."""
    kind: str
    """Its registered kind."""
    options: dict[str, Any]
    """The ``options:`` of its config, as written (``Stage.options`` is the validated
    form)."""
    devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` as set for this worker (``None``: inherited)."""
    upstream: tuple[str, ...] = ()
    """The names of the stages that feed it."""
    downstream: tuple[str, ...] = ()
    """The names of the stages it feeds."""
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("omni.stage"))
    """A logger for the stage."""
    scheduler_policy: SchedulerPolicy = "fcfs"
    """How the runtime orders the requests waiting in this stage (see
    :mod:`omni_core.scheduling`); a stage over an engine with a scheduler of its own
    passes :attr:`StageInput.priority` on to it under ``priority``."""

    def place(self, dtype: str | None = None) -> Placement:
        """Where this stage's models go: the first GPU its worker sees (``cuda:0``, made
        the current device) or the CPU, and ``dtype`` (``None`` or ``"auto"``: float32
        on a CPU, bfloat16 or float16 on a GPU). Call it in :meth:`Stage.load`: it
        imports torch. A GPU the worker does not have is a
        :class:`~omni_core.placement.DeviceError` naming the stage."""
        return place(self.name, self.devices, dtype)


def _with_arrays(ev: _E, arrays: dict[str, Any] | None) -> _E:
    """Attach a stage's arrays (not a wire field: the runtime packs them into handles)."""
    if arrays:
        ev.arrays = arrays  # type: ignore[attr-defined]
    return ev


@dataclass
class StageInput:
    """One trigger of a stage for one request: the request itself and a window per edge."""

    request_id: str
    """The request's id."""
    request: dict[str, Any]
    """The request as submitted (its parameters: ``prompt``, ``max_tokens``, ...)."""
    windows: dict[str, Window]
    """This trigger's window of each inbound edge, by upstream stage name; empty for a
    source stage."""
    first: bool
    """The first trigger for this request at this stage."""
    last: bool
    """No more triggers will follow for this request: the stage's last event for it
    should have ``is_last=True``."""
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        """True once the request was cancelled, timed out or failed elsewhere."""
        return self._cancelled.is_set()

    @property
    def priority(self) -> int:
        """The request's priority (lower first; 0 unless it set one)."""
        return request_priority(self.request)

    @property
    def window(self) -> Window:
        """The single upstream window (for stages with exactly one inbound edge)."""
        if len(self.windows) != 1:
            raise ValueError(
                f"request {self.request_id}: stage has {len(self.windows)} inbound windows; "
                "use .windows[edge]"
            )
        return next(iter(self.windows.values()))

    def segment(
        self,
        tokens: list[int] | None = None,
        *,
        logprobs: list[float] | None = None,
        payload: dict[str, Any] | None = None,
        arrays: dict[str, Any] | None = None,
        is_last: bool = False,
    ) -> Segment:
        """A segment event for this request; ``arrays`` (numpy, CPU torch, bytes) go
        inline or through shared memory, by size."""
        ev = Segment(
            request_id=self.request_id,
            tokens=tokens,
            logprobs=logprobs,
            payload=payload if payload is not None else {},
            is_last=is_last,
        )
        return _with_arrays(ev, arrays)

    def image(
        self,
        step: int,
        *,
        payload: dict[str, Any] | None = None,
        arrays: dict[str, Any] | None = None,
        is_last: bool = False,
    ) -> ImageProgress:
        """A preview (``is_last=False``, droppable under backpressure) or the final image."""
        ev = ImageProgress(
            request_id=self.request_id,
            step=step,
            payload=payload if payload is not None else {},
            is_last=is_last,
        )
        return _with_arrays(ev, arrays)

    def fail(self, message: str | UserInputError) -> Error:
        """End this request (only) with an error; the runtime prefixes the stage's name.
        A :class:`UserInputError` is the client's fault, its message theirs to see (code
        ``invalid_request``); a plain message is the stage's failure (``stage_error``)."""
        if isinstance(message, UserInputError):
            return Error(request_id=self.request_id, message=str(message), code=message.code)
        return Error(request_id=self.request_id, message=message)


class Stage:
    """Base class of stage plug-ins.

    Subclasses may set ``Options`` to a ``msgspec.Struct`` type: the ``options`` of the
    stage's config are validated against it when the pipeline config is loaded, and
    ``self.options`` is then an instance of it.
    """

    Options: ClassVar[type[msgspec.Struct] | None] = None
    """The ``msgspec.Struct`` the stage's ``options:`` are validated against (``None``:
    ``self.options`` is the dict as written)."""
    idempotent: ClassVar[bool] = False
    """``True``: requests this stage loses in a crash are replayed after its restart
    instead of failed; only where running a request again gives the same events."""
    preload: ClassVar[tuple[str, ...]] = ()
    """Modules the pipeline's zygote imports before it forks this stage's workers (the
    heavy libraries :meth:`load` needs: ``("torch", "diffusers")``), so that a worker
    starts with them in memory. See :meth:`preload_modules`."""
    forkable: ClassVar[bool] = True
    """``False``: this stage's workers are always spawned as fresh interpreters, never
    forked from the zygote (a stage whose libraries cannot survive a fork)."""
    preemptible: bool = False
    """``True``: under ``scheduler_policy: priority`` the runtime may pause a running
    batch of this stage (stop advancing its ``process`` generator between two yields,
    after :meth:`pause`) so that a better request runs first, and resume it later
    (:meth:`resume`, then advance it again). Only for a stage whose paused generator
    holds no compute the others wait on (one whose requests share an engine's batch
    takes them out of it in :meth:`pause`). A class attribute, or set in ``__init__``
    where it depends on the options (the engine)."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.options: Any = (
            msgspec.convert(ctx.options, self.Options) if self.Options is not None else ctx.options
        )

    @classmethod
    def preload_modules(cls, options: dict[str, Any]) -> tuple[str, ...]:
        """What the zygote imports for a stage of this kind with these ``options`` (as
        written in the config): :attr:`preload` unless a subclass decides by its options
        (the engine it will run, say). Importing must start no thread and touch no
        device."""
        return cls.preload

    def load(self) -> None:
        """Load models and warm up; runs once, inside the worker process."""

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | list[StageEvent] | None]:
        """Yield events for the inputs in ``batch`` (one unless ``max_batch_size`` > 1),
        made with ``inp.segment``, ``inp.image`` or ``inp.fail``.

        A stage that makes several events in one step (a batched decode step: a token for
        each request) may yield them as one list; they go out in that order, and the
        runtime handles the list at once, which is much cheaper than one yield per event.

        Yielding ``None`` emits nothing: it gives the stage's other requests in flight
        (``max_inflight`` > 1) a turn first. A stage over a continuous-batching engine
        submits a new request and yields None, so every request that arrived together is
        in the engine before its next step, rather than joining one step at a time.
        """
        raise NotImplementedError

    def end_request(self, request_id: str) -> None:
        """Forget per-request state: the request finished here, or was cancelled."""

    def pause(self, request_ids: list[str]) -> None:
        """(A :attr:`preemptible` stage.) These requests' generator is paused for a
        better request: take them out of any compute shared with the others."""

    def resume(self, request_ids: list[str]) -> None:
        """(A :attr:`preemptible` stage.) Their generator runs again: put them back."""

    def close(self) -> None:
        """Release what :meth:`load` acquired."""
