"""Launchers: how an orchestrator starts stage workers, watches them and owns their memory.

The orchestrator's control plane (ready handshake, death, restarts, deadlines, cancel) is
the same on every backend; a launcher supplies the part that differs: where a worker runs
and how its end is noticed. :class:`ProcessLauncher` (the ``local`` backend) starts one OS
process per stage on this machine; a backend registered under the ``omni.backends``
entry-point group (the Ray backend, in the ``omni-ray`` distribution) runs the orchestrator
over a launcher of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from omni_core.config import PipelineConfig, split_worker
from omni_core.control.worker_env import inherited_env
from omni_core.control.zygote import (
    Fork,
    ForkRefused,
    ForkUnsent,
    Zygote,
    ZygoteGone,
    clone_unsupported,
    exit_reason,
    import_time_keys,
)
from omni_core.dataplane.serial import encode_json
from omni_core.dataplane.shm import SegmentOwner
from omni_core.dataplane.transport import make_socket_dir, remove_socket_dir
from omni_core.registry import load_stage_class
from omni_core.worker import WorkerSpec
from omni_core.worker.devices import worker_devices

log = logging.getLogger("omni.launcher")
start_log = logging.getLogger("omni.start")  # a line per step of a start (`omni run` shows them)


def report(line: str) -> None:
    start_log.info("%s", line)


# The worker dies with the orchestrator (PR_SET_PDEATHSIG) from its first statement, not
# only once its imports are done; a worker whose parent is already gone exits at once.
_WORKER_BOOT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[2]) or sys.exit(3); "
    "from omni_core.worker import main; sys.exit(main(sys.argv[1:2]))"
)


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
    # the prefix of every segment a result may name (None: the segments are not one
    # owner's, as on Ray, where each node's gateway owns its own)
    segment_scope: str | None = None

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


class _ChildProcess(WorkerHandle):
    """A worker that is this process's child (spawned, or forked by the zygote with this
    process as its parent): watched through a pidfd, reaped with its exit status."""

    started = "spawned"  # or "forked" (from the zygote)
    status_lost = False  # reaped by another part of this process: its exit status is unknown

    def __init__(self, pid: int, segment: str) -> None:
        self.pid = pid
        self.segment = segment
        self.pidfd: int | None = os.pidfd_open(pid)

    def fileno(self) -> int | None:
        return self.pidfd

    @abstractmethod
    def poll(self) -> int | None:
        """Its return code once it ended (negative: the signal), else None."""

    @abstractmethod
    def wait(self, timeout_s: float | None) -> int | None:
        """Wait up to ``timeout_s`` (None: for ever) for its end; its return code or None."""

    def exited(self) -> bool:
        return self.poll() is not None

    def reap(self) -> str:
        code = self.wait(None)
        self._close_fd()
        if self.status_lost:
            return "exited (its status was reaped by another part of this process)"
        return exit_reason(code)

    def stop(self, grace_s: float) -> None:
        if self.wait(max(grace_s, 0.001)) is None:
            self._signal(signal.SIGTERM)
            if self.wait(2) is None:
                self._signal(signal.SIGKILL)
                self.wait(None)
        self._close_fd()

    def kill(self) -> None:
        if self.poll() is None:
            self._signal(signal.SIGKILL)  # SIGKILL also ends a SIGSTOPped process

    def _signal(self, sig: int) -> None:
        if self.pidfd is not None:  # by pidfd: never a recycled pid
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, sig)

    def _close_fd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class _Spawned(_ChildProcess):
    def __init__(self, proc: subprocess.Popen[bytes], segment: str) -> None:
        super().__init__(proc.pid, segment)
        self.proc = proc

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float | None) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None


class _Forked(_ChildProcess):
    started = "forked"

    def __init__(self, pid: int, segment: str) -> None:
        super().__init__(pid, segment)
        self.returncode: int | None = None
        self._reaping = threading.Lock()  # health() polls from the caller's thread

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout_s: float | None) -> int | None:
        if timeout_s is None:
            return self._reap(0)
        if self.returncode is None and self.pidfd is not None:
            ended = select.poll()  # readable once it ended (poll: any fd number)
            ended.register(self.pidfd, select.POLLIN)
            ended.poll(timeout_s * 1000)
        return self.poll()

    def _reap(self, flags: int) -> int | None:
        with self._reaping:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, flags)
                except ChildProcessError:  # reaped by someone else: its status is lost
                    self.returncode = 0
                    self.status_lost = True
                else:
                    if pid == self.pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode


class Starter:
    """One long-lived daemon thread that starts processes. Linux ties a child's death
    signal (``PR_SET_PDEATHSIG``) to the thread that started it, so it must outlive the
    workers: a daemon thread lives until the process ends (an executor's thread would
    end at interpreter shutdown, before the pipelines' own close)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._run, name="omni-starter", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the starter thread; its result, or its exception raised here."""
        if not self.thread.is_alive():
            raise RuntimeError("the launcher's starter thread has ended")
        done: Future[Any] = Future()
        self.jobs.put((fn, done))
        return done.result()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, done = job
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)


