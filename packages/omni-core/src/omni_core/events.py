"""The one event schema and the control messages, as small typed msgspec Structs.

Every message that crosses a process boundary is one of the Structs below; nothing on
the wire is pickled. Large arrays never ride inside a message: ``device_handles`` maps a
name to either a :class:`ShmHandle` (the bytes sit in a shared-memory slot) or, under the
inline threshold, an :class:`InlineArray`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

# --------------------------------------------------------------------------- handles


class ShmHandle(msgspec.Struct, tag="shm", array_like=True, frozen=True):
    """Where an array lives in a shared-memory segment owned by the orchestrator."""

    segment: str  # file name under /dev/shm
    offset: int
    nbytes: int
    dtype: str  # numpy dtype string; "bytes" for a raw bytes payload
    shape: tuple[int, ...]
    producer: str  # stage that rented the slot and gets the release
    rental: int = 0  # the producer's rental id for this use of the slot
    torch: bool = False  # hand the receiver a torch tensor instead of a numpy array


class InlineArray(msgspec.Struct, tag="inline", array_like=True, frozen=True):
    """A small array (or bytes) carried inside the message itself."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]
    torch: bool = False


Handle = ShmHandle | InlineArray

# --------------------------------------------------------------------------- events


class Event(msgspec.Struct, tag_field="event_type", kw_only=True, dict=True):
    """Base of every data-plane event.

    On the wire ``sequence`` is strict per (request, emitting stage); the caller sees it
    renumbered strictly per request. Events handed to the caller also carry ``arrays``
    (the resolved ``device_handles``), an attribute that never goes on the wire.
    """

    request_id: str
    """The request this event belongs to."""
    sequence: int = 0
    """Its place in the request's stream (stamped by the runtime)."""
    ts: float = msgspec.field(default_factory=time.time)
    """When it was made, in seconds since the epoch."""
    stage: str = ""
    """The name of the stage that emitted it (stamped by the runtime)."""
    payload: dict[str, Any] = msgspec.field(default_factory=dict)
    """The stage's own data, e.g. ``{"text": delta}``: what msgpack encodes, with string
    keys."""
    device_handles: dict[str, Handle] = msgspec.field(default_factory=dict)
    """Where the event's arrays travel (set by the runtime); read ``arrays`` instead."""

    @property
    def event_type(self) -> str:
        """``segment``, ``image``, ``completed``, ``error`` or ``cancelled``."""
        return type(self).__struct_config__.tag  # type: ignore[return-value]

    @property
    def terminal(self) -> bool:
        """True for the one event that ends a request (completed, error, cancelled)."""
        return False


class Segment(Event, tag="segment", kw_only=True):
    """A run of output units (AR tokens, or rows of arrays along axis 0)."""

    tokens: list[int] | None = None
    """The token ids of the segment's units (AR stages); ``None`` for arrays or payload
    only."""
    logprobs: list[float] | None = None
    """One logprob per token, where the stage computes them."""
    is_last: bool = False
    """The emitting stage's last segment for this request."""
    # The original request travels with the first event of a request on each edge, so a
    # downstream stage knows the request's parameters without a second channel.
    request: dict[str, Any] | None = None
    """The original request, with a request's first event on each edge (set by the
    runtime)."""
    routes: dict[str, int] | None = None
    """The request's replica bindings (replicated stage -> replica index), with the
    original request (set by the runtime)."""


