"""Fixtures shared by omni-core's test modules."""

from __future__ import annotations

import pytest
from omni_core.control import zygote


class Clock:
    """``time`` for the zygote module: ``monotonic()`` steps by ``step`` at each call."""

    def __init__(self, now: float = 100.0, step: float = 0.0) -> None:
        self.now, self.step = now, step

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The zygote module's clock, stepped by hand (``clock.now``, ``clock.step``)."""
    c = Clock()
    monkeypatch.setattr(zygote, "time", c)
    return c
