"""The local launcher's zygote faults on a fake zygote and a fake clock: no zygote process,
no worker process. Each fault leaves workers spawned, says why in ``describe()``, and
asks the zygote nothing more once it failed for good."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from omni_core.config import PipelineConfig, parse_config
from omni_core.control import launcher as launcher_module
from omni_core.control.launcher import ProcessLauncher, WorkerHandle
from omni_core.control.zygote import Fork, ForkRefused, ForkUnsent, Preloaded, ZygoteGone
from omni_testing.supervision import Clock, FakeWorker

WINDOW_S = ProcessLauncher.ZYGOTE_RESTART_WINDOW_S
MAX_RESTARTS = ProcessLauncher.MAX_ZYGOTE_RESTARTS


class FakeZygote:
    """What the launcher calls on a :class:`~omni_core.control.zygote.Zygote`, scripted:
    ``preload`` (done at the next follow), ``threads`` after it, ``fork_error`` raised
    by the next fork, ``start_error`` by the next start; ``running`` until the test ends
    it. Its time is the test's ``clock``."""

    def __init__(self, modules: list[str], clock: Clock) -> None:
        self.modules = modules
        self.clock = clock
        self.preloaded: Preloaded | None = None
        self.preload = True
        self.threads = 1
        self.fork_error: Exception | None = None
        self.start_error: OSError | None = None
        self.running = False
        self.starts = self.forks = 0
        self.started_at = 0.0
        self.closed: list[bool] = []  # kill, per close

    def start(self) -> None:
        if self.start_error is not None:
            raise self.start_error
        self.starts += 1
        self.running, self.preloaded, self.started_at = True, None, self.clock()

    @property
    def pid(self) -> int | None:
        return 4000 + self.starts if self.starts else None

    def alive(self) -> bool:
        return self.running

    def exit_reason(self) -> str:
        return "killed by SIGKILL"

    def follow(self, timeout_s: float) -> bool:
        if not self.running:
            raise ZygoteGone(f"zygote (pid {self.pid}) {self.exit_reason()}")
        if self.preload and self.preloaded is None:
            self.preloaded = Preloaded(0.5, dict.fromkeys(self.modules, 0.1), {}, self.threads)
        return self.preloaded is not None

    def fork(self, fork: Fork, timeout_s: float = 2.0) -> int:
        self.forks += 1
        error, self.fork_error = self.fork_error, None
        if error is not None:
            raise error
        if not self.running:
            raise ZygoteGone(f"zygote (pid {self.pid}) {self.exit_reason()}")
        raise AssertionError("a fork that succeeds needs a process: not in these tests")

    def close(self, kill: bool = False) -> list[int]:
        self.closed.append(kill)
        self.running = False
        return []

    def overdue(self, limit_s: float) -> bool:
        return self.preloaded is None and self.clock() - self.started_at > limit_s


class Spawned(FakeWorker):
    started = "spawned"


def config(b_kind: str = "synthetic.map", **extra: object) -> PipelineConfig:
    """Stage ``a`` (``synthetic.map``) into ``b``; ``extra``: top-level keys, or ``stage``
    for both stages' own."""
    stage = extra.pop("stage", {})
    return parse_config(
        {
            "stages": [
                {"name": "a", "kind": "synthetic.map", **stage},  # type: ignore[dict-item]
                {"name": "b", "kind": b_kind, **stage},  # type: ignore[dict-item]
            ],
            "edges": [{"from": "a", "to": "b"}],
            "shm_pool_bytes": 1 << 20,
            **extra,
        }
    )


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """``launch(**config)``: a :class:`ProcessLauncher` over the fake zygote and a fake
    clock, whose spawns make :class:`Spawned` workers (in ``spawned``); closed after."""
    made: list[ProcessLauncher] = []
    clock = Clock()
    monkeypatch.setattr(launcher_module, "Zygote", lambda modules, _: FakeZygote(modules, clock))
    monkeypatch.setattr(launcher_module, "clone_unsupported", lambda: "")

    def make(**extra: object) -> tuple[ProcessLauncher, Clock, list[WorkerHandle]]:
        pl = ProcessLauncher(config(**extra), clock)
        spawned: list[WorkerHandle] = []

        def spawn(spec_path: str, env: dict[str, str], segment: str) -> WorkerHandle:
            spawned.append(Spawned(len(spawned)))
            spawned[-1].segment = segment
            return spawned[-1]

        monkeypatch.setattr(pl, "_spawn", spawn)
        made.append(pl)
        return pl, clock, spawned

    yield make
    for pl in made:
        pl.close()


