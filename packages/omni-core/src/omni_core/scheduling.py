"""Request priority and the scheduling policies that read it.

A request may carry ``priority`` (an integer, default 0; lower runs first, vLLM's
semantics). A stage whose ``scheduler_policy`` is ``priority`` orders every place a
request waits in its worker (the work queue, the batch it forms, the requests it admits
up to ``max_inflight``) by (priority, arrival), and passes the priority to an engine with
a scheduler of its own (vLLM). Under ``fcfs`` (the default) priority is not read and
every wait is first come, first served. A pipeline none of whose stages schedules by
priority refuses a request whose priority is not 0, as vLLM's server does.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from omni_core.errors import UserInputError

SchedulerPolicy = Literal["fcfs", "priority"]


class StagePolicies(Protocol):
    """What priority's checks read of a pipeline's config
    (:class:`~omni_core.config.PipelineConfig`, which imports this module)."""

    @property
    def stages(self) -> list[Any]:
        """Its stages' specs."""
        ...

    def setting(self, stage: Any, key: str) -> Any:
        """A stage's setting, its own or the pipeline's default."""
        ...


PRIORITY_KEY = "priority"
"""The request field holding its priority (a runtime field: every stage accepts it)."""
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1  # what the wire carries (64-bit)


def request_priority(request: dict[str, Any]) -> int:
    """``request``'s priority (0 when it sets none); the value was checked on submit."""
    value = request.get(PRIORITY_KEY, 0)
    return value if type(value) is int else 0


def uses_priority(cfg: StagePolicies) -> bool:
    """Some stage of ``cfg`` schedules by priority."""
    return any(cfg.setting(s, "scheduler_policy") == "priority" for s in cfg.stages)


def check_priority(request: dict[str, Any], cfg: StagePolicies) -> None:
    """Raise :class:`UserInputError` naming the field when ``request``'s priority is not
    an integer in range, or is not 0 where no stage schedules by priority."""
    if PRIORITY_KEY not in request:
        return
    value = request[PRIORITY_KEY]
    if type(value) is not int:
        raise UserInputError(f"field 'priority': expected an integer, got {type(value).__name__}")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise UserInputError(
            f"field 'priority': {value} is out of range ({PRIORITY_MIN}..{PRIORITY_MAX})"
        )
    if value != 0 and not uses_priority(cfg):
        raise UserInputError(
            "field 'priority': this pipeline schedules first come, first served "
            "(scheduler_policy: fcfs on every stage); priority must be 0"
        )
