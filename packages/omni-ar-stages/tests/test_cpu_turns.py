"""Engines that name the same CPU turn never compute at the same time, and a turn held by
a process that dies is free again."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from omni_ar.engines.cpu_turns import CpuTurn, turn_path


def _hold(name: str, steps: int, log: str) -> None:
    turn = CpuTurn(name)
    for _ in range(steps):
        with turn:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} in {time.monotonic()}\n")
            time.sleep(0.005)
            with open(log, "a") as f:
                f.write(f"{os.getpid()} out {time.monotonic()}\n")


def test_turns_exclude_each_other(tmp_path):
    name = f"test-{uuid.uuid4().hex[:8]}"
    log = str(tmp_path / "log")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_hold, args=(name, 20, log)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = [ln.split() for ln in Path(log).read_text().splitlines()]
    assert len(lines) == 3 * 20 * 2
    # every "in" is followed by the same process's "out": no two steps overlapped
    for a, b in zip(lines[::2], lines[1::2], strict=True):
        assert (a[1], b[1]) == ("in", "out") and a[0] == b[0]
    _remove(name)


def _hold_forever(name: str, ready) -> None:  # type: ignore[no-untyped-def]
    turn = CpuTurn(name)
    turn.__enter__()
    ready.set()
    time.sleep(600)


def test_a_dead_holder_frees_the_turn():
    name = f"test-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_forever, args=(name, ready))
    p.start()
    assert ready.wait(60)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    turn = CpuTurn(name)
    t0 = time.monotonic()
    with turn:
        pass
    assert time.monotonic() - t0 < 5
    assert turn.waited_s < 5 and turn.held_s >= 0
    turn.close()
    _remove(name)


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "x" * 65, "sp ace"])
def test_turn_names_are_checked(bad):
    with pytest.raises(ValueError, match="cpu_turns"):
        turn_path(bad)


def _remove(name: str) -> None:
    path = turn_path(name)
    path.unlink()


def test_an_engine_computes_only_in_its_turn(tiny_model):
    """The transformers engine with ``cpu_turns`` gives the tokens it gives without, holds
    the turn for every forward, and waits while another process holds it."""
    from omni_ar.engines.transformers_engine import TransformersEngine
    from omni_ar.params import SamplingParams

    name = f"test-{uuid.uuid4().hex[:8]}"
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain, turned = TransformersEngine(tiny_model), TransformersEngine(tiny_model, cpu_turns=name)
    for e in (plain, turned):
        e.load_tokenizer()
        e.load_model()
    assert turned.generate("the quick brown fox", params) == plain.generate(
        "the quick brown fox", params
    )
    assert turned.turn.held_s > 0 and turned.turn.waited_s < 5
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_for, args=(name, ready, 1.5))
    holder.start()
    assert ready.wait(60)
    t0 = time.monotonic()
    turned.generate("the quick brown fox", params)
    assert time.monotonic() - t0 >= 1.0  # it waited for the holder's turn to end
    assert turned.turn.waited_s >= 1.0
    holder.join(30)
    turned.turn.close()
    _remove(name)


def _hold_for(name: str, ready, seconds: float) -> None:  # type: ignore[no-untyped-def]
    with CpuTurn(name):
        ready.set()
        time.sleep(seconds)