def zygote(pl: ProcessLauncher) -> FakeZygote:
    assert isinstance(pl.zygote, FakeZygote)
    return pl.zygote


def ready(pl: ProcessLauncher) -> FakeZygote:
    """The zygote started and preloaded (as the first spawn leaves it), ready to fork."""
    z = zygote(pl)
    with pl.lock:
        pl._start_zygote()
        assert pl._zygote_ready(0.0)
    return z


# -- a stage set that needs no zygote --------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "note", "reasons"),
    [
        ({"backend": {"start": "spawn"}}, "", {}),
        (
            {"stage": {"extra_env": {"MALLOC_ARENA_MAX": "2"}}},
            "",
            dict.fromkeys("ab", "its extra_env sets MALLOC_ARENA_MAX, read when libraries load"),
        ),
    ],
    ids=["start-spawn", "import-time-env"],
)
def test_a_stage_set_that_needs_no_zygote_starts_none(launch, monkeypatch, extra, note, reasons):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    pl, _, spawned = launch(**extra)
    assert pl.zygote is None
    assert [pl.spawn(w).started for w in ("a", "b")] == ["spawned", "spawned"]
    assert len(spawned) == 2 and pl.zygote is None
    d = pl.describe()
    assert (d["state"], d["pid"], d["note"], d["spawned_stages"]) == ("off", None, note, reasons)


def test_stages_that_cannot_be_forked_are_spawned_while_the_others_use_the_zygote(
    launch, monkeypatch
):
    real = launcher_module.load_stage_class

    def load(kind: str) -> type:
        cls = real(kind)
        return type("Unforkable", (cls,), {"forkable": False}) if kind == "synthetic.map" else cls

    monkeypatch.setattr(launcher_module, "load_stage_class", load)
    pl, _, spawned = launch()
    assert pl.zygote is None  # no stage is forked: no zygote to start
    assert pl.describe()["spawned_stages"] == dict.fromkeys(
        "ab", "its kind 'synthetic.map' is not forkable"
    )
    pl, _, spawned = launch(b_kind="synthetic.faulty")
    z = zygote(pl)
    assert pl.describe()["spawned_stages"] == {"a": "its kind 'synthetic.map' is not forkable"}
    assert "omni_testing.stages" in z.modules  # b's module, preloaded for b
    assert pl.spawn("a").started == "spawned"
    assert (z.starts, z.forks) == (0, 0)  # a never asks the zygote


def test_no_clone_on_this_platform_spawns_every_worker(launch, monkeypatch):
    monkeypatch.setattr(launcher_module, "clone_unsupported", lambda: "no clone(2) here")
    pl, _, spawned = launch()
    assert pl.zygote is None
    assert pl.describe()["note"] == "workers are spawned: no clone(2) here"
    pl.spawn("a")
    assert len(spawned) == 1


# -- faults before the first fork ------------------------------------------------------


def test_a_zygote_that_cannot_start_leaves_every_worker_spawned(launch):
    pl, _, spawned = launch()
    z = zygote(pl)
    z.start_error = OSError(24, "Too many open files")
    assert pl.spawn("a").started == "spawned"
    assert pl.describe()["state"] == "failed"
    assert "it could not be started: [Errno 24] Too many open files" in pl.zygote_note
    z.start_error = None
    pl.spawn("b")
    assert (z.starts, z.forks, len(spawned)) == (0, 0, 2)  # never tried again


def test_threads_after_the_preload_mean_no_fork(launch):
    pl, _, spawned = launch()
    z = zygote(pl)
    z.threads = 3
    assert pl.spawn("a").started == "spawned"
    d = pl.describe()
    assert d["state"] == "failed" and d["pid"] is None
    assert (
        d["note"]
        == "workers are spawned: the zygote cannot fork: it has 3 threads after its preload"
    )
    assert z.closed == [True] and z.forks == 0
    pl.spawn("b")
    assert (z.starts, z.forks, len(spawned)) == (1, 0, 2)


def test_a_first_preload_past_ready_timeout_fails_the_zygote(launch):
    pl, _, spawned = launch(ready_timeout_s=5.0)
    z = zygote(pl)
    z.preload = False  # never done
    assert pl.spawn("a").started == "spawned"
    assert pl.zygote_state == "failed"
    assert pl.zygote_note.endswith("its preload took more than ready_timeout_s=5")
    assert z.closed == [True]


