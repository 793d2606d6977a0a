"""The stage thread and the work queue: an item of a request that ended here (a failure
at intake, a cancel) gives its slots back to their producers at once, even when nothing
else arrives and the stage thread goes idle."""

import queue
import threading

from omni_core.config import parse_config
from omni_core.dataplane.serial import ArrayCodec
from omni_core.events import Release, ShmHandle
from omni_core.stage import StageInput
from omni_core.worker.host import StageHost, WorkItem, stage_context
from omni_core.worker.scheduler import Scheduler
from omni_core.worker.state import WorkerState
from omni_core.worker.work_queue import WorkQueue
from omni_testing.configs import chain
from omni_testing.stages import Count

SEGMENT = "omni-1-x-burst-0-" + "0" * 16  # a slot of the producer's arena


class Outbox:
    """Records what the worker sends (its slot releases)."""

    def __init__(self) -> None:
        self.sent: queue.Queue = queue.Queue()

    def put(self, dest, msg, **_):
        self.sent.put((dest, msg))


class Quiet:
    """A sender and a waker with nothing behind them."""

    def put(self, *_, **__):
        pass

    def flush(self):
        pass

    def kick(self):
        pass


def idle_worker():
    cfg = parse_config(chain(("burst", "synthetic.burst", {}), ("count", "synthetic.count", {})))
    stage = Count(stage_context(cfg, "count", None))
    stage.load()
    host = StageHost(cfg, "count", stage, ArrayCodec("count"))
    state = WorkerState("count", host, Outbox())
    work = WorkQueue(state, capacity=8, waker=Quiet(), stage_name="count", send_status=print)
    stage_thread = Scheduler(state, work, stage, Quiet(), max_inflight=1, max_batch=1, trace=False)
    thread = threading.Thread(target=stage_thread.run, daemon=True)
    thread.start()
    return state, work, thread


def test_an_ended_requests_queued_item_gives_its_slot_back_on_an_idle_worker():
    state, work, thread = idle_worker()
    try:
        ended = threading.Event()
        ended.set()  # the request failed at intake while this item waited in the queue
        slot = ShmHandle(SEGMENT, 64, 4, "|u1", (4,), "burst", 7)
        item = WorkItem(StageInput("r", {}, {}, True, True, ended), [slot])
        with state.work:
            work.ready.append(item)
            state.work.notify()
        dest, msg = state.outbox.sent.get(timeout=5)  # not when something else arrives
        assert dest == "ctl:burst"
        assert msg == Release(slots=[(64, 7)], segment=SEGMENT, reader="count")
        assert not work.ready and state.host.releasable == []
    finally:
        with state.work:
            state.stopping = True
            state.work.notify()
        thread.join(5)
    assert not thread.is_alive()
