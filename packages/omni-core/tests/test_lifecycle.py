"""A worker's life (omni_core.control.lifecycle): the table the supervisor holds every
change to, and a move outside it refused loudly."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from omni_core.control.lifecycle import GONE, SERVING, TRANSITIONS, Life, LifecycleError, move


@dataclass
class Record:
    name: str = "work#1"
    state: Life = Life.STARTING


def test_every_state_has_a_row_and_only_stopped_and_dead_end():
    assert set(TRANSITIONS) == set(Life)
    assert {s for s, to in TRANSITIONS.items() if not to} == {Life.STOPPED, Life.DEAD}
    assert all(s not in to for s, to in TRANSITIONS.items())  # no move to itself


def test_every_state_is_reachable_from_starting_and_every_life_can_end():
    seen, todo = {Life.STARTING}, [Life.STARTING]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(Life)
    for state in Life:  # from anywhere, an end (stopped or dead) can be reached
        reach, todo = {state}, [state]
        while todo:
            for nxt in TRANSITIONS[todo.pop()]:
                if nxt not in reach:
                    reach.add(nxt)
                    todo.append(nxt)
        assert reach & {Life.STOPPED, Life.DEAD}, state


@pytest.mark.parametrize(
    "path",
    [
        [Life.READY, Life.DRAINING, Life.STOPPING, Life.STOPPED],  # scaled down
        [Life.READY, Life.HUNG, Life.RESTARTING, Life.DEAD],  # hung, then the restart failed
        [Life.STOPPING, Life.STOPPED],  # an added replica let go before it was ready
        [Life.READY, Life.DRAINING, Life.HUNG, Life.STOPPED],  # hung while draining
        [Life.RESTARTING],  # died while starting
    ],
)
def test_the_lives_the_supervisor_leads_are_moves_of_the_table(path):
    r = Record()
    for state in path:
        move(r, state)
    assert r.state == path[-1]


@pytest.mark.parametrize(
    ("start", "to"),
    [
        (Life.DEAD, Life.RESTARTING),  # dead for good stays dead
        (Life.STOPPED, Life.READY),  # a late ready after a scale-down
        (Life.DRAINING, Life.READY),  # a drained replica does not serve again
        (Life.RESTARTING, Life.READY),  # the new life is a new record, starting
        (Life.READY, Life.STARTING),
    ],
)
def test_a_move_outside_the_table_raises_naming_the_worker_and_both_states(start, to):
    r = Record(state=start)
    with pytest.raises(LifecycleError, match=f"worker work#1: {start} -> {to} is not a"):
        move(r, to)
    assert r.state == start


def test_health_reads_the_same_strings():
    assert [str(s) for s in Life] == [
        "starting",
        "ready",
        "draining",
        "stopping",
        "stopped",
        "hung",
        "restarting",
        "dead",
    ]
    assert set(Life) >= SERVING and set(Life) >= GONE and Life.READY in SERVING - GONE


def test_only_the_supervisor_writes_a_worker_records_fields():
    """The record's fields (its state and the flags beside it) are assigned in
    supervisor.py alone, and only it moves a life (lifecycle.move): the orchestrator and
    the rest of the control plane ask it."""
    import ast
    import dataclasses
    from pathlib import Path

    import omni_core
    from omni_core.control.supervisor import WorkerRecord

    fields = {f.name for f in dataclasses.fields(WorkerRecord)}
    root = Path(omni_core.__file__).parent
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "supervisor.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            call = node.func if isinstance(node, ast.Call) else None
            if isinstance(call, ast.Name) and call.id == "move" and path.name != "lifecycle.py":
                found.append(f"{where} move()")
            if path.parent.name != "control" or path.name == "lifecycle.py":
                continue  # (a record lives in the control plane)
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for t in targets:
                owner = t.value if isinstance(t, ast.Attribute) else None
                # p.dead = ...: a record's field (self.x = ...: the object's own)
                if (
                    owner is not None
                    and t.attr in fields
                    and not (isinstance(owner, ast.Name) and owner.id == "self")
                ):
                    found.append(f"{where} .{t.attr} =")
    assert found == [], found
