"""A worker's work queue and stage thread without a process or sockets: a scripted stage
that writes down what it was asked to do and when, a sender and an outbox that record
what left, and the I/O thread's side (submit, cancel, stop) as plain calls. Tests of the
scheduler and the queue read the order of steps, pauses, ends and outputs from them.

The scripted stage does what each request says: ``steps`` (default 3) steps, one token
each (the step number); ``out``: ``"one"`` (an event per yield, the default), ``"list"``
(one list per step for the whole batch) or ``"turn"`` (a ``None`` turn before each
step); ``raise_at`` / ``fail_at``: the step at which ``process`` raises (``raise``:
``"user"`` for a :class:`UserInputError`) or yields ``inp.fail``; ``chunks``: segments
per step (default 1); ``arrays``: a value sent as the array ``x`` of each segment.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from omni_core.config import parse_config
from omni_core.dataplane.serial import ArrayCodec
from omni_core.errors import UserInputError
from omni_core.events import Release, Segment, SegmentRun, ShmHandle, Submit
from omni_core.stage import Stage, StageEvent, StageInput
from omni_core.worker.host import StageHost, WorkItem, stage_context
from omni_core.worker.stage_thread import StageThread
from omni_core.worker.state import WorkerState
from omni_core.worker.work_queue import WorkQueue

from omni_testing.configs import chain
from omni_testing.stages import Count

SEGMENT = "omni-1-src-0-" + "0" * 16  # a slot of the producer's arena


def slot(offset: int, producer: str = "src") -> ShmHandle:
    """A shared-memory slot of ``producer`` that a work item holds until it ran."""
    return ShmHandle(SEGMENT, offset, 4, "|u1", (4,), producer, 1)


class Outbox:
    """The worker's outbox: what the I/O thread would send, in order (``block`` too)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []
        self.blocking: list[bool] = []

    def put(self, dest: str, msg: Any, block: bool = True) -> None:
        self.sent.append((dest, msg))
        self.blocking.append(block)

    def released(self) -> list[int]:
        """The offsets of the slots given back, in order."""
        return [off for _, m in self.sent if type(m) is Release for off, _ in m.slots]


class Kicks:
    """A waker that counts how often the I/O thread was woken."""

    def __init__(self) -> None:
        self.n = 0

    def kick(self) -> None:
        self.n += 1

    def wake(self) -> None:
        self.n += 1


class Wakes(threading.Condition):
    """``WorkerState.work`` that counts how often the stage thread was notified."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.n = 0

    def notify(self, n: int = 1) -> None:
        self.n += 1
        super().notify(n)


class Sent:
    """The stage thread's sender: every event it put, in order, and ``"flush"`` marks;
    ``rig.outside`` gets the step clock at each call (a call is never inside a step)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.log: list[tuple[str, Any]] = []  # (destination, event) or ("flush", None)
        self.counts: list[tuple[str, int]] = []  # put_many: (destination, events said)

    def put(self, dest: str, msg: Any, droppable: bool = False) -> None:
        self.rig.outside.append(self.rig.state.step_started)
        self.log.append((dest, msg))

    def put_many(self, dest: str, msgs: list[Any], events: int) -> None:
        self.rig.outside.append(self.rig.state.step_started)
        self.counts.append((dest, events))
        for m in msgs:
            self.log.extend((dest, s) for s in (m.segments() if type(m) is SegmentRun else [m]))

    def flush(self) -> None:
        self.log.append(("flush", None))

    def events(self, dest: str = "client") -> list[tuple[str, str, Any]]:
        """(request, event type, tokens or message) of what went to ``dest``, in order."""
        return [
            (e.request_id, e.event_type, getattr(e, "tokens", None) or getattr(e, "message", None))
            for d, e in self.log
            if d == dest
        ]