# -- faults at a fork -------------------------------------------------------------------


def test_a_refused_fork_fails_the_zygote_for_good(launch):
    pl, _, spawned = launch()
    z = ready(pl)
    z.fork_error = ForkRefused("clone: [Errno 1] Operation not permitted")
    assert pl.spawn("a").started == "spawned"
    assert pl.zygote_state == "failed"
    assert pl.zygote_note == (
        "workers are spawned: the zygote cannot fork: clone: [Errno 1] Operation not permitted"
    )
    pl.tick()
    pl.spawn("b")
    assert (z.forks, z.starts, len(spawned)) == (1, 1, 2)  # asked once, never restarted


def test_a_fork_request_too_large_spawns_that_worker_only(launch):
    pl, _, spawned = launch()
    z = ready(pl)
    z.fork_error = ForkUnsent("its fork request is too large")
    assert pl.spawn("a").started == "spawned"
    assert pl.zygote_state == "ready" and pl.zygote_note == ""
    with pytest.raises(AssertionError, match="a fork that succeeds"):
        pl.spawn("b")  # the next worker is asked of the zygote again
    assert z.forks == 2


# -- a zygote that dies: restarted, a few times within the window ----------------------


def die(pl: ProcessLauncher) -> None:
    """The ready zygote ends; the loop's tick notices."""
    zygote(pl).running = False
    pl.tick()


def test_a_dead_zygote_is_restarted_and_workers_are_spawned_while_it_preloads(launch):
    pl, clock, spawned = launch()
    z = ready(pl)
    z.preload = False
    die(pl)
    assert (pl.zygote_state, z.starts, len(pl.zygote_restarts)) == ("restarting", 2, 1)
    assert pl.zygote_note == "zygote (pid 4001) killed by SIGKILL; started again"
    assert pl.spawn("a").started == "spawned"  # a restart does not wait for the preload
    z.preload = True
    pl.tick()
    assert pl.zygote_state == "ready"
    assert pl.describe()["restarts"] == 1 and pl.describe()["pid"] == 4002


def test_a_zygote_gone_at_a_fork_is_restarted_and_that_worker_spawned(launch):
    pl, _, spawned = launch()
    z = ready(pl)
    z.running = False  # died since the last tick: seen by the fork
    assert pl.spawn("a").started == "spawned"
    assert (pl.zygote_state, z.starts) == ("restarting", 2)


def test_more_than_max_restarts_within_the_window_fail_the_zygote(launch):
    pl, clock, _ = launch()
    z = ready(pl)
    for i in range(MAX_RESTARTS):
        clock.t += WINDOW_S / (MAX_RESTARTS + 1)
        die(pl)
        assert pl.zygote_state == "restarting", i
        pl.tick()  # preloaded again
        assert pl.zygote_state == "ready"
    clock.t += 1.0
    die(pl)
    assert pl.zygote_state == "failed"
    assert pl.zygote_note == (
        "workers are spawned: the zygote cannot fork: zygote (pid 4004) killed by SIGKILL, "
        f"{MAX_RESTARTS} times within {WINDOW_S:g} s"
    )
    assert z.starts == MAX_RESTARTS + 1 and pl.spawn("a").started == "spawned"


def test_restarts_spread_wider_than_the_window_never_fail_the_zygote(launch):
    pl, clock, _ = launch()
    z = ready(pl)
    for _ in range(3 * MAX_RESTARTS):
        clock.t += WINDOW_S / MAX_RESTARTS + 0.01
        die(pl)
        pl.tick()
        assert pl.zygote_state == "ready"
    assert z.starts == 3 * MAX_RESTARTS + 1
    assert len(pl.zygote_restarts) == MAX_RESTARTS  # those within the window


def test_a_restart_whose_preload_is_overdue_fails_the_zygote(launch):
    pl, clock, _ = launch(ready_timeout_s=5.0)
    z = ready(pl)
    z.preload = False
    die(pl)
    clock.t += 5.0
    pl.tick()
    assert pl.zygote_state == "restarting"  # not yet past the limit
    clock.t += 0.01
    pl.tick()
    assert pl.zygote_state == "failed"
    assert pl.zygote_note.endswith("its preload took more than ready_timeout_s=5")
