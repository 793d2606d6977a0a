"""What a worker's two threads share: one lock, what it guards, and the flags and
counters one thread writes and the other reads.

The I/O thread (:mod:`~omni_core.worker.io_thread`) and the stage thread
(:mod:`~omni_core.worker.stage_thread`) each get this object and, as constructor arguments,
only what they use alone or what synchronizes itself (the sender, the waker, sockets).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omni_core.dataplane.serial import releases
from omni_core.dataplane.transport import control_dest
from omni_core.events import ShmHandle, StageStats, TraceMark, TraceSpan

if TYPE_CHECKING:
    from omni_core.dataplane.transport import Outbox
    from omni_core.worker.host import StageHost


@dataclass(eq=False, slots=True)
class WorkerState:
    name: str  # the worker's name: the reader its slot releases name
    host: StageHost  # guarded by ``lock``
    outbox: Outbox  # what the I/O thread sends for both threads (releases, errors)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # notified when work is queued or the worker is told to stop (the stage thread waits)
    work: threading.Condition = field(init=False)
    stats: StageStats = field(default_factory=StageStats)
    # set by the I/O thread on Shutdown (under ``work``); the stage thread obeys
    stopping: bool = False
    drain: bool = False
    deadline: float | None = None
    io_done: bool = False  # set by the stage thread when the I/O thread may exit
    # the stage thread's progress, which the I/O thread's heartbeats carry
    inflight: int = 0
    step_started: float = 0.0  # when its current step began (0: none): liveness
    spans: list[TraceSpan] = field(default_factory=list)  # shipped with the next heartbeat
    marks: list[TraceMark] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work = threading.Condition(self.lock)

    def release(self, handles: list[ShmHandle]) -> None:
        """Hand slots back to their producers (through the I/O thread; never blocks)."""
        if not handles:
            return
        for producer, msg in releases(handles, self.name):
            self.outbox.put(control_dest(producer), msg, block=False)

    def take_releasable(self) -> list[ShmHandle]:
        """(Lock held.) Slots the host let go of."""
        freed, self.host.releasable = self.host.releasable, []
        return freed