class Script(Stage):
    """The scripted stage (see the module's docstring); ``log`` is what it was asked:
    ``"a0"`` step 0 of request ``a``'s batch (``"a+b0"`` for a batch of two), ``"pause a"``,
    ``"resume a"``, ``"close a"`` (its generator closed before its end), ``"end a"``."""

    def __init__(self, rig: Rig, preemptible: bool) -> None:
        super().__init__(stage_context(rig.cfg, "loop", None))
        self.rig = rig
        self.preemptible = preemptible
        self.log: list[str] = []
        self.gens: list[Iterator[Any]] = []  # held, so that only the runtime closes them
        self.fail_pause = self.fail_resume = False

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | list[StageEvent] | None]:
        gen = self._run(batch)
        self.gens.append(gen)
        return gen

    def _run(self, batch: list[StageInput]) -> Iterator[StageEvent | list[StageEvent] | None]:
        name = "+".join(inp.request_id for inp in batch)
        out = batch[0].request.get("out", "one")
        try:
            for step in range(max(int(inp.request.get("steps", 3)) for inp in batch)):
                for inp in batch:
                    hook = self.rig.hooks.pop((inp.request_id, step), None)
                    if hook is not None:
                        hook()
                self.log.append(f"{name}{step}")
                events: list[StageEvent] = []
                for inp in batch:
                    r = inp.request
                    if r.get("raise_at") == step:
                        if r.get("raise") == "user":
                            raise UserInputError(f"{inp.request_id} asked too much")
                        raise RuntimeError(f"{inp.request_id} broke")
                    if r.get("fail_at") == step:
                        events.append(inp.fail(f"{inp.request_id} gave up"))
                    elif step < int(r.get("steps", 3)):
                        arrays = {"x": r["arrays"]} if "arrays" in r else None
                        last = step == int(r.get("steps", 3)) - 1
                        chunks = int(r.get("chunks", 1))
                        events.extend(
                            inp.segment([step], arrays=arrays, is_last=last and j == chunks - 1)
                            for j in range(chunks)
                        )
                if out == "list":
                    yield events
                    continue
                if out == "turn":
                    yield None
                yield from events
        except GeneratorExit:
            self.log.append(f"close {name}")
            raise

    def pause(self, request_ids: list[str]) -> None:
        self.rig.outside.append(self.rig.state.step_started)
        self.log.append(f"pause {'+'.join(request_ids)}")
        if self.fail_pause:
            raise RuntimeError("cannot pause")

    def resume(self, request_ids: list[str]) -> None:
        self.rig.outside.append(self.rig.state.step_started)
        self.log.append(f"resume {'+'.join(request_ids)}")
        if self.fail_resume:
            raise RuntimeError("cannot resume")

    def end_request(self, request_id: str) -> None:
        self.rig.outside.append(self.rig.state.step_started)
        self.log.append(f"end {request_id}")


