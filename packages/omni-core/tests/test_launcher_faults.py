"""The local launcher's zygote faults on a fake zygote and a fake clock: no zygote process,
and no worker process but a ``sleep`` standing in for a forked worker. Each fault leaves
workers spawned, says why in ``describe()``, and asks the zygote nothing more once it
failed for good."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from omni_core.config import PipelineConfig, parse_config
from omni_core.control import launcher as launcher_module
from omni_core.control.launcher import (
    Launcher,
    ProcessLauncher,
    Starter,
    WorkerHandle,
    _ChildProcess,
    _Spawned,
)
from omni_core.control.zygote import Fork, ForkRefused, ForkUnsent, Preloaded, ZygoteGone
from omni_testing.supervision import Clock, FakeWorker

WINDOW_S = ProcessLauncher.ZYGOTE_RESTART_WINDOW_S
MAX_RESTARTS = ProcessLauncher.MAX_ZYGOTE_RESTARTS


class FakeZygote:
    """What the launcher calls on a :class:`~omni_core.control.zygote.Zygote`, scripted:
    ``preload`` (done at the next follow), ``threads`` after it, ``fork_error`` raised
    by the next fork, ``start_error`` by the next start; ``running`` until the test ends
    it; ``failed``, the modules its preload reports failed; ``child``, the pid a fork
    returns (a real child of the test's); ``lost``, the pids its next close hands back.
    Its time is the test's ``clock``."""

    def __init__(self, modules: list[str], clock: Clock) -> None:
        self.modules = modules
        self.clock = clock
        self.preloaded: Preloaded | None = None
        self.preload = True
        self.threads = 1
        self.failed: dict[str, str] = {}
        self.child: int | None = None
        self.lost: list[int] = []
        self.sent: list[Fork] = []  # the fork requests it got
        self.waits: list[float] = []  # each follow's timeout
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
        self.waits.append(timeout_s)
        if not self.running:
            raise ZygoteGone(f"zygote (pid {self.pid}) {self.exit_reason()}")
        if self.preload and self.preloaded is None:
            self.preloaded = Preloaded(
                0.5, dict.fromkeys(self.modules, 0.1), self.failed, self.threads
            )
        return self.preloaded is not None

    def fork(self, fork: Fork, timeout_s: float = 2.0) -> int:
        self.forks += 1
        self.sent.append(fork)
        error, self.fork_error = self.fork_error, None
        if error is not None:
            raise error
        if not self.running:
            raise ZygoteGone(f"zygote (pid {self.pid}) {self.exit_reason()}")
        if self.child is not None:
            return self.child
        raise AssertionError("a fork that succeeds needs a process: not in these tests")

    def close(self, kill: bool = False) -> list[int]:
        self.closed.append(kill)
        self.running = False
        lost, self.lost = self.lost, []
        return lost

    def overdue(self, limit_s: float) -> bool:
        return self.preloaded is None and self.clock() - self.started_at > limit_s


class Spawned(FakeWorker):
    started = "spawned"
    env: dict[str, str]  # the environment it was spawned with


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
            spawned[-1].segment, spawned[-1].env = segment, env
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


@pytest.mark.parametrize(
    ("after", "state"), [(WINDOW_S, "failed"), (WINDOW_S + 0.01, "restarting")]
)
def test_a_restart_counts_against_the_limit_for_exactly_the_window(launch, after, state):
    """The first of ``MAX_RESTARTS`` restarts still counts ``WINDOW_S`` after it, not
    a moment later."""
    pl, clock, _ = launch()
    ready(pl)
    first = clock.t
    for i in range(MAX_RESTARTS):
        clock.t = first + i
        die(pl)
        pl.tick()
    clock.t = first + after
    die(pl)
    assert pl.zygote_state == state


def test_the_documented_restart_limit():
    """starting.md: the zygote is not started again after its deaths within 60 s; the
    launcher restarts it 3 times and fails it at the next death."""
    assert (MAX_RESTARTS, WINDOW_S) == (3, 60.0)


@pytest.mark.parametrize(("threads", "state"), [(1, "ready"), (2, "failed")])
def test_one_thread_after_the_preload_forks_two_do_not(launch, threads, state):
    pl, _, _ = launch()
    zygote(pl).threads = threads
    with pl.lock:
        pl._start_zygote()
        assert pl._zygote_ready(0.0) == (state == "ready")
    assert pl.zygote_state == state


def test_modules_that_failed_to_preload_are_noted_and_the_zygote_forks(launch):
    pl, _, _ = launch()
    zygote(pl).failed = {"m1": "ImportError: no m1", "m2": "boom"}
    ready(pl)
    assert pl.zygote_note == "preloading failed: m1: ImportError: no m1; m2: boom"


def test_describe_follows_the_zygote(launch):
    pl, _, _ = launch()
    off = pl.describe()
    assert (off["state"], off["pid"], off["preload_s"], off["preloaded"]) == ("off", None, None, [])
    z = ready(pl)
    assert pl.describe() == {
        "start": "zygote",
        "state": "ready",
        "pid": 4001,
        "restarts": 0,
        "preload_s": 0.5,
        "preloaded": sorted(z.modules),
        "note": "",
        "spawned_stages": {},
    }
    z.running = False  # dead, not noticed yet
    assert pl.describe()["pid"] is None


def test_the_first_start_waits_for_the_preload_a_restart_does_not(launch):
    pl, _, spawned = launch(ready_timeout_s=7.0)
    z = zygote(pl)
    z.fork_error = ForkUnsent("too large")
    pl.spawn("a")
    assert z.waits == [7.0]
    die(pl)
    z.preload = False
    pl.spawn("b")
    assert z.waits == [7.0, 0.0]  # the restart's preload: not waited for
    assert pl.zygote_state == "restarting" and len(spawned) == 2


def test_tick_never_waits_for_the_lock(launch):
    pl, _, _ = launch()
    z = ready(pl)
    z.running = False
    with pl.lock:  # a spawn holds it
        pl.tick()
    assert pl.zygote_state == "ready"
    pl.tick()
    assert pl.zygote_state == "restarting"


def test_close_lets_the_zygote_exit_and_nothing_restarts_it(launch):
    pl, _, _ = launch()
    z = ready(pl)
    pl.close()
    assert z.closed == [False]  # not killed: it exits once its socket closes
    pl.tick()
    with pl.lock:
        assert not pl._zygote_ready(0.0)
    assert pl._fork("a", os.path.join(pl.socket_dir, "s.spec.json"), {}) is None
    assert (z.starts, z.forks, pl.zygote_state) == (1, 0, "ready")


@pytest.fixture
def child() -> Iterator[int]:
    """A child process of the test's, as a forked worker is the orchestrator's."""
    pid = os.posix_spawn("/bin/sleep", ["sleep", "30"], {})
    yield pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def gone(pid: int) -> bool:
    """``pid`` was reaped (it is no child of this process any more)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_a_forked_worker_is_watched_and_ended_by_its_pidfd(launch, child):
    pl, _, spawned = launch(stage={"extra_env": {"OMNI_TEST_FORKED": "1"}})
    z = ready(pl)
    z.child = child
    h = pl.spawn("b")
    assert (h.started, h.pid, spawned) == ("forked", child, [])
    (sent,) = z.sent
    assert sent.worker == "b" and sent.cwd == os.getcwd()
    assert sent.spec_path == os.path.join(pl.socket_dir, f"{h.segment}.spec.json")
    assert os.path.exists(sent.spec_path) and sent.env["OMNI_TEST_FORKED"] == "1"
    assert h.fileno() is not None and not h.exited()
    h.stop(0.01)  # sleep ends at SIGTERM
    assert h.exited() and h.fileno() is None
    assert h.reap() == "killed by SIGTERM" and gone(child)


def test_a_killed_forked_worker_is_reaped_with_its_signal(launch, child):
    pl, _, _ = launch()
    z = ready(pl)
    z.child = child
    h = pl.spawn("a")
    h.kill()
    assert h.reap() == "killed by SIGKILL" and h.fileno() is None


def test_a_forked_child_without_a_pidfd_is_ended_here(launch, child, monkeypatch):
    pl, _, _ = launch()
    z = ready(pl)
    z.child = child

    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    with pytest.raises(OSError, match="Too many open files"):
        pl.spawn("a")
    assert gone(child)


def test_children_the_zygote_lost_are_reaped_when_it_closes(launch):
    """Waited for: they exit once the zygote is gone (here, after 0.2 s)."""
    pl, _, _ = launch()
    z = ready(pl)
    lost = os.posix_spawn("/bin/sleep", ["sleep", "0.2"], {})
    z.lost = [1, lost]  # pid 1 is no child of this process: skipped
    z.fork_error = ForkRefused("no")
    pl.spawn("a")
    assert z.closed == [True] and gone(lost)


def test_the_starter_runs_calls_on_its_own_thread():
    s = Starter()
    assert s.thread.daemon  # it must not keep the interpreter from exiting
    assert s.call(lambda: threading.current_thread().name) == "omni-starter"
    with pytest.raises(KeyError):
        s.call(lambda: {}["x"])
    s.close()
    assert not s.thread.is_alive()
    with pytest.raises(RuntimeError, match="starter thread has ended"):
        s.call(lambda: 1)


def test_the_handles_and_the_launcher_are_abstract():
    assert WorkerHandle.__abstractmethods__ == {"exited", "reap", "stop", "kill"}
    assert Launcher.__abstractmethods__ == {"spawn", "unlink_segment", "close"}
    assert _ChildProcess.__abstractmethods__ == {"poll", "wait"}


def test_a_worker_reaped_elsewhere_has_no_status(launch, child):
    pl, _, _ = launch()
    ready(pl).child = child
    h = pl.spawn("a")
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)  # another part of this process reaped it
    assert h.exited()
    assert h.reap() == "exited (its status was reaped by another part of this process)"


def test_the_tick_follows_a_restarting_preload_without_waiting(launch):
    pl, _, _ = launch()
    z = ready(pl)
    die(pl)
    pl.tick()
    assert z.waits[-1] == 0.0 and pl.zygote_state == "ready"


def test_a_spawned_worker_starts_the_worker_boot(monkeypatch):
    """``start: spawn``: a fresh interpreter (here a ``sleep``) told the spec and this
    process's pid, with no inherited fds; watched and ended like a forked one."""
    pl = ProcessLauncher(config(backend={"start": "spawn"}))
    calls: list[tuple[list[str], dict]] = []
    real = subprocess.Popen

    def popen(args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        calls.append((args, kwargs))
        return real(["sleep", "30"])

    monkeypatch.setattr(launcher_module.subprocess, "Popen", popen)
    try:
        h = pl.spawn("a")
        ((args, kwargs),) = calls
        spec = os.path.join(pl.socket_dir, f"{h.segment}.spec.json")
        assert args[:2] == [sys.executable, "-c"] and args[3:] == [spec, str(os.getpid())]
        assert kwargs["close_fds"] is True and kwargs["env"]["PATH"] == os.environ["PATH"]
        assert os.stat(spec).st_mode & 0o777 == 0o600
        assert isinstance(h, _Spawned) and h.started == "spawned"
        assert h.wait(0.01) is None and not h.exited()
        h.kill()
        assert h.reap() == "killed by SIGKILL"
    finally:
        pl.close()


def test_a_launcher_whose_segments_cannot_be_owned_removes_its_socket_dir(monkeypatch):
    removed: list[str] = []

    def no_segments() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(launcher_module, "make_socket_dir", lambda: "/nonexistent/omni-x")
    monkeypatch.setattr(launcher_module, "remove_socket_dir", removed.append)
    monkeypatch.setattr(launcher_module, "SegmentOwner", no_segments)
    with pytest.raises(OSError, match="No space left"):
        ProcessLauncher(config())
    assert removed == ["/nonexistent/omni-x"]


def test_each_spawn_and_each_stage_never_forked_is_logged(launch, monkeypatch, caplog):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    caplog.set_level(logging.INFO)
    pl, _, spawned = launch(stage={"extra_env": {"MALLOC_ARENA_MAX": "2"}, "devices": "cpu"})
    assert "stage a: spawned, not forked: its extra_env sets MALLOC_ARENA_MAX" in caplog.text
    pl.spawn("a")
    assert "a: spawned (pid 1000), loading synthetic.map" in caplog.messages  # no model
    assert spawned[0].env["CUDA_VISIBLE_DEVICES"] == ""  # devices: cpu


def test_a_forked_worker_is_waited_for_up_to_the_timeout(launch, child):
    pl, _, _ = launch()
    ready(pl).child = child
    h = pl.spawn("a")
    start = time.monotonic()
    assert h.wait(0.2) is None
    assert time.monotonic() - start >= 0.15  # it watched the pidfd, not one poll
