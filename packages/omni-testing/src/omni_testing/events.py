"""What a stage's ``process`` yields, as a test reads it without a worker."""

from __future__ import annotations

from collections.abc import Iterable

from omni_core.stage import StageEvent


def events_of(outputs: Iterable[StageEvent | list[StageEvent] | None]) -> list[StageEvent]:
    """Run a ``process`` generator to its end as the stage thread does: its turns
    (``None``: the stage's other requests go on) dropped, its lists of events in order."""
    out: list[StageEvent] = []
    for o in outputs:
        if o is None:
            continue
        if isinstance(o, list):
            out.extend(o)
        else:
            out.append(o)
    return out
