"""The zygote: one preloaded process per pipeline that forks the stage workers.

A fresh interpreter pays for its imports (torch, transformers, diffusers: seconds each)
before a stage can load, at every start, every restart and every replica added. The
zygote imports what the pipeline's stage kinds declare (:meth:`Stage.preload_modules`)
once, before any thread or device context exists, and then forks a worker per request:
the child starts with those modules in memory (shared with the zygote, copy-on-write).

The fork is ``clone(CLONE_PARENT)``: the worker's parent is the orchestrator, not the
zygote. So the worker dies with the orchestrator (``PR_SET_PDEATHSIG``, as a spawned
worker does), the orchestrator reaps it and reads its exit status, and a zygote that dies
takes no worker with it (it is started again; meanwhile workers are spawned). CPython's
own fork hooks run around the clone (``PyOS_BeforeFork`` and the after-fork calls), as in
``os.fork``. Forking is refused, and the launcher spawns instead and says so in the log,
when the zygote is not single-threaded (a preloaded module started a thread: a fork would
copy its locks, not it), on a platform without ``clone``, or when the kernel refuses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import importlib
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

import msgspec

from omni_core.control.worker_env import inherited_env
from omni_core.threads import THREAD_ENV, apply_thread_env, openblas_libs

log = logging.getLogger("omni.zygote")

CLONE_PARENT = 0x00008000
SYS_CLONE = {"x86_64": 56, "aarch64": 220}  # clone(2); its first argument is the flags
PR_SET_PDEATHSIG = 1
MAX_MESSAGE = 1 << 20

# Read by a library when it loads, so a stage's ``extra_env`` setting one of these cannot
# take effect in a worker forked after the zygote imported that library: such a stage is
# spawned. OMP_NUM_THREADS and MKL_NUM_THREADS are applied after the fork instead, with
# torch.set_num_threads and OpenBLAS's setter (their ways once loaded).
IMPORT_TIME_ENV = (
    "LD_",
    "PYTHON",
    "MALLOC_",
    "GLIBC_",
    "OPENBLAS_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OMP_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "DIFFUSERS_",
    "TORCH",
    "PYTORCH_",
    "VLLM_",
)


# -- the wire between the launcher and the zygote (a SOCK_SEQPACKET pair) ---------------
class Preload(msgspec.Struct, tag=True):
    modules: list[str]


class Importing(msgspec.Struct, tag=True):
    module: str


class Preloaded(msgspec.Struct, tag=True):
    seconds: float
    modules: dict[str, float]  # module -> seconds its import took
    failed: dict[str, str]  # module -> the error (the stage that needs it reports it too)
    threads: int


class Fork(msgspec.Struct, tag=True):
    worker: str
    spec_path: str
    env: dict[str, str]
    cwd: str = "/"  # the orchestrator's, now (a spawned worker's would be)


class Forked(msgspec.Struct, tag=True):
    pid: int


class Go(msgspec.Struct, tag=True):
    """The launcher has the child's pid: it may become the worker."""

    pid: int


class Refused(msgspec.Struct, tag=True):
    error: str


Message = Preload | Importing | Preloaded | Fork | Forked | Go | Refused
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def send(sock: socket.socket, msg: Message) -> None:
    sock.send(_encoder.encode(msg))


def recv(sock: socket.socket) -> Message | None:
    """The next message; None at end of stream (the peer closed or died)."""
    data = sock.recv(MAX_MESSAGE)
    return _decoder.decode(data) if data else None


