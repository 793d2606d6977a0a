"""Progress of long work on the command line: a bar drawn in place on a terminal, plain
timed lines when the stream is not one (a pipe, a CI log), so logs stay readable.

``omni run`` shows a request's denoising steps with it and ``omni models pull`` a
family's conversion; a family's pull reports through :class:`Reporter` (a plain
``step(what)`` callable, with :meth:`Reporter.bar` for loops of known length). Written
here rather than taken from tqdm so that the core keeps its few dependencies; the look
follows tqdm's: ``what |#####-----| 8/20 steps 0.9s 8.6 steps/s``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, TypeVar

__all__ = ["Bar", "Reporter", "is_terminal"]

T = TypeVar("T")

WIDTH = 24  # the bar's cells
CLEAR = "\r\033[K"  # carriage return, erase to the end of the line


def is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


class Bar:
    """One bar on ``stream`` (stderr by default).

    On a terminal (``tty``, by default whether ``stream`` is one) the bar is redrawn in
    place on its line at most every ``refresh_s`` (unless ``live`` is false: then only
    when its owner calls :meth:`draw`); :meth:`clear` erases it so that other output can
    be written, :meth:`draw` puts it back. Otherwise it writes a plain line at
    the first update, whenever a quarter of the total is crossed, at most every
    ``interval_s`` in between, and at the end.
    """

    def __init__(
        self,
        what: str,
        total: int | None = None,
        *,
        unit: str = "steps",
        stream: IO[str] | None = None,
        tty: bool | None = None,
        interval_s: float = 5.0,
        refresh_s: float = 0.1,
        live: bool = True,
        prefix: Callable[[], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.prefix = prefix  # a text put before ``what`` each time the bar is written
        self.stream = stream if stream is not None else sys.stderr
        self.tty = is_terminal(self.stream) if tty is None else tty
        self.interval_s, self.refresh_s, self.clock = interval_s, refresh_s, clock
        self.live = live  # terminal: redraw on update (else the owner calls draw())
        self.n = 0
        self.started = clock()
        self.shown = False  # tty: the bar is on the screen now
        self.last_out = -1e18  # when the bar was last written
        self.quarter = -1  # plain lines: the last quarter of the total reported
        self.closed = False

    # -- progress -------------------------------------------------------------------
    def update(self, n: int, total: int | None = None) -> None:
        """The work is at ``n`` (of ``total``, when it is learned or changes)."""
        if self.closed:
            return
        if total is not None:
            self.total = total
        self.n = n
        if n <= 0:  # nothing done yet: nothing to show
            return
        first = self.last_out < 0
        now = self.clock()
        if self.tty:
            if self.live and (first or now - self.last_out >= self.refresh_s or self._done()):
                self.draw(now)
            elif not self.live:
                self.last_out = now
            return
        quarter = 4 * n // self.total if self.total else -1
        if first or quarter > self.quarter or now - self.last_out >= self.interval_s:
            if not self._done():  # the end is close()'s line
                self._line(now)
            self.quarter = max(self.quarter, quarter)

    def advance(self, k: int = 1) -> None:
        self.update(self.n + k)

    def iterate(self, items: Iterable[T]) -> Iterator[T]:
        """Yield ``items``, one step each; the bar closes when they run out."""
        if self.total is None and hasattr(items, "__len__"):
            self.total = len(items)  # type: ignore[arg-type]
        done = False
        try:
            for item in items:
                yield item
                self.advance()
            done = True
        finally:  # also when the loop stops early: the line ends, saying so
            self.close("" if done else "(stopped)")

    def close(self, note: str = "") -> None:
        """The final state, as a line of its own (on a terminal too: it stays)."""
        if self.closed:
            return
        self.closed = True
        text = self.render(self.clock(), final=True)
        if note:
            text += f"  {note}"
        prefix = CLEAR if self.tty and self.shown else ""
        self.stream.write(f"{prefix}{text}\n")
        self.stream.flush()
        self.shown = False

    # -- the screen -----------------------------------------------------------------
    def clear(self) -> None:
        """Terminal: erase the bar's line, so that other output starts on a clean line."""
        if self.tty and self.shown:
            self.stream.write(CLEAR)
            self.stream.flush()
            self.shown = False

    def draw(self, now: float | None = None) -> None:
        """Terminal: (re)draw the bar in place."""
        if not self.tty or self.closed:
            return
        now = self.clock() if now is None else now
        self.stream.write(CLEAR + self.render(now))
        self.stream.flush()
        self.shown = True
        self.last_out = now

    def _line(self, now: float) -> None:
        self.stream.write(self.render(now) + "\n")
        self.stream.flush()
        self.last_out = now

    def _done(self) -> bool:
        return bool(self.total) and self.n >= self.total  # type: ignore[operator]

    def render(self, now: float, final: bool = False) -> str:
        took = max(now - self.started, 0.0)
        rate = f"  {self.n / took:.1f} {self.unit}/s" if took > 0 and self.n else ""
        of = f"/{self.total}" if self.total else ""
        count = f"{self.n}{of} {self.unit}"
        if self.tty and self.total:
            full = min(WIDTH, WIDTH * self.n // self.total)
            bar = f"|{'#' * full}{'-' * (WIDTH - full)}| "
        else:
            bar = ""
        pct = f" ({100 * self.n // self.total}%)" if self.total and not self.tty else ""
        what = f"{self.prefix()} {self.what}" if self.prefix else self.what
        return f"{what} {bar}{count}{pct}  {took:.1f}s{rate}"


class Reporter:
    """What a long command's steps report to: ``reporter("what")`` prints a timed line
    (``[  12.3s] name: what``); ``reporter.bar("what", total)`` gives a :class:`Bar` for
    a loop of known length. ``omni models pull`` hands one to a family's ``pull``."""

    def __init__(
        self,
        name: str,
        stream: IO[str] | None = None,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.stream = stream if stream is not None else sys.stdout
        self.tty = is_terminal(self.stream) if tty is None else tty
        self.clock = clock
        self.t0 = clock()

    def prefix(self) -> str:
        """``[  12.3s] name:``, the time since this reporter was made."""
        return f"[{self.clock() - self.t0:6.1f}s] {self.name}:"

    def __call__(self, what: str) -> None:
        print(f"{self.prefix()} {what}", file=self.stream, flush=True)

    def bar(self, what: str, total: int | None = None, unit: str = "items", **kw: Any) -> Bar:
        """A progress bar for a loop over ``total`` ``unit`` (unknown: a count): ``advance``
        it as the loop goes, ``close`` it after."""
        return Bar(
            what, total, unit=unit, stream=self.stream, tty=self.tty, prefix=self.prefix, **kw
        )
