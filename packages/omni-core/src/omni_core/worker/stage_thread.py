"""A worker's stage thread: the busy loop that runs the stage's generators.

Take a batch from the work queue, start the stage's ``process`` generator on it, hand
each output over to the sender; round-robin between up to ``max_inflight`` generators.
It is the only thread that calls into the stage (``process``, ``end_request``), and it
records when each step began, which the heartbeats carry (liveness: a step that never
ends is a hung stage).

Under ``scheduler_policy: priority`` each round's turns go best first, and a
:attr:`~omni_core.stage.Stage.preemptible` stage's running batch is paused (its
generator not advanced) when a strictly better request waits and every place is taken;
the better requests run in its place, and the paused batch resumes when a place frees
and nothing better waits (at most ``max_inflight`` batches paused at once: each holds
its memory).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omni_core.errors import UserInputError
from omni_core.events import Error, Event, Segment, SegmentRun, ShmHandle, TraceMark, TraceSpan
from omni_core.stage import StageEvent
from omni_core.worker.host import CLIENT, WorkItem

if TYPE_CHECKING:
    import threading

    from omni_core.dataplane.transport import Sender
    from omni_core.stage import Stage
    from omni_core.worker.state import WorkerState
    from omni_core.worker.work_queue import WorkQueue

log = logging.getLogger("omni.worker")


@dataclass
class _Active:
    gen: Iterator[StageEvent]
    items: list[WorkItem]
    rids: set[str] = field(default_factory=set)
    cancels: list[threading.Event] = field(default_factory=list)
    started: float = 0.0
    outputs: int = 0
    priority: int = 0  # its best request's (what pausing it would delay)


class StageThread:
    def __init__(
        self,
        state: WorkerState,
        queue: WorkQueue,
        stage: Stage,
        sender: Sender,
        *,
        max_inflight: int,
        max_batch: int,
        trace: bool,
    ) -> None:
        self.state = state
        self.host = state.host
        self.queue = queue
        self.stage = stage
        self.sender = sender  # to downstream stages and the caller
        self.max_inflight = max_inflight  # generators run round-robin
        self.max_batch = max_batch
        self.trace = trace  # record spans and marks for `omni trace`
        self.preempt = queue.by_priority and stage.preemptible
        self.paused: list[_Active] = []  # batches paused for better requests, oldest first

    def run(self) -> None:
        w = self.state
        active: list[_Active] = []
        paused = self.paused
        while True:
            if not active:
                w.inflight = 0
                self.sender.flush()  # nothing runs: send the tail now, not at the next tick
            pausing: list[_Active] = []
            resuming: list[_Active] = []
            with w.work:
                if self.preempt and len(active) == self.max_inflight:
                    self._preempt(active, pausing)
                while len(active) < self.max_inflight:
                    busy = {r for a in (*active, *paused) for r in a.rids}
                    if paused and self._resume_first(busy):
                        a = min(paused, key=_rank)
                        paused.remove(a)
                        resuming.append(a)
                        active.append(a)
                        continue
                    better = min((p.priority for p in paused), default=None)
                    batch = self.queue.take_batch(busy, self.max_batch, better)
                    if batch:
                        active.append(self._start(batch))
                        w.inflight = len(active)
                        continue
                    if active:
                        break
                    if w.stopping and (not w.drain or not self.queue.ready):
                        self._close_paused()
                        return
                    if w.deadline is not None and time.time() > w.deadline:
                        self._close_paused()
                        return
                    if self.host.to_end or self.host.releasable:
                        # end_request first; and what the queue let go of (a cancelled
                        # request's items) goes back now, not when the I/O thread next
                        # takes something in: an idle pipeline would pin it till then
                        break
                    self.queue.idle_stage = True
                    w.work.wait(0.2)
                    self.queue.idle_stage = False
                w.inflight = len(active)
                w.stats.paused = len(paused)
                freed = w.take_releasable()
                ended = self.host.take_ended()
            w.release(freed)
            self.host.end_requests(ended)
            self._tell_stage(pausing, resuming, active)
            if paused:
                self._end_cancelled_paused()
            if w.stopping and not w.drain:
                for a in active:
                    a.gen.close()
                self._close_paused()
                return
            if len(active) == 1 and self.max_inflight == 1 and not self.preempt:
                self._run_to_end(active.pop())
                continue
            if self.queue.by_priority and len(active) > 1:  # the turns go best first
                active.sort(key=_rank)
            for a in list(active):  # round-robin one output per generator
                if not self._step(a):
                    active.remove(a)
                elif self.preempt and self.queue.ready and self._preempt_now(active):
                    break  # a better request took a place: a new round, best first

    # -- preemption (scheduler_policy: priority, a preemptible stage) -------------------
    def _preempt(self, active: list[_Active], pausing: list[_Active]) -> None:
        """(Lock held, every place taken.) Pause the worst running batch for the best
        waiting requests when they are strictly better, and start them in its place."""
        if len(self.paused) >= self.max_inflight:
            return  # each paused batch holds its memory: no more
        live = [a for a in active if not all(c.is_set() for c in a.cancels)]
        if not live:
            return  # what runs is cancelled: its place frees at its next step
        busy = {r for a in (*active, *self.paused) for r in a.rids}
        best = self.queue.best_waiting(busy)
        victim = max(live, key=_rank)  # the worst, the latest among equals
        if best is None or best >= victim.priority:
            return
        batch = self.queue.take_batch(busy, self.max_batch, better_than=victim.priority)
        if not batch:
            return
        active.remove(victim)
        self.paused.append(victim)
        pausing.append(victim)
        self.state.stats.preemptions += 1
        self.state.stats.paused = len(self.paused)
        active.append(self._start(batch))

    def _preempt_now(self, active: list[_Active]) -> bool:
        """Between two steps: pause a batch for better waiting requests if one should
        be (a preemption waits one step, not a whole round of every generator)."""
        if len(active) < self.max_inflight:
            return False  # a place is free: the next round takes them in
        pausing: list[_Active] = []
        with self.state.work:
            self._preempt(active, pausing)
        self._tell_stage(pausing, [], active)
        return bool(pausing)

    def _tell_stage(
        self, pausing: list[_Active], resuming: list[_Active], active: list[_Active]
    ) -> None:
        """``Stage.pause`` / ``resume`` for the batches just paused and resumed. One
        that raises fails that batch's requests (logged with its traceback), never the
        stage: a batch the stage could not pause or put back must not run on."""
        for a, call, where in [(a, self.stage.pause, self.paused) for a in pausing] + [
            (a, self.stage.resume, active) for a in resuming
        ]:
            try:
                call(sorted(a.rids))
            except Exception as e:
                log.error(
                    "stage %s: %s(%s) failed:\n%s",
                    self.state.name,
                    call.__name__,
                    sorted(a.rids),
                    traceback.format_exc(limit=8),
                    extra={"stage": self.state.name, "request_id": ",".join(sorted(a.rids))},
                )
                if a in where:
                    where.remove(a)
                a.gen.close()
                self._fail_all(a, f"{call.__name__} failed: {type(e).__name__}: {e}")
        self.state.stats.paused = len(self.paused)

    def _resume_first(self, busy: set[str]) -> bool:
        """(Lock held, a place free.) The best paused batch goes before the waiting
        requests unless one of them is strictly better (it arrived first)."""
        best = self.queue.best_waiting(busy)
        return best is None or best >= min(p.priority for p in self.paused)

    def _end_cancelled_paused(self) -> None:
        """A paused batch whose requests were all cancelled ends now, not when resumed."""
        for a in list(self.paused):
            if all(c.is_set() for c in a.cancels):
                self.paused.remove(a)
                a.gen.close()
                self._finish(a, failed=True)
        self.state.stats.paused = len(self.paused)

    def _close_paused(self) -> None:
        """(Shutdown.) Close the paused batches; their slots go back."""
        for a in self.paused:
            a.gen.close()
            self._finish(a, failed=True)
        self.paused.clear()
        self.state.stats.paused = 0

    def _start(self, batch: list[WorkItem]) -> _Active:
        self.state.step_started = time.monotonic()
        try:
            gen = self.stage.process([item.inp for item in batch])
        finally:
            self.state.step_started = 0.0
        rids = {item.inp.request_id for item in batch}
        cancels = [item.inp._cancelled for item in batch]
        best = min(item.inp.priority for item in batch) if self.queue.by_priority else 0
        return _Active(iter(gen), batch, rids, cancels, started=time.time(), priority=best)

    def _run_to_end(self, a: _Active) -> None:
        w = self.state
        while self._step(a):
            if self.host.to_end:
                with w.lock:
                    ended = self.host.take_ended()
                self.host.end_requests(ended)
            if w.stopping and not w.drain:  # shutdown: do not finish a long generator
                a.gen.close()
                self._finish(a, failed=True)
                return

    def _step(self, a: _Active) -> bool:
        """Advance one output; False when the generator is done (and the items finished)."""
        if a.cancels[0].is_set() and all(c.is_set() for c in a.cancels):
            a.gen.close()
            self._finish(a, failed=True)
            return False
        w = self.state
        w.step_started = time.monotonic()
        try:
            out = next(a.gen)
        except StopIteration:
            w.step_started = 0.0
            self._finish(a, failed=False)
            return False
        except UserInputError as e:  # the request's fault, in words for its client
            w.step_started = 0.0
            log.info(
                "stage %s refused %s: %s",
                w.name,
                sorted(a.rids),
                e,
                extra={"stage": w.name, "request_id": ",".join(sorted(a.rids))},
            )
            self._fail_all(a, str(e), e.code)
            return False
        except Exception as e:
            w.step_started = 0.0
            log.error(
                "stage %s failed on %s:\n%s",
                w.name,
                sorted(a.rids),
                traceback.format_exc(limit=8),
                extra={"stage": w.name, "request_id": ",".join(sorted(a.rids))},
            )
            self._fail_all(a, f"{type(e).__name__}: {e}")
            return False
        w.step_started = 0.0
        w.stats.steps += 1
        if out is None:  # the stage gives the other requests in flight a turn
            return True
        if type(out) is list:
            a.outputs += len(out)
            self._handle_many(out)
        else:
            a.outputs += 1
            self._handle(out)
        return True

    # -- outputs -------------------------------------------------------------------
    def _handle_many(self, evs: list[StageEvent]) -> None:
        """A list yielded in one step: array-free segments take the fast path."""
        plain = []
        for ev in evs:
            if type(ev) is Segment and "arrays" not in ev.__dict__:
                plain.append(ev)
            else:
                if plain:
                    self._send_plain(plain)
                    plain = []
                self._handle(ev)
        if plain:
            self._send_plain(plain)

    def _send_plain(self, evs: list[Segment]) -> None:
        w = self.state
        with w.lock:
            out = self.host.emit_plain(evs)
            groups = self.host.by_destination(out) if out else {}
        if not out:
            return
        if self.trace:
            for m in out:
                if type(m) is SegmentRun:
                    w.marks.extend(
                        TraceMark(m.request_id, m.sequence + k, "segment", ts)
                        for k, ts in enumerate(m.ts)
                    )
                else:
                    w.marks.append(TraceMark(m.request_id, m.sequence, "segment", m.ts))
        events = sum(len(m) if type(m) is SegmentRun else 1 for m in out)
        for d, msgs in groups.items():
            n = events if msgs is out else sum(len(m) if type(m) is SegmentRun else 1 for m in msgs)
            self.sender.put_many(d, msgs, n)

    def _handle(self, ev: StageEvent) -> None:
        w, host = self.state, self.host
        st = host.requests.get(ev.request_id)
        if st is None or st.cancel.is_set():  # ended, cancelled or failed here
            return
        error = type(ev) is Error
        try:
            handles = None if error else host.pack(ev)
        except Exception as e:
            self._fail_request(ev.request_id, f"cannot send output: {type(e).__name__}: {e}")
            return
        with w.lock:
            stamped, dests = host.emit(ev, handles)
            freed = host.forget(stamped.request_id) if error else None
        droppable = host.droppable(stamped)
        if self.trace:
            w.marks.append(
                TraceMark(stamped.request_id, stamped.sequence, stamped.event_type, stamped.ts)
            )
        for d in dests:
            self.sender.put(d, stamped, droppable)
        if error:
            w.stats.errors += 1
            w.release(freed)

    def _fail_request(self, rid: str, message: str, code: str = "stage_error") -> None:
        w = self.state
        with w.lock:
            ev = self.host.error(rid, message, code)
            freed = self.host.forget(rid)
            w.stats.errors += 1
        self.sender.put(CLIENT, ev)
        w.release(freed)

    def _fail_all(self, a: _Active, message: str, code: str = "stage_error") -> None:
        for item in a.items:
            if not item.inp.cancelled:
                self._fail_request(item.inp.request_id, message, code)
        self._finish(a, failed=True)

    def _finish(self, a: _Active, failed: bool) -> None:
        w = self.state
        if self.trace:
            first = a.items[0].inp
            index = first.windows and next(iter(first.windows.values())).index or 0
            rids = [item.inp.request_id for item in a.items]
            w.spans.append(TraceSpan(rids, a.started, time.time(), a.outputs, index))
        freed: list[ShmHandle] = []
        sends: list[tuple[Event, list[str]]] = []
        with w.lock:
            for item in a.items:
                freed.extend(item.release)
                if not failed and not item.inp.cancelled:
                    sends.extend(self.host.finish(item))
                    if item.inp.last:
                        w.stats.completed += 1
            freed.extend(w.take_releasable())
        for ev, dests in sends:
            for d in dests:
                self.sender.put(d, ev)
        w.release(freed)


def _rank(a: _Active) -> tuple[int, float]:
    """Better first: by the batch's best priority, then by when it started."""
    return (a.priority, a.started)