class SegmentRun(msgspec.Struct, tag="segment_run", tag_field="event_type", kw_only=True, gc=False):
    """Consecutive array-free segments of one request from one stage, in columns.

    The wire form a sender gives such a run (one struct to encode and decode, not one per
    event): what a batched decode step or a fast stream emits. Receivers either take the
    columns as they are (a stage worker's windows) or expand it (:meth:`segments`). It holds
    decoded data only, so it need not be tracked by the cycle collector (``gc=False``).
    """

    request_id: str
    stage: str
    sequence: int  # of the first segment; the others follow one by one
    ts: list[float]
    tokens: list[list[int] | None]
    payloads: list[dict[str, Any]]
    logprobs: list[list[float] | None] | None = None
    is_last: bool = False  # of the last segment (no segment follows one that ends a stream)
    request: dict[str, Any] | None = None  # of the first segment
    routes: dict[str, int] | None = None  # of the first segment

    def __post_init__(self) -> None:  # also on decode: a malformed run fails there
        n = len(self.payloads)
        if n == 0 or len(self.ts) != n or len(self.tokens) != n:
            raise ValueError("a segment run's columns must have one entry per segment")
        if self.logprobs is not None and len(self.logprobs) != n:
            raise ValueError("a segment run's logprobs must have one entry per segment")

    @classmethod
    def of(
        cls,
        segments: list[Segment],
        stage: str,
        sequence: int,
        request: dict[str, Any] | None = None,
        routes: dict[str, int] | None = None,
    ) -> SegmentRun:
        """The run of ``segments`` (of one request; only the last may end its stream),
        numbered from ``sequence``."""
        lps = [s.logprobs for s in segments]
        return cls(
            request_id=segments[0].request_id,
            stage=stage,
            sequence=sequence,
            ts=[s.ts for s in segments],
            tokens=[s.tokens for s in segments],
            payloads=[s.payload for s in segments],
            logprobs=None if lps.count(None) == len(lps) else lps,
            is_last=segments[-1].is_last,
            request=request,
            routes=routes,
        )

    def __len__(self) -> int:
        return len(self.payloads)

    def segments(self) -> list[Segment]:
        n = len(self.payloads)
        lps = self.logprobs or [None] * n
        return [
            Segment(
                request_id=self.request_id,
                sequence=self.sequence + i,
                ts=self.ts[i],
                stage=self.stage,
                payload=self.payloads[i],
                tokens=self.tokens[i],
                logprobs=lps[i],
                is_last=self.is_last and i == n - 1,
                request=self.request if i == 0 else None,
                routes=self.routes if i == 0 else None,
            )
            for i in range(n)
        ]

    def tail(self, start: int) -> SegmentRun:
        """The segments from index ``start`` on."""
        return SegmentRun(
            request_id=self.request_id,
            stage=self.stage,
            sequence=self.sequence + start,
            ts=self.ts[start:],
            tokens=self.tokens[start:],
            payloads=self.payloads[start:],
            logprobs=self.logprobs[start:] if self.logprobs is not None else None,
            is_last=self.is_last,
        )


class ImageProgress(Event, tag="image", kw_only=True):
    """A diffusion preview (``is_last=False``) or the final image (``is_last=True``)."""

    step: int = 0
    """The denoising step the image shows."""
    is_last: bool = False
    """``False``: a preview, which may be dropped or replaced by a newer one under
    backpressure; ``True``: the final image."""
    request: dict[str, Any] | None = None
    """The original request, with a request's first event on each edge (set by the
    runtime)."""
    routes: dict[str, int] | None = None
    """The request's replica bindings (replicated stage -> replica index), with the
    original request (set by the runtime)."""


class Completed(Event, tag="completed", kw_only=True):
    """The emitting stage is done with the request; on an edge it also closes the stream."""

    request: dict[str, Any] | None = None
    """The original request, when this is the request's first event on an edge."""
    routes: dict[str, int] | None = None
    """The request's replica bindings (replicated stage -> replica index), with the
    original request (set by the runtime)."""

    @property
    def terminal(self) -> bool:
        """True: a request's ``completed`` event ends it."""
        return True


class Error(Event, tag="error", kw_only=True):
    """The request failed at ``stage``; ends that request only."""

    message: str = ""
    """What went wrong, naming the stage."""
    code: str = "stage_error"
    """A stable code: ``stage_error`` (the stage failed the request), ``stage_died``,
    ``stage_hung``, ``bad_message``, ``bad_output``, ``runtime_failed``, ... (see the failure
    model)."""

    @property
    def terminal(self) -> bool:
        """True: an ``error`` event ends its request."""
        return True


class Cancelled(Event, tag="cancelled", kw_only=True):
    """The request was cancelled (``reason='cancelled'``) or ran out of time (``'timeout'``)."""

    reason: Literal["cancelled", "timeout"] = "cancelled"
    """``cancelled`` (``Pipeline.cancel``) or ``timeout`` (the request's deadline passed)."""

    @property
    def terminal(self) -> bool:
        """True: a ``cancelled`` event ends its request."""
        return True


AnyEvent = Segment | ImageProgress | Completed | Error | Cancelled
"""Any event of a request's stream, as a caller receives it."""


def is_droppable(ev: Event) -> bool:
    """A preview after a request's first event: may be coalesced under backpressure.

    It carries the sequence number of the next must-deliver event and does not consume it,
    so dropping it leaves no gap in the per-request order.
    """
    return type(ev) is ImageProgress and not ev.is_last and ev.sequence > 0


DATA_EVENTS = (Segment, ImageProgress)

# --------------------------------------------------------------------------- control