class ProcessLauncher(Launcher):
    """The ``local`` backend: one OS process per stage worker, segments under /dev/shm.

    Workers are forked from the pipeline's zygote (:mod:`omni_core.control.zygote`) with
    ``backend.start: zygote`` (the default), else spawned as fresh interpreters; a worker
    that cannot be forked is spawned, and the log says why. Every process is started from
    one long-lived thread of the launcher's: a worker's death signal is tied to the
    thread that started it (``PR_SET_PDEATHSIG``), which must outlive it.
    """

    MAX_ZYGOTE_RESTARTS = 3  # within ZYGOTE_RESTART_WINDOW_S, then workers are spawned
    ZYGOTE_RESTART_WINDOW_S = 60.0

    def __init__(self, cfg: PipelineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock  # the zygote's restart window
        # both sweep what SIGKILLed predecessors left (their owner locks are free), then
        # hold this pipeline's owner locks until close() or this process's death
        self.socket_dir = make_socket_dir()
        try:
            self.segments = SegmentOwner()
            self.segment_scope = self.segments.prefix
        except BaseException:
            remove_socket_dir(self.socket_dir)
            raise
        self.starter = Starter()
        self.closed = False  # set under the lock by close(): no zygote is started after it
        self.lock = threading.Lock()  # the zygote's socket and state
        self.zygote: Zygote | None = None
        self.zygote_state = "off"  # off | preloading | ready | restarting | failed
        self.zygote_note = ""  # why workers are spawned, or what happened to the zygote
        self.zygote_restarts: deque[float] = deque()
        self.spawn_reasons: dict[str, str] = {}  # stage -> why it is never forked
        if cfg.backend.start == "zygote":
            self._plan_zygote()

    # -- the zygote -------------------------------------------------------------------
    def _plan_zygote(self) -> None:
        """Which modules the zygote preloads, and which stages are spawned instead."""
        why_not = clone_unsupported()
        if why_not:
            self.zygote_note = f"workers are spawned: {why_not}"
            log.warning("%s", self.zygote_note)
            return
        modules = ["omni_core.worker.process"]
        for st in self.cfg.stages:
            cls = load_stage_class(st.kind)
            keys = import_time_keys(st.extra_env, dict(os.environ))
            if not getattr(cls, "forkable", True):
                self.spawn_reasons[st.name] = f"its kind {st.kind!r} is not forkable"
            elif keys:
                self.spawn_reasons[st.name] = (
                    f"its extra_env sets {', '.join(keys)}, read when libraries load"
                )
            else:
                modules += [*cls.preload_modules(dict(st.options)), cls.__module__]
        for name, why in self.spawn_reasons.items():
            log.warning("stage %s: spawned, not forked: %s", name, why, extra={"stage": name})
        if len(self.spawn_reasons) < len(self.cfg.stages):
            self.zygote = Zygote(list(dict.fromkeys(modules)), report)  # started at the first spawn

    def _start_zygote(self, state: str = "preloading") -> None:
        """(Lock held.) Start the zygote process; it cannot start: workers are spawned."""
        assert self.zygote is not None
        try:
            self.starter.call(self.zygote.start)
        except OSError as e:
            self._zygote_failed(f"it could not be started: {e}")
            return
        self.zygote_state = state
        report(f"zygote: started (pid {self.zygote.pid}), preloading")

    def _zygote_ready(self, wait_s: float) -> bool:
        """(Lock held.) The zygote can fork now, following its preload for up to
        ``wait_s``; a zygote found dead is started again (a few times)."""
        z = self.zygote
        if z is None or self.closed or self.zygote_state in ("failed", "off"):
            return False
        try:
            if self.zygote_state == "restarting" and z.overdue(self.cfg.ready_timeout_s):
                self._zygote_failed(
                    f"its preload took more than ready_timeout_s={self.cfg.ready_timeout_s:g}"
                )
            elif self.zygote_state in ("preloading", "restarting") and z.follow(wait_s):
                self.zygote_state = "ready"
                p = z.preloaded
                assert p is not None
                report(f"zygote: preloaded {len(p.modules)} modules in {p.seconds:.1f} s")
                if p.failed:
                    self.zygote_note = "preloading failed: " + "; ".join(
                        f"{m}: {e}" for m, e in p.failed.items()
                    )
                if p.threads > 1:
                    self._zygote_failed(f"it has {p.threads} threads after its preload")
            elif self.zygote_state == "ready" and not z.alive():
                raise ZygoteGone(f"zygote (pid {z.pid}) {z.exit_reason()}")
        except ZygoteGone as e:
            self._restart_zygote(str(e))
        return self.zygote_state == "ready"

    def _restart_zygote(self, why: str) -> None:
        """(Lock held.) The zygote ended: start it again (workers are spawned while it
        preloads), unless it ended too often lately."""
        assert self.zygote is not None
        self._close_zygote()
        now = self.clock()
        while self.zygote_restarts and now - self.zygote_restarts[0] > self.ZYGOTE_RESTART_WINDOW_S:
            self.zygote_restarts.popleft()
        if len(self.zygote_restarts) >= self.MAX_ZYGOTE_RESTARTS:
            self._zygote_failed(
                f"{why}, {len(self.zygote_restarts)} times within "
                f"{self.ZYGOTE_RESTART_WINDOW_S:g} s"
            )
            return
        self.zygote_restarts.append(now)
        self.zygote_note = f"{why}; started again"
        log.error("%s: starting it again (workers are spawned meanwhile)", why)
        self._start_zygote("restarting")

    def _zygote_failed(self, why: str) -> None:
        self.zygote_state = "failed"
        self.zygote_note = f"workers are spawned: the zygote cannot fork: {why}"
        log.error("%s", self.zygote_note)
        self._close_zygote()

    def _close_zygote(self, kill: bool = True) -> None:
        """(Lock held.) End the zygote process (``kill``: at once, it failed) and reap the
        children it forked that never became workers (they exit once it is gone)."""
        if self.zygote is None:
            return
        for pid in self.zygote.close(kill):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def describe(self) -> dict[str, Any]:
        """How workers start, for health: the zygote's state, pid, restarts, preload."""
        z = self.zygote
        p = z.preloaded if z is not None else None
        return {
            "start": self.cfg.backend.start,
            "state": self.zygote_state,
            "pid": z.pid if z is not None and z.alive() else None,
            "restarts": len(self.zygote_restarts),
            "preload_s": p.seconds if p is not None else None,
            "preloaded": sorted(p.modules) if p is not None else [],
            "note": self.zygote_note,
            "spawned_stages": dict(self.spawn_reasons),
        }

    def tick(self) -> None:
        """Follow a (re)starting zygote's preload, notice its death."""
        if self.zygote is not None and not self.closed and self.lock.acquire(blocking=False):
            try:
                self._zygote_ready(0.0)
            finally:
                self.lock.release()

    # -- workers ----------------------------------------------------------------------
    def spawn(self, worker: str) -> WorkerHandle:
        stage, index = split_worker(worker)
        st = self.cfg.stage(stage)
        segment = self.segments.create(worker, self.cfg.shm_pool_bytes)
        try:
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
            spec_path = os.path.join(self.socket_dir, f"{segment}.spec.json")  # one per life
            fd = os.open(spec_path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(encode_json(spec))
            env = inherited_env()
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices  # before any import in the worker
            env.update(st.extra_env)
            handle = self._fork(worker, spec_path, env) if stage not in self.spawn_reasons else None
            if handle is None:
                handle = self.starter.call(lambda: self._spawn(spec_path, env, segment))
        except BaseException:
            self.segments.unlink(segment)
            raise
        model = st.options.get("model")
        what = f"{st.kind} ({model})" if isinstance(model, str) else st.kind
        report(f"{worker}: {handle.started} (pid {handle.pid}), loading {what}")
        return handle

    def _fork(self, worker: str, spec_path: str, env: dict[str, str]) -> WorkerHandle | None:
        """The worker forked from the zygote; None where it cannot be (then spawned)."""
        with self.lock:
            if self.closed:
                return None
            if self.zygote is not None and self.zygote_state == "off":
                self._start_zygote()
            # the pipeline's first start waits for the preload; a restart or an added
            # replica does not: spawned while the zygote (re)starts
            wait = self.cfg.ready_timeout_s if self.zygote_state == "preloading" else 0.0
            if not self._zygote_ready(wait):
                if wait and self.zygote_state == "preloading":
                    self._zygote_failed(f"its preload took more than ready_timeout_s={wait:g}")
                return None
            assert self.zygote is not None
            segment = os.path.basename(spec_path).removesuffix(".spec.json")
            try:
                pid = self.zygote.fork(Fork(worker, spec_path, env, os.getcwd()))
            except ForkUnsent as e:
                log.warning("%s: spawned, not forked: %s", worker, e, extra={"stage": worker})
            except ForkRefused as e:
                self._zygote_failed(str(e))
            except ZygoteGone as e:
                self._restart_zygote(str(e))
            else:
                try:
                    return _Forked(pid, segment)
                except BaseException:  # no handle (pidfd_open failed): end it here
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    raise
        return None

    def _spawn(self, spec_path: str, env: dict[str, str], segment: str) -> WorkerHandle:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, spec_path, str(os.getpid())],
            env=env,
            close_fds=True,
        )
        return _Spawned(proc, segment)

    def unlink_segment(self, handle: WorkerHandle) -> None:
        self.segments.unlink(handle.segment)

    def close(self) -> None:
        """End the zygote, unlink every segment, remove the socket directory with its
        sockets and the workers' spec files, and let go of their owner locks."""
        try:
            with self.lock:
                self.closed = True
                self._close_zygote(kill=False)
            self.starter.close()
            self.segments.unlink_all()
        finally:
            remove_socket_dir(self.socket_dir)