# -- forking --------------------------------------------------------------------------
def exit_reason(code: int | None) -> str:
    """Words for a process exit status (``Popen.returncode``)."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def clone_unsupported() -> str:
    """Why this platform cannot ``clone(CLONE_PARENT)`` ("" when it can)."""
    if not sys.platform.startswith("linux"):
        return f"no clone(2) on {sys.platform}"
    if platform.machine() not in SYS_CLONE:
        return f"clone(2) is not wired for {platform.machine()}"
    return ""


# How long threads just joined may still be listed (see stop_blas_threads). One still
# listed after that is alive (a preloaded module started it): the zygote does not fork.
EXITING_THREADS_WAIT_S = 0.5


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def stop_blas_threads() -> None:
    """OpenBLAS (numpy's) starts its thread pool when it loads; stop it, as its own
    pre-fork handler does (that handler does not run around a raw clone). The pool
    starts again, in the zygote and in each child, at its next parallel call.

    A joined thread leaves ``/proc/self/task`` a moment after its join returns (the
    kernel wakes the joiner before it unlists the thread), and nothing signals that
    moment: once a pool was stopped, the thread list is looked at again until it is
    one, for up to :data:`EXITING_THREADS_WAIT_S`. Counted at once, a loaded machine
    saw the pool's last thread and the zygote refused to fork (1 start in 20 here)."""
    stopped = False
    for lib in openblas_libs():
        with contextlib.suppress(AttributeError):
            lib.blas_thread_shutdown_()
            stopped = True
    if stopped:
        deadline = time.monotonic() + EXITING_THREADS_WAIT_S
        while thread_count() > 1 and time.monotonic() < deadline:
            time.sleep(0.001)


def fork_unsafe() -> str:
    """Why forking this process now would be unsafe ("" when it is not)."""
    stop_blas_threads()
    n = thread_count()
    if n > 1:
        return f"the zygote has {n} threads (a preloaded module started them)"
    return clone_unsupported()


def clone_parent() -> int:
    """Fork this (single-threaded) process with ``CLONE_PARENT``: the child's parent is
    this process's parent. Returns 0 in the child, the child's pid here.

    CPython's fork hooks run around it as in :func:`os.fork` (the import lock, the
    ``os.register_at_fork`` callbacks, the thread state); every function and argument is
    looked up before the window and the collector is off in it, so no Python code of
    its own runs there. What glibc's ``fork()`` adds does not happen: its
    ``pthread_atfork`` handlers (none that matter in a single-threaded zygote that never
    touched a device), and the child's main thread keeps the zygote's thread id in its
    ``pthread_t`` (``pthread_kill`` of the worker's main thread from another thread, and
    priority-inheritance or robust mutexes held by it, are not supported)."""
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held, as in os.fork
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    before = ctypes.pythonapi.PyOS_BeforeFork
    after_child = ctypes.pythonapi.PyOS_AfterFork_Child
    after_parent = ctypes.pythonapi.PyOS_AfterFork_Parent
    args = (
        ctypes.c_long(SYS_CLONE[platform.machine()]),
        ctypes.c_ulong(CLONE_PARENT | signal.SIGCHLD),
        ctypes.c_void_p(0),
        ctypes.c_void_p(0),
        ctypes.c_void_p(0),
        ctypes.c_ulong(0),
    )
    collecting = gc.isenabled()
    gc.disable()
    before()
    pid = syscall(*args)
    if pid == 0:
        after_child()
    else:
        err = ctypes.get_errno()
        after_parent()
    if collecting:
        gc.enable()
    if pid < 0:
        raise OSError(err, f"clone(CLONE_PARENT): {os.strerror(err)}")
    return pid


# -- the zygote process -----------------------------------------------------------------
def main(argv: list[str]) -> int:
    """``argv``: the socket's fd and the orchestrator's pid. Preload, then fork on demand
    until the launcher closes the socket."""
    from omni_core.observability.logs import configure_logging
    from omni_core.worker.process import name_process

    configure_logging()
    sock = socket.socket(fileno=int(argv[0]))
    owner = int(argv[1])
    name_process("omni:zygote")
    # Ctrl-C at a terminal reaches the whole process group: the orchestrator decides
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return _serve(sock, owner)
    except (BrokenPipeError, ConnectionResetError):  # the launcher closed meanwhile
        return 0


def _serve(sock: socket.socket, owner: int) -> int:
    first = recv(sock)
    if not isinstance(first, Preload):
        return 2
    send(sock, _preload(sock, first.modules))
    while True:
        msg = recv(sock)
        if msg is None:  # the launcher closed: done
            return 0
        if not isinstance(msg, Fork):
            continue
        why = fork_unsafe()
        if why:
            send(sock, Refused(why))
            continue
        # The child waits for a byte on this pipe before it becomes the worker, written
        # once the launcher says it has the child's pid (Go). If it never does (it gave
        # up waiting, this process dies), the pipe closes unwritten and the child exits:
        # no worker runs that nobody manages.
        go_read, go_write = os.pipe()
        try:
            pid = clone_parent()
        except OSError as e:
            os.close(go_read)
            os.close(go_write)
            send(sock, Refused(str(e)))
            continue
        if pid == 0:
            sock.close()
            os.close(go_write)
            _become_worker(msg, owner, go_read)
        os.close(go_read)
        try:
            send(sock, Forked(pid))
            answer = recv(sock)
            if isinstance(answer, Go) and answer.pid == pid:
                os.write(go_write, b"g")
            elif answer is None:
                return 0
        finally:
            os.close(go_write)


def _preload(sock: socket.socket, modules: list[str]) -> Preloaded:
    t0 = time.monotonic()
    took: dict[str, float] = {}
    failed: dict[str, str] = {}
    for name in modules:
        send(sock, Importing(name))
        t = time.monotonic()
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - the stage that needs it fails at its load
            failed[name] = "".join(traceback.format_exception_only(type(e), e)).strip()
            log.warning("zygote: preloading %s failed: %s", name, failed[name])
        took[name] = time.monotonic() - t
    # what the preload made is long-lived: keep the collector off those pages in every
    # child (a collection writes to each object it visits, which would copy the page)
    gc.collect()
    gc.freeze()
    stop_blas_threads()
    return Preloaded(time.monotonic() - t0, took, failed, thread_count())


def _become_worker(fork: Fork, owner: int, go: int) -> NoReturn:
    """The child: the worker's environment, death with the orchestrator, then the worker's
    own main. It never returns to the zygote's loop: its exit unwinds the zygote's frames
    (none catches it) and the interpreter ends as a spawned worker's does (atexit, zmq
    flushing what a closing socket still holds: a load failure's report)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != owner:  # the orchestrator is already gone
            os._exit(3)
        if os.read(go, 1) != b"g":  # the launcher never learnt of this process
            os._exit(3)
        os.close(go)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(fork.cwd)
        os.environ.clear()
        os.environ.update(fork.env)
        apply_thread_env()
        from omni_core.worker.process import main as worker_main

        code = worker_main([fork.spec_path])
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - the worker reports its own errors; this is a bug
        traceback.print_exc()
        code = 1
    raise SystemExit(code)


def import_time_keys(extra_env: dict[str, str], base: dict[str, str]) -> list[str]:
    """The keys of ``extra_env`` that change a variable libraries read when they load
    (those in :data:`THREAD_ENV` are applied after the fork, so they do not count)."""
    return sorted(
        k
        for k, v in extra_env.items()
        if k.startswith(IMPORT_TIME_ENV) and k not in THREAD_ENV and base.get(k) != v
    )


# -- the launcher's end ------------------------------------------------------------------
ZYGOTE_BOOT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[2]) or sys.exit(3); "
    "from omni_core.control.zygote import main; sys.exit(main(sys.argv[1:]))"
)


class ZygoteGone(Exception):
    """The zygote ended (or stopped answering); the launcher spawns meanwhile."""


class ForkRefused(Exception):
    """The zygote cannot fork safely (its message says why); spawn instead."""


class ForkUnsent(Exception):
    """This one request could not be sent (an environment too large for a message):
    spawn this worker; the zygote is fine."""


class Zygote:
    """The launcher's handle on its zygote process: start it, follow its preload, ask it
    for a worker. Not thread-safe: the launcher serialises calls."""

    def __init__(self, modules: list[str], report: Callable[[str], None]) -> None:
        self.modules = modules
        self.report = report  # start progress, one line each
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.preloaded: Preloaded | None = None
        self.started_at = 0.0
        self.lost: list[int] = []  # children that will not become workers, to reap

    def start(self) -> None:
        """Start the process and hand it the modules (returns at once; the preload goes
        on there). Call on the thread the workers' death signal is tied to."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", ZYGOTE_BOOT, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),),
                close_fds=True,
                env=inherited_env(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock, self.preloaded, self.started_at = ours, None, time.monotonic()
        send(ours, Preload(self.modules))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_reason(self) -> str:
        return exit_reason(self.proc.poll()) if self.proc is not None else "not started"

    def follow(self, timeout_s: float) -> bool:
        """Read its preload progress for up to ``timeout_s``; True once preloaded.
        :class:`ZygoteGone` if it ended."""
        deadline = time.monotonic() + timeout_s
        while self.preloaded is None:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            if msg is False:
                return False
            if isinstance(msg, Importing):
                self.report(f"zygote: importing {msg.module}")
            elif isinstance(msg, Preloaded):
                self.preloaded = msg
        return True

    def fork(self, fork: Fork, timeout_s: float = 2.0) -> int:
        """A worker forked from the preloaded zygote; its pid."""
        assert self.sock is not None and self.preloaded is not None
        try:
            send(self.sock, fork)
        except OSError as e:
            if e.errno == errno.EMSGSIZE:
                raise ForkUnsent(f"its fork request is too large ({e})") from None
            raise ZygoteGone(f"zygote: {e}") from None
        msg = self._recv(timeout_s)
        if isinstance(msg, Refused):
            raise ForkRefused(msg.error)
        if not isinstance(msg, Forked):
            raise ZygoteGone(f"zygote did not answer a fork within {timeout_s:g} s")
        try:
            send(self.sock, Go(msg.pid))
        except OSError as e:
            self.lost.append(msg.pid)  # it exits on its own; the caller reaps it
            raise ZygoteGone(f"zygote: {e}") from None
        return msg.pid

    def _recv(self, timeout_s: float) -> Message | bool:
        """The next message; False on timeout; :class:`ZygoteGone` at its end."""
        assert self.sock is not None
        self.sock.settimeout(max(timeout_s, 0.0) or 0.000001)
        try:
            msg = recv(self.sock)
        except TimeoutError:
            return False
        except OSError as e:
            raise ZygoteGone(f"zygote: {e}") from None
        if msg is None:
            if self.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=1)
            raise ZygoteGone(f"zygote (pid {self.pid}) {self.exit_reason()}")
        return msg

    def close(self, kill: bool = False) -> list[int]:
        """End it: closing its socket ends its loop; killed if it does not exit (at once
        with ``kill``: it failed, maybe stopped or hung). The pids
        of children it forked whose replies were never read (the caller lost them to a
        timeout or the zygote's death): they exit without becoming workers, and are the
        caller's to reap."""
        lost, self.lost = self.lost, []
        if self.sock is not None:
            self.sock.setblocking(False)
            with contextlib.suppress(OSError, msgspec.DecodeError):
                while (msg := recv(self.sock)) is not None:
                    if isinstance(msg, Forked):
                        lost.append(msg.pid)
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            if kill and self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return lost

    def overdue(self, limit_s: float) -> bool:
        """Still preloading ``limit_s`` after its start."""
        return self.preloaded is None and time.monotonic() - self.started_at > limit_s