class Submit(msgspec.Struct, tag="submit", tag_field="event_type", kw_only=True):
    """Orchestrator -> source stage: a new request."""

    request_id: str
    request: dict[str, Any]
    deadline: float | None = None  # time.time() after which the request times out
    # replicated stage -> the replica the request is bound to (it travels on with the
    # request's first event on each edge, so every sender routes it alike)
    routes: dict[str, int] | None = None


class Cancel(msgspec.Struct, tag="cancel", tag_field="event_type", kw_only=True):
    """Orchestrator -> every stage: drop all work and state of a request."""

    request_id: str
    reason: str = "cancelled"


class Release(msgspec.Struct, tag="release", tag_field="event_type", kw_only=True):
    """Reader -> producer: these slots ((offset, rental) in the producer's arena ``segment``)
    are no longer read. A release for another segment (an earlier life of the producer)
    or another rental is ignored."""

    slots: list[tuple[int, int]]
    segment: str
    reader: str


class ReaderLost(msgspec.Struct, tag="reader_lost", tag_field="event_type", kw_only=True):
    """Orchestrator -> producer: a reader's worker died; drop every slot reference it held."""

    reader: str


class SegmentGone(msgspec.Struct, tag="segment_gone", tag_field="event_type", kw_only=True):
    """Orchestrator -> reader: a producer died and its segment was unlinked; unmap it."""

    segment: str


class Shutdown(msgspec.Struct, tag="shutdown", tag_field="event_type", kw_only=True):
    """Orchestrator -> worker: stop; ``drain`` finishes queued work first (until the deadline)."""

    drain: bool = False
    deadline: float | None = None


class Ready(msgspec.Struct, tag="ready", kw_only=True):
    """Worker -> orchestrator: the stage loaded and the loop runs."""

    stage: str
    pid: int
    load_s: float


class LoadFailed(msgspec.Struct, tag="load_failed", kw_only=True):
    """Worker -> orchestrator: the stage could not start; the worker exits after this."""

    stage: str
    pid: int
    message: str


class StageStats(msgspec.Struct, kw_only=True):
    """Counters a worker reports with each heartbeat."""

    received: int = 0  # data events taken in (enqueued)
    dequeued: int = 0  # work items the stage took
    # how long the work items the stage took had waited in its queue (received by the
    # I/O thread -> taken by the stage thread): in all, and the longest one
    queued_s: float = 0.0
    queued_max_s: float = 0.0
    emitted: int = 0  # events sent out
    window_triggers: int = 0
    queue_depth: int = 0  # work items waiting
    inflight: int = 0
    paused: int = 0  # batches paused for better requests (scheduler_policy: priority)
    preemptions: int = 0  # times a batch was paused for a better request
    outbox_depth: int = 0
    blocked_s: float = 0.0  # time the stage waited on a full socket / shared-memory pool
    dropped: int = 0  # previews coalesced away under backpressure
    completed: int = 0
    errors: int = 0
    shm_slots_in_use: int = 0
    steps: int = 0  # generator steps the stage thread finished (its progress)
    busy_s: float = 0.0  # how long the stage thread has been inside its current step
    gpu_mem_allocated_bytes: int = 0  # torch's allocator, this worker (0: no CUDA used)
    gpu_mem_reserved_bytes: int = 0
    gpu_util_pct: float | None = None  # the device's utilisation (NVML), where available


class TraceSpan(msgspec.Struct, array_like=True):
    """One trigger of a stage: which requests, from when to when, how many events out."""

    requests: list[str]
    start: float
    end: float
    outputs: int
    window: int  # the trigger's index for its request at this stage (first request)


class TraceMark(msgspec.Struct, array_like=True):
    """One event a stage emitted."""

    request_id: str
    sequence: int
    event_type: str
    ts: float


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    """Worker -> orchestrator, every ``heartbeat_interval_s``; carries trace records when on."""

    stage: str
    pid: int
    ts: float
    stats: StageStats
    spans: list[TraceSpan] = msgspec.field(default_factory=list)
    marks: list[TraceMark] = msgspec.field(default_factory=list)


class Ack(msgspec.Struct, tag="ack", kw_only=True):
    """Worker -> orchestrator: a control message took effect (``cancel``), or the whole
    stream of a request from ``source`` arrived (``edge_end``: the request no longer
    depends on that upstream worker staying alive)."""

    stage: str
    kind: str
    request_id: str = ""
    source: str = ""


ToWorker = Submit | Cancel | Release | ReaderLost | SegmentGone | Shutdown
ToOrchestrator = Ready | LoadFailed | Heartbeat | Ack
