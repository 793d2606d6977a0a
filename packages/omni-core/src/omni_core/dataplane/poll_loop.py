"""The I/O thread of a process: one poll loop, the same in the orchestrator and a worker.

It owns the process's zmq sockets (they are not thread-safe): it calls a handler for each
readable socket or fd, sends what other threads queued in the :class:`Outbox` (waiting for
POLLOUT on a full socket), and ticks. It is supervised: an exception that escapes a
handler or the tick is logged with its traceback and handed to ``on_fatal``, and the loop
ends; it never dies in silence.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from omni_core.dataplane.transport import Outbox, Waker

log = logging.getLogger("omni.io")


class PollLoop:
    """Subclasses set the handlers (:meth:`watch`) and override the hooks."""

    name = "io"

    def __init__(self, waker: Waker, outbox: Outbox, out: dict[str, zmq.Socket]) -> None:
        self.waker = waker
        self.outbox = outbox
        self.out = out  # outbox destinations -> sockets
        self.poller = zmq.Poller()
        self.handlers: dict[Any, Callable[[], None]] = {}
        self.poller.register(waker.fd, zmq.POLLIN)

    def watch(self, source: zmq.Socket | int, handler: Callable[[], None]) -> None:
        """Call ``handler`` whenever ``source`` (a socket or an fd) is readable."""
        self.handlers[source] = handler
        self.poller.register(source, zmq.POLLIN)

    def unwatch(self, source: zmq.Socket | int) -> None:
        if self.handlers.pop(source, None) is not None:
            self.poller.unregister(source)

    # -- hooks -----------------------------------------------------------------
    def done(self) -> bool:
        raise NotImplementedError

    def before_poll(self) -> float:
        """Work before blocking; returns the poll timeout in seconds."""
        return 0.1

    def may_sleep(self) -> bool:
        """Whether other threads must wake the loop to be heard (see :class:`Waker`)."""
        return True

    def tick(self, events: dict[Any, int]) -> None:
        """After each poll (``events``: what was readable)."""

    # -- the loop --------------------------------------------------------------
    def run(self, on_fatal: Callable[[BaseException], None]) -> None:
        try:
            self._loop()
        except BaseException as e:
            log.critical("the %s loop failed and stops:\n%s", self.name, traceback.format_exc())
            on_fatal(e)

    def _loop(self) -> None:
        pollout: set[str] = set()
        poller = self.poller
        while not self.done():
            timeout = self.before_poll()
            for dest in pollout:
                poller.register(self.out[dest], zmq.POLLOUT)
            self.waker.idle = self.may_sleep()  # before reading the outbox: no wake-up missed
            if self.outbox.count and not pollout:
                timeout = 0.0
            events = dict(poller.poll(timeout * 1000))
            self.waker.idle = False
            for dest in pollout:
                poller.unregister(self.out[dest])
            if self.waker.fd in events:
                self.waker.clear()
            for source, handler in list(self.handlers.items()):
                if source in events:
                    handler()
            self.tick(events)
            pollout = set(self.outbox.flush(self.out))
        self.outbox.flush(self.out)
