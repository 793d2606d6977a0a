"""What a pipeline says of itself has the keys its types say (omni_core.health), on the
worker-process backend and in the caller's process, through a worker's death: mypy checks
where the dicts are made; this checks what comes out at run time."""

from __future__ import annotations

import os
import signal
from typing import Any, get_type_hints

import pytest
from omni_core import Pipeline
from omni_core.health import Failure, Metrics, StageHealth, WorkerHealth
from omni_testing.configs import chain
from omni_testing.faults import wait_for


def keys_of(typed: Any) -> tuple[set[str], set[str]]:
    """(required, every) key of a TypedDict."""
    return set(typed.__required_keys__), set(get_type_hints(typed))


def conforms(value: dict[str, Any], typed: Any) -> None:
    required, every = keys_of(typed)
    assert required <= set(value), f"{typed.__name__}: missing {required - set(value)}"
    assert set(value) <= every, f"{typed.__name__}: unknown {set(value) - every}"


@pytest.mark.parametrize("enabled", [True, False], ids=["workers", "inline"])
def test_health_metrics_and_stage_health_have_their_types_keys(enabled):
    cfg = chain(("src", "synthetic.source", {"tokens": 4}), ("dbl", "synthetic.map", {}))
    cfg["mrs"] = {"enabled": enabled}
    with Pipeline(cfg) as pipe:
        assert pipe.generate([{}])[0].ok
        health = pipe.health()
        assert set(health) == {"src", "dbl"}
        for entry in health.values():
            conforms(entry, WorkerHealth)
        for stage in pipe.stage_health().values():
            conforms(stage, StageHealth)
        conforms(pipe.metrics(), Metrics)
        assert pipe.failure is None


def test_a_dead_worker_and_a_failed_runtime_keep_the_shapes():
    cfg = chain(("src", "synthetic.source", {"tokens": 4}), heartbeat_interval_s=0.1)
    with Pipeline(cfg) as pipe:
        os.kill(pipe.pids()["src"], signal.SIGKILL)
        wait_for(lambda: pipe.health()["src"]["restarts"] >= 1, 20, "the restart")
        conforms(pipe.health()["src"], WorkerHealth)
        pipe.backend.fail_runtime("a test", "stopped on purpose")
        failure = pipe.failure
        assert failure is not None
        conforms(dict(failure), Failure)
        assert failure == {"part": "a test", "error": "stopped on purpose"}
        entry = pipe.health()["src"]
        conforms(entry, WorkerHealth)
        assert (entry["healthy"], entry["state"]) == (False, "failed")
        assert pipe.stage_health()["src"]["state"] == "failed" and not pipe.healthy
