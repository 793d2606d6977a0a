"""Request priority (:mod:`omni_core.scheduling`): what a request's priority reads as, and
which priorities a pipeline takes, at each limit and one past it (no processes; the fast
test set of ``hatch run mutate core.scheduling``)."""

from __future__ import annotations

from typing import Any

import pytest
from omni_core.config import PipelineConfig, parse_config
from omni_core.errors import UserInputError
from omni_core.scheduling import (
    PRIORITY_KEY,
    PRIORITY_MAX,
    PRIORITY_MIN,
    check_priority,
    request_priority,
    uses_priority,
)


def pipeline(*policies: str | None, default: str | None = None) -> PipelineConfig:
    """A chain of stages, each with its own ``scheduler_policy`` (None: the default's)."""
    stages: list[dict[str, Any]] = []
    for i, policy in enumerate(policies):
        stage: dict[str, Any] = {"name": f"s{i}", "kind": "x"}
        if policy is not None:
            stage["scheduler_policy"] = policy
        stages.append(stage)
    data: dict[str, Any] = {
        "stages": stages,
        "edges": [{"from": f"s{i}", "to": f"s{i + 1}"} for i in range(len(stages) - 1)],
    }
    if default is not None:
        data["mrs"] = {"defaults": {"scheduler_policy": default}}
    return parse_config(data, check_kinds=False)


def test_the_wire_limits_are_64_bit() -> None:
    assert PRIORITY_KEY == "priority"
    assert (PRIORITY_MIN, PRIORITY_MAX) == (-9223372036854775808, 9223372036854775807)


@pytest.mark.parametrize(
    ("request_", "priority"),
    [
        ({}, 0),
        ({"priority": 0}, 0),
        ({"priority": 5}, 5),
        ({"priority": -3}, -3),
        ({"priority": PRIORITY_MIN}, PRIORITY_MIN),
        ({"priority": True}, 0),  # a bool is not a priority
        ({"priority": 2.0}, 0),
        ({"priority": "1"}, 0),
        ({"priority": None}, 0),
    ],
)
def test_request_priority(request_: dict[str, Any], priority: int) -> None:
    assert request_priority(request_) == priority


def test_uses_priority_when_any_stage_does() -> None:
    assert not uses_priority(pipeline(None, None))
    assert not uses_priority(pipeline("fcfs", "fcfs"))
    assert uses_priority(pipeline("fcfs", "priority"))
    assert uses_priority(pipeline("priority", None))
    assert uses_priority(pipeline("fcfs", None, default="priority"))
    assert not uses_priority(pipeline("fcfs", "fcfs", default="priority"))


@pytest.mark.parametrize("value", [PRIORITY_MIN, PRIORITY_MIN + 1, -1, 0, 1, PRIORITY_MAX])
def test_every_64_bit_priority_is_taken_where_a_stage_schedules_by_it(value: int) -> None:
    check_priority({PRIORITY_KEY: value}, pipeline("fcfs", "priority"))


@pytest.mark.parametrize("value", [PRIORITY_MIN - 1, PRIORITY_MAX + 1])
def test_one_past_either_limit_is_refused(value: int) -> None:
    with pytest.raises(UserInputError, match=rf"^field 'priority': {value} is out of range"):
        check_priority({PRIORITY_KEY: value}, pipeline("priority"))
    with pytest.raises(UserInputError, match="out of range"):  # the range comes first
        check_priority({PRIORITY_KEY: value}, pipeline("fcfs"))


@pytest.mark.parametrize(("value", "kind"), [(True, "bool"), (1.0, "float"), ("1", "str")])
def test_a_priority_that_is_not_an_integer_is_refused(value: Any, kind: str) -> None:
    with pytest.raises(UserInputError, match=f"expected an integer, got {kind}$"):
        check_priority({PRIORITY_KEY: value}, pipeline("priority"))


def test_first_come_first_served_pipelines_take_priority_0_only() -> None:
    fcfs = pipeline("fcfs", None)
    check_priority({}, fcfs)
    check_priority({"other": 3}, fcfs)
    check_priority({PRIORITY_KEY: 0}, fcfs)
    for value in (-1, 1):
        with pytest.raises(UserInputError, match="schedules first come, first served"):
            check_priority({PRIORITY_KEY: value}, fcfs)
