"""Launchers: how an orchestrator starts stage workers, watches them and owns their memory.

The orchestrator's control plane (ready handshake, death, restarts, deadlines, cancel) is
the same on every backend; a launcher supplies the part that differs: where a worker runs
and how its end is noticed. :class:`ProcessLauncher` (the ``local`` backend) starts one OS
process per stage on this machine; other backends register a launcher class under the
``omni.backends`` entry-point group (the Ray backend lives in the ``omni-ray`` distribution).
"""

from __future__ import annotations

import os
import subprocess
import sys
from abc import ABC, abstractmethod

from omni_core.config import PipelineConfig, split_worker
from omni_core.devices import resolve_devices
from omni_core.serial import encode_json
from omni_core.shm import SegmentOwner
from omni_core.transport import make_socket_dir, remove_socket_dir
from omni_core.worker import WorkerSpec

# The worker dies with the orchestrator (PR_SET_PDEATHSIG) from its first statement, not
# only once its imports are done; a worker whose parent is already gone exits at once.
_WORKER_BOOT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[2]) or sys.exit(3); "
    "from omni_core.worker import main; sys.exit(main(sys.argv[1:2]))"
)


def exit_reason(code: int | None) -> str:
    """Words for a process exit status (``Popen.returncode``)."""
    if code is None:
        return "running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def worker_devices(cfg: PipelineConfig, worker: str, parent: str | None = None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` of ``worker`` (its replica's ``devices`` entry resolved
    against ``parent``, this process's own list by default); None: inherit."""
    stage, index = split_worker(worker)
    if parent is None:
        parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    return resolve_devices(cfg.worker_devices(stage, index), parent)


class WorkerHandle(ABC):
    """One life of one stage's worker."""

    segment: str  # the shared-memory segment this life writes into
    pid: int | None = None  # None until known (a remote worker reports it when placed)
    where: str = "local"  # the host or node it runs on, for health()

    def fileno(self) -> int | None:
        """An fd that becomes readable when the worker exits, or None (then poll
        :meth:`exited`)."""
        return None

    @abstractmethod
    def exited(self) -> bool:
        """The worker has ended (without blocking)."""

    @abstractmethod
    def reap(self) -> str:
        """Collect an ended worker; the reason it ended, in words."""

    @abstractmethod
    def stop(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the worker to end on its own, then end it."""

    @abstractmethod
    def kill(self) -> None:
        """End the worker now, without waiting (a hung stage); its end is then noticed and
        reaped like any other death."""


class Launcher(ABC):
    """Starts the workers of one pipeline and owns their segments and socket directory."""

    socket_dir: str  # where the orchestrator binds its sockets (on its own host)

    @abstractmethod
    def spawn(self, worker: str) -> WorkerHandle:
        """Start worker ``worker`` (a stage's name, or ``STAGE#i`` for replica ``i`` of a
        replicated stage): its first life or a restart."""

    def tick(self) -> None:  # noqa: B027 - optional hook
        """Called from the orchestrator's loop (about every 100 ms): housekeeping."""

    def failure(self) -> dict[str, str] | None:
        """``{"part", "error"}`` once a part of the backend itself failed for good (the
        runtime then fails loudly); None while it works."""
        return None

    def waiting(self, stage: str) -> str:
        """Why ``stage``'s worker may not have reported ready yet ("" if nothing to say)."""
        return ""

    @abstractmethod
    def unlink_segment(self, handle: WorkerHandle) -> None:
        """Free the segment of an ended worker life (no reader maps it any more)."""

    @abstractmethod
    def close(self) -> None:
        """Free every segment and the socket directory (workers have been stopped)."""


class _Process(WorkerHandle):
    def __init__(self, proc: subprocess.Popen[bytes], segment: str) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.segment = segment
        self.pidfd: int | None = os.pidfd_open(proc.pid)

    def fileno(self) -> int | None:
        return self.pidfd

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def reap(self) -> str:
        self.proc.wait()
        self._close_fd()
        return exit_reason(self.proc.returncode)

    def stop(self, grace_s: float) -> None:
        try:
            self.proc.wait(timeout=max(grace_s, 0.001))
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_fd()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL also ends a SIGSTOPped process

    def _close_fd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class ProcessLauncher(Launcher):
    """The ``local`` backend: one spawned OS process per stage, segments under /dev/shm."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        # both sweep what SIGKILLed predecessors left (their owner locks are free), then
        # hold this pipeline's owner locks until close() or this process's death
        self.socket_dir = make_socket_dir()
        try:
            self.segments = SegmentOwner()
        except BaseException:
            remove_socket_dir(self.socket_dir)
            raise

    def spawn(self, worker: str) -> WorkerHandle:
        stage, index = split_worker(worker)
        st = self.cfg.stage(stage)
        segment = self.segments.create(worker, self.cfg.shm_pool_bytes)
        devices = worker_devices(self.cfg, worker)
        spec = WorkerSpec(
            stage=stage,
            worker=worker,
            config=self.cfg,
            socket_dir=self.socket_dir,
            arena=segment,
            owner_pid=os.getpid(),
            devices=devices,
        )
        spec_path = os.path.join(self.socket_dir, f"{segment}.spec.json")  # one per process
        fd = os.open(spec_path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(encode_json(spec))
        env = dict(os.environ)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices  # before any import in the worker
        env.update(st.extra_env)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_BOOT, spec_path, str(os.getpid())],
                env=env,
                close_fds=True,
            )
        except BaseException:
            self.segments.unlink(segment)
            raise
        return _Process(proc, segment)

    def unlink_segment(self, handle: WorkerHandle) -> None:
        self.segments.unlink(handle.segment)

    def close(self) -> None:
        """Unlink every segment, remove the socket directory with its sockets and the
        workers' spec files, and let go of their owner locks."""
        try:
            self.segments.unlink_all()
        finally:
            remove_socket_dir(self.socket_dir)
