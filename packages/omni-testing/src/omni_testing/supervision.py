"""A fake launcher and a fake clock for the supervisor's rules: workers that are objects,
not processes, and time that moves only when a test moves it."""

from __future__ import annotations

from omni_core.control.launcher import Launcher, WorkerHandle


class FakeWorker(WorkerHandle):
    """A worker that ends when stopped or killed, and says how it ended."""

    def __init__(self, n: int) -> None:
        self.pid = 1000 + n
        self.segment = f"seg{n}"
        self.ended = self.killed = False

    def exited(self) -> bool:
        return self.ended

    def reap(self) -> str:
        return "killed by SIGKILL" if self.killed else "exited with code 9"

    def stop(self, grace_s: float) -> None:
        self.ended = True

    def kill(self) -> None:
        self.killed = self.ended = True


class FakeLauncher(Launcher):
    """Spawns :class:`FakeWorker` s, kept in ``spawned`` in order."""

    socket_dir = "/nonexistent"

    def __init__(self) -> None:
        self.spawned: list[FakeWorker] = []

    def spawn(self, stage: str) -> WorkerHandle:
        self.spawned.append(FakeWorker(len(self.spawned)))
        return self.spawned[-1]

    def unlink_segment(self, handle: WorkerHandle) -> None:
        pass

    def close(self) -> None:
        pass


class Clock:
    """``time.monotonic`` for a supervisor: ``t`` seconds, set by the test."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