class Rig:
    """One stage ``loop`` (a source stage streaming to the caller, or with ``sink``
    replicas downstream), its work queue and its stage thread; the test plays the I/O
    thread. ``run`` drains what was submitted in a thread of its own, as a worker does
    when told to stop with ``drain``; ``start`` / ``stop`` run it as a live worker."""

    def __init__(
        self,
        *,
        policy: str = "fcfs",
        preemptible: bool = False,
        max_inflight: int = 1,
        max_batch: int = 1,
        trace: bool = False,
        capacity: int = 16,
        sink_replicas: int = 0,
    ) -> None:
        stages: list[tuple[Any, ...]] = [
            ("loop", "synthetic.steps", {}, {"scheduler_policy": policy, "client_stream": True})
        ]
        if sink_replicas:
            stages.append(("sink", "synthetic.count", {}, {"replicas": sink_replicas}))
        self.cfg = parse_config(chain(*stages))
        self.hooks: dict[tuple[str, int], Callable[[], None]] = {}
        self.outside: list[float] = []  # the step clock whenever the stage thread is not in a step
        self.stage = Script(self, preemptible)
        self.host = StageHost(self.cfg, "loop", self.stage, ArrayCodec("loop"))
        self.outbox = Outbox()
        self.state = WorkerState("loop", self.host, self.outbox)  # type: ignore[arg-type]
        self.state.work = Wakes(self.state.lock)
        self.waker = Kicks()
        self.queue = WorkQueue(
            self.state, capacity, self.waker, "loop", print, by_priority=policy == "priority"
        )
        self.sender = Sent(self)
        self.stage_thread = StageThread(
            self.state,
            self.queue,
            self.stage,
            self.sender,  # type: ignore[arg-type]
            max_inflight=max_inflight,
            max_batch=max_batch,
            trace=trace,
        )
        self.thread: threading.Thread | None = None

    # -- the I/O thread's side ---------------------------------------------------------
    def submit(
        self,
        rid: str,
        priority: int | None = None,
        slots: list[ShmHandle] | None = None,
        routes: dict[str, int] | None = None,
        **request: Any,
    ) -> None:
        """A new request arrives (``slots``: what its work item holds until it ran)."""
        if priority is not None:
            request["priority"] = priority
        self.queue.stash.append(Submit(request_id=rid, request=request, routes=routes))
        self.queue.intake()
        if slots:  # (before the stage thread runs)
            with self.state.work:
                (item,) = [it for it in self.queue.ready if it.inp.request_id == rid]
                item.release = slots

    def at(self, rid: str, step: int, then: Callable[[], None]) -> None:
        """Call ``then`` just before request ``rid``'s step ``step`` runs (stage thread)."""
        self.hooks[(rid, step)] = then

    def cancel(self, rid: str) -> None:
        with self.state.work:
            freed = self.queue.drop(rid)
        self.state.release(freed)

    def stop(self, drain: bool = False, deadline: float | None = None) -> None:
        """Tell the stage thread to stop, as a ``Shutdown`` does."""
        with self.state.work:
            self.state.stopping = True
            self.state.drain = drain
            self.state.deadline = deadline
            self.state.work.notify_all()

    # -- the stage thread --------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self.stage_thread.run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 10.0) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stage thread did not return"

    def run(self) -> list[str]:
        """Drain what was submitted (and what the hooks add); the stage's log."""
        self.stop(drain=True)
        self.start()
        self.join()
        return self.stage.log


# -- the work queue alone ----------------------------------------------------------------


def windowed_host(size: int) -> StageHost:
    """The host of stage ``count`` (loaded), fed by ``burst`` in windows of ``size`` units."""
    cfg = parse_config(
        chain(
            ("burst", "synthetic.burst", {}),
            ("count", "synthetic.count", {}),
            edges=[{"from": "burst", "to": "count", "window": {"size": size}}],
        )
    )
    stage = Count(stage_context(cfg, "count", None))
    stage.load()
    return StageHost(cfg, "count", stage, ArrayCodec("count"))


def windowed_queue(capacity: int, size: int) -> tuple[WorkerState, WorkQueue]:
    """The work queue of :func:`windowed_host` (its outbox an :class:`Outbox`, its waker
    :class:`Kicks`, ``state.work`` :class:`Wakes`)."""
    state = WorkerState("count", windowed_host(size), Outbox())  # type: ignore[arg-type]
    state.work = Wakes(state.lock)
    return state, WorkQueue(state, capacity, Kicks(), "count", print)  # type: ignore[arg-type]


def segment(rid: str, seq: int, last: bool = False, stage: str = "burst") -> Segment:
    """Request ``rid``'s segment ``seq`` from ``stage``: one token."""
    return Segment(request_id=rid, sequence=seq, stage=stage, tokens=[seq], is_last=last)


def run_of(rid: str, n: int, last: bool = True) -> SegmentRun:
    """Segments 0 .. ``n`` - 1 of request ``rid`` from ``burst`` as one run."""
    segs = [segment(rid, i, last and i == n - 1) for i in range(n)]
    return SegmentRun.of(segs, "burst", 0, {"n": n})


def item(rid: str, priority: int | None = None, cancelled: bool = False) -> WorkItem:
    """A ready work item of request ``rid`` (``priority`` in its request)."""
    gone = threading.Event()
    if cancelled:
        gone.set()
    request = {} if priority is None else {"priority": priority}
    return WorkItem(StageInput(rid, request, {}, True, True, gone), [])
