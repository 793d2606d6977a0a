"""The zygote process at its edges without a pipeline: the thread and OpenBLAS rules,
``clone_parent`` on a fake libc (and once for real, in a child process), and its loop
(``_serve``) on a socket pair with the fork faked. Its ``main`` and the child's way into
the worker are in ``test_zygote_child.py``, the launcher's handle in
``test_zygote_handle.py``."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
from omni_core import threads
from omni_core.control import zygote
from omni_core.control.zygote import (
    MAX_MESSAGE,
    Fork,
    Forked,
    Go,
    Importing,
    Preload,
    Preloaded,
    Refused,
    exit_reason,
)

# -- words and rules -------------------------------------------------------------------


def test_exit_reasons_name_the_code_or_the_signal():
    assert exit_reason(None) == "running"
    assert exit_reason(0) == "exited with code 0"
    assert exit_reason(3) == "exited with code 3"
    assert exit_reason(-9) == "killed by SIGKILL"
    assert exit_reason(-1) == "killed by SIGHUP"
    assert exit_reason(-200) == "killed by signal 200"


def test_clone_is_wired_for_linux_on_x86_64_and_aarch64_only(monkeypatch):
    monkeypatch.setattr(zygote.sys, "platform", "linux")
    for machine in ("x86_64", "aarch64"):
        monkeypatch.setattr(zygote.platform, "machine", lambda m=machine: m)
        assert zygote.clone_unsupported() == ""
    monkeypatch.setattr(zygote.platform, "machine", lambda: "riscv64")
    assert zygote.clone_unsupported() == "clone(2) is not wired for riscv64"
    monkeypatch.setattr(zygote.sys, "platform", "darwin")
    assert zygote.clone_unsupported() == "no clone(2) on darwin"


def test_thread_count_reads_proc_and_is_one_without_it(monkeypatch):
    assert zygote.thread_count() == len(os.listdir("/proc/self/task"))

    def gone(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(zygote.os, "listdir", gone)
    assert zygote.thread_count() == 1


@pytest.mark.parametrize(("threads", "platform_says", "why"), [
    (1, "", ""),
    (1, "no clone(2) on darwin", "no clone(2) on darwin"),
    (2, "", "the zygote has 2 threads (a preloaded module started them)"),
])  # fmt: skip
def test_a_fork_is_unsafe_with_a_second_thread_or_without_clone(
    monkeypatch, threads, platform_says, why
):
    stopped = []
    monkeypatch.setattr(zygote, "stop_blas_threads", lambda: stopped.append(1))
    monkeypatch.setattr(zygote, "thread_count", lambda: threads)
    monkeypatch.setattr(zygote, "clone_unsupported", lambda: platform_says)
    assert zygote.fork_unsafe() == why
    assert stopped == [1]  # OpenBLAS's pool stopped before the threads are counted


def test_the_openblas_builds_are_found_in_the_maps_and_the_ones_that_load_kept(monkeypatch):
    maps = "\n".join([
        "7f00-7f01 r-xp 0 08:01 1 /usr/lib/libopenblasp.so.0",
        "7f01-7f02 r-xp 0 08:01 2 /usr/lib/libc.so.6",  # not OpenBLAS
        "7f02-7f03 r--p 0 08:01 3 /data/openblas_notes.txt",  # not a library
        "7f03-7f04 r-xp 0 08:01 4 /site/numpy.libs/libscipy_openblas64_.so",
        "7f04-7f05 r-xp 0 08:01 4 /site/numpy.libs/libscipy_openblas64_.so",  # seen once
        "7f05-7f06 r-xp 0 08:01 5 /gone/libopenblas.so",  # cannot load: skipped
    ]) + "\n"  # fmt: skip
    opened = []

    def fake_open(path):
        opened.append(path)
        import io

        return io.StringIO(maps)

    def fake_cdll(path):
        if path.startswith("/gone"):
            raise OSError("cannot load")
        return f"lib:{path}"

    monkeypatch.setattr(threads, "open", fake_open, raising=False)
    monkeypatch.setattr(threads.ctypes, "CDLL", fake_cdll)
    assert threads.openblas_libs() == [
        "lib:/site/numpy.libs/libscipy_openblas64_.so",
        "lib:/usr/lib/libopenblasp.so.0",
    ]  # in path order
    assert opened == ["/proc/self/maps"]

    def no_proc(path):
        raise PermissionError(path)

    monkeypatch.setattr(threads, "open", no_proc, raising=False)
    assert threads.openblas_libs() == []


def test_stopping_blas_threads_asks_each_build_that_can(monkeypatch):
    calls = []
    can = types.SimpleNamespace(blas_thread_shutdown_=lambda: calls.append("can"))
    cannot = types.SimpleNamespace()  # an old build: no such function
    monkeypatch.setattr(zygote, "openblas_libs", lambda: [cannot, can, can])
    monkeypatch.setattr(zygote, "thread_count", lambda: 1)
    zygote.stop_blas_threads()
    assert calls == ["can", "can"]


def test_stopped_blas_threads_are_waited_for_until_they_leave_the_list(monkeypatch):
    """A joined thread is still listed a moment after its join: the count is looked at
    again until it is one, and a thread that stays (a live one) only for the bound."""
    can = types.SimpleNamespace(blas_thread_shutdown_=lambda: None)
    monkeypatch.setattr(zygote, "openblas_libs", lambda: [can])
    listed = [3, 2, 2, 1, 1]
    monkeypatch.setattr(zygote, "thread_count", lambda: listed.pop(0))
    zygote.stop_blas_threads()
    assert listed == [1]  # looked at until it was one, then no more

    monkeypatch.setattr(zygote, "thread_count", lambda: 2)  # a live thread
    monkeypatch.setattr(zygote, "EXITING_THREADS_WAIT_S", 0.05)
    t0 = time.monotonic()
    zygote.stop_blas_threads()
    assert 0.05 <= time.monotonic() - t0 < 1.0

    # no pool stopped (no OpenBLAS, or an old build): nothing to wait for
    monkeypatch.setattr(zygote, "openblas_libs", lambda: [types.SimpleNamespace()])
    monkeypatch.setattr(zygote, "EXITING_THREADS_WAIT_S", 5.0)
    t0 = time.monotonic()
    zygote.stop_blas_threads()
    assert time.monotonic() - t0 < 1.0


def test_a_zygote_that_loaded_numpy_is_single_threaded_at_once_after_the_stop():
    """The real race: numpy's pool is stopped and the count taken at once, in fresh
    interpreters (it showed 2 in about 1 start in 20 before the wait)."""
    script = (
        "import numpy\n"
        "from omni_core.control.zygote import stop_blas_threads, thread_count\n"
        "stop_blas_threads()\n"
        "print(thread_count())\n"
    )
    for _ in range(10):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "1"


class Blas:
    """An OpenBLAS build with some of the thread-count setters."""

    def __init__(self, *names: str) -> None:
        self.calls: list[tuple[str, int]] = []
        for name in names:
            setattr(self, name, lambda n, name=name: self.calls.append((name, n)))


@pytest.mark.parametrize(("env", "n"), [
    ({"OMP_NUM_THREADS": "3"}, 3),
    ({"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "5"}, 3),  # OMP's first
    ({"OMP_NUM_THREADS": "0", "MKL_NUM_THREADS": "2"}, 2),  # 0: not a count
    ({"OMP_NUM_THREADS": "x", "MKL_NUM_THREADS": "1"}, 1),
    ({"MKL_NUM_THREADS": "-2"}, None),
    ({"OMP_NUM_THREADS": "0"}, None),
    ({}, None),
])  # fmt: skip
def test_a_workers_thread_count_is_applied_to_torch_and_each_openblas(monkeypatch, env, n):
    for k in threads.THREAD_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    torch_calls = []
    monkeypatch.setitem(
        sys.modules, "torch", types.SimpleNamespace(set_num_threads=torch_calls.append)
    )
    plain = Blas(*threads.BLAS_SET_THREADS)  # has them all: the first is called, once
    wide = Blas("openblas_set_num_threads64_", "scipy_openblas_set_num_threads")
    scipy = Blas("scipy_openblas_set_num_threads")
    none = Blas()
    monkeypatch.setattr(threads, "openblas_libs", lambda: [plain, wide, scipy, none])
    threads.apply_thread_env()
    if n is None:
        assert torch_calls == [] and plain.calls == wide.calls == scipy.calls == []
        return
    assert torch_calls == [n]
    assert plain.calls == [("openblas_set_num_threads", n)]
    assert wide.calls == [("openblas_set_num_threads64_", n)]
    assert scipy.calls == [("scipy_openblas_set_num_threads", n)]


def test_without_torch_loaded_only_openblas_is_told(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    blas = Blas("openblas_set_num_threads")
    monkeypatch.setattr(threads, "openblas_libs", lambda: [blas])
    threads.apply_thread_env()
    assert blas.calls == [("openblas_set_num_threads", 2)]


def test_thread_counts_and_unchanged_values_never_force_a_spawn():
    base = {"LD_LIBRARY_PATH": "/a"}
    assert zygote.import_time_keys({"MKL_NUM_THREADS": "4", "OMP_NUM_THREADS": "2"}, {}) == []
    assert zygote.import_time_keys({"LD_LIBRARY_PATH": "/a"}, base) == []
    assert zygote.import_time_keys({"LD_LIBRARY_PATH": "/b", "MKL_DYNAMIC": "0"}, base) == [
        "LD_LIBRARY_PATH",
        "MKL_DYNAMIC",
    ]


# -- clone_parent ----------------------------------------------------------------------


class Syscall:
    """libc's ``syscall``: answers its libc's ``pid``, noting its arguments and whether the
    collector ran during it."""

    def __init__(self, libc: Libc) -> None:
        self.libc = libc
        self.restype = None

    def __call__(self, *args):
        self.libc.log.append(("syscall", [a.value for a in args], zygote.gc.isenabled()))
        return self.libc.pid


class Libc:
    """``ctypes.PyDLL(None)``, with a fake :class:`Syscall`."""

    def __init__(self, log: list, pid: int) -> None:
        self.log, self.pid = log, pid
        self.syscall = Syscall(self)


@pytest.fixture
def fake_clone(monkeypatch):
    """clone_parent's libc and CPython hooks faked; returns (log, set the syscall's pid)."""
    log: list = []
    libc = Libc(log, 0)

    def pydll(name, use_errno=False):
        log.append(("PyDLL", name, use_errno))
        return libc

    api = types.SimpleNamespace(
        PyOS_BeforeFork=lambda: log.append("before"),
        PyOS_AfterFork_Child=lambda: log.append("after child"),
        PyOS_AfterFork_Parent=lambda: log.append("after parent"),
    )
    monkeypatch.setattr(zygote.ctypes, "PyDLL", pydll)
    monkeypatch.setattr(zygote.ctypes, "pythonapi", api)
    monkeypatch.setattr(zygote.ctypes, "get_errno", lambda: errno.EAGAIN)
    monkeypatch.setattr(zygote.platform, "machine", lambda: "x86_64")

    def answer(pid: int) -> Libc:
        libc.pid = pid
        return libc

    return log, answer


@pytest.mark.parametrize(("machine", "number"), [("x86_64", 56), ("aarch64", 220)])
@pytest.mark.parametrize("collecting", [True, False])
def test_clone_parent_runs_the_fork_hooks_around_clone_with_the_collector_off(
    fake_clone, monkeypatch, machine, number, collecting
):
    log, answer = fake_clone
    monkeypatch.setattr(zygote.platform, "machine", lambda: machine)
    libc = answer(4242)
    was = zygote.gc.isenabled()
    try:
        (zygote.gc.enable if collecting else zygote.gc.disable)()
        assert zygote.clone_parent() == 4242
        assert zygote.gc.isenabled() is collecting
    finally:
        (zygote.gc.enable if was else zygote.gc.disable)()
    flags = zygote.CLONE_PARENT | signal.SIGCHLD
    assert log == [
        ("PyDLL", None, True),
        "before",
        ("syscall", [number, flags, None, None, None, 0], False),
        "after parent",
    ]
    assert flags == 0x8011 and libc.syscall.restype is ctypes.c_long


def test_clone_parent_in_the_child_runs_the_childs_hook_and_returns_zero(fake_clone):
    log, answer = fake_clone
    answer(0)
    assert zygote.clone_parent() == 0
    assert log[1:] == ["before", log[2], "after child"]


def test_a_refused_clone_is_an_oserror_with_the_errno_after_the_parents_hook(fake_clone):
    log, answer = fake_clone
    answer(-1)
    with pytest.raises(OSError) as e:
        zygote.clone_parent()
    assert e.value.errno == errno.EAGAIN
    assert str(e.value) == f"[Errno 11] clone(CLONE_PARENT): {os.strerror(errno.EAGAIN)}"
    assert log[-1] == "after parent" and zygote.gc.isenabled()


def test_a_real_clone_parent_child_is_the_callers_parents_child():
    """In a child process: the clone's child has the child process's parent (this
    process) for its own, which alone can reap it."""
    code = (
        "import gc, os; from omni_core.control.zygote import clone_parent\n"
        "pid = clone_parent()\n"
        "if pid == 0: os._exit(7)\n"
        "print(pid, gc.isenabled())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    pid, collecting = out.stdout.split()
    _, status = os.waitpid(int(pid), 0)  # ChildProcessError were it not ours
    assert os.waitstatus_to_exitcode(status) == 7 and collecting == "True"


# -- the zygote's loop (_serve) on a socket pair, the fork faked ------------------------


class Loop:
    """``_serve`` in a thread on one end of a SOCK_SEQPACKET pair; the test is the
    launcher on the other. ``clones``: what each fake ``clone_parent`` does (a pid, or an
    exception to raise); ``unsafe``: what each ``fork_unsafe`` says. The go pipes made
    are kept readable (``gos``) to see what the zygote told its children."""

    def __init__(self, monkeypatch, clones=(), unsafe=(), owner: int = 4000) -> None:
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.clones, self.unsafe = list(clones), list(unsafe)
        self.gos: list[int] = []
        self.became: list[tuple[Fork, int, int]] = []
        self.result: list = []
        real_pipe = os.pipe

        def pipe():
            r, w = real_pipe()
            self.gos.append(os.dup(r))
            return r, w

        def clone():
            c = self.clones.pop(0)
            if isinstance(c, BaseException):
                raise c
            return c

        def become(msg, owner, go):
            self.became.append((msg, owner, go))
            raise SystemExit(9)

        monkeypatch.setattr(zygote.os, "pipe", pipe)
        monkeypatch.setattr(zygote, "clone_parent", clone)
        monkeypatch.setattr(
            zygote, "fork_unsafe", lambda: self.unsafe.pop(0) if self.unsafe else ""
        )
        monkeypatch.setattr(zygote, "_become_worker", become)
        monkeypatch.setattr(zygote, "stop_blas_threads", lambda: None)
        monkeypatch.setattr(zygote, "thread_count", lambda: 1)
        monkeypatch.setattr(zygote, "gc", types.SimpleNamespace(collect=int, freeze=lambda: None))
        self.zsock = theirs

        def serve():
            try:
                self.result.append(zygote._serve(theirs, owner))
            except BaseException as e:  # noqa: BLE001 - SystemExit included
                self.result.append(e)

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def send(self, msg) -> None:
        zygote.send(self.ours, msg)

    def recv(self):
        self.ours.settimeout(10)
        return zygote.recv(self.ours)

    def end(self):
        self.thread.join(10)
        assert not self.thread.is_alive()
        for fd in self.gos:
            os.close(fd)
        self.ours.close()
        self.zsock.close()
        return self.result[0]


@pytest.mark.parametrize("first", [Fork("w", "/s.json", {}), None])
def test_a_zygote_whose_first_message_is_no_preload_ends_with_code_2(monkeypatch, first):
    loop = Loop(monkeypatch)
    if first is None:
        loop.ours.shutdown(socket.SHUT_WR)
    else:
        loop.send(first)
    assert loop.end() == 2


def test_the_zygote_preloads_then_forks_on_demand_until_the_launcher_closes(monkeypatch, clock):
    clock.step = 1.0
    loop = Loop(
        monkeypatch,
        clones=[OSError(errno.EAGAIN, "no room"), 4242, 4243, 4244],
        unsafe=["the zygote has 2 threads"],
    )
    loop.send(Preload(["json", "omni_nope_zz"]))
    assert loop.recv() == Importing("json")
    assert loop.recv() == Importing("omni_nope_zz")
    done = loop.recv()
    assert done == Preloaded(
        5.0,  # the clock read at the start, around each import and at the end
        {"json": 1.0, "omni_nope_zz": 1.0},
        {"omni_nope_zz": "ModuleNotFoundError: No module named 'omni_nope_zz'"},
        1,
    )
    fork = Fork("w#1", "/tmp/w.spec.json", {"A": "b"}, "/srv")
    loop.send(Go(1))  # not a fork: ignored
    loop.send(fork)
    assert loop.recv() == Refused("the zygote has 2 threads")  # no pipe made for it
    assert loop.gos == []
    loop.send(fork)
    assert loop.recv() == Refused("[Errno 11] no room")
    assert os.read(loop.gos[0], 1) == b""  # both ends of its pipe closed
    loop.send(fork)
    assert loop.recv() == Forked(4242)
    loop.send(Go(4242))
    assert os.read(loop.gos[1], 1) == b"g"  # the child may become the worker
    assert os.read(loop.gos[1], 1) == b""
    loop.send(fork)
    assert loop.recv() == Forked(4243)
    loop.send(Go(4242))  # not this child's pid: it is never told to go, the loop goes on
    assert os.read(loop.gos[2], 1) == b""
    loop.send(fork)
    assert loop.recv() == Forked(4244)
    loop.send(Preload([]))  # not an answer: that child is not told either
    assert os.read(loop.gos[3], 1) == b""
    loop.ours.shutdown(socket.SHUT_WR)
    assert loop.end() == 0
    assert loop.became == []


def test_a_launcher_that_closes_after_a_fork_ends_the_zygote_and_the_child_is_not_told(
    monkeypatch,
):
    loop = Loop(monkeypatch, clones=[77, 78])
    loop.send(Preload([]))
    assert isinstance(loop.recv(), Preloaded)
    loop.send(Fork("w", "/s", {}))
    assert loop.recv() == Forked(77)
    loop.ours.shutdown(socket.SHUT_WR)  # no Go: the launcher gave up
    assert loop.end() == 0
    assert loop.clones == [78]  # it forked nothing more


def test_the_forked_child_closes_the_zygotes_socket_and_pipe_end_and_becomes_the_worker(
    monkeypatch,
):
    loop = Loop(monkeypatch, clones=[0], owner=31337)
    loop.send(Preload([]))
    loop.recv()
    fork = Fork("w", "/s.json", {"X": "1"})
    loop.send(fork)
    result = loop.result
    loop.thread.join(10)
    (msg, owner, go) = loop.became[0]
    assert (msg, owner) == (fork, 31337)
    assert loop.zsock.fileno() == -1  # the child holds no launcher socket
    assert os.read(go, 1) == b""  # nor the pipe's write end
    os.close(go)
    assert isinstance(result[0], SystemExit) and result[0].code == 9
    loop.ours.settimeout(5)
    assert loop.ours.recv(MAX_MESSAGE) == b""  # closed: the child sent nothing on it
    loop.end()
