"""The zygote at its edges without a pipeline: its loop (``_serve``) on a socket pair with
the fork faked, the child's path into the worker (``_become_worker``) with the process
calls faked, ``clone_parent`` on a fake libc (and once for real, in a child process),
the launcher's handle (:class:`Zygote`) on a fake socket, process and clock, the thread
and OpenBLAS rules, and one real zygote that preloads and forks a worker (a second)."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import types

import msgspec
import pytest
from omni_core.control import zygote
from omni_core.control.worker_env import inherited_env
from omni_core.control.zygote import (
    MAX_MESSAGE,
    ZYGOTE_BOOT,
    Fork,
    Forked,
    ForkRefused,
    ForkUnsent,
    Go,
    Importing,
    Preload,
    Preloaded,
    Refused,
    Zygote,
    ZygoteGone,
    _decoder,
    _encoder,
    exit_reason,
)


class Clock:
    """``time`` for the zygote module: ``monotonic()`` steps by ``step`` at each call."""

    def __init__(self, now: float = 100.0, step: float = 0.0) -> None:
        self.now, self.step = now, step

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(zygote, "time", c)
    return c


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

    monkeypatch.setattr(zygote, "open", fake_open, raising=False)
    monkeypatch.setattr(zygote.ctypes, "CDLL", fake_cdll)
    assert zygote._openblas_libs() == [
        "lib:/site/numpy.libs/libscipy_openblas64_.so",
        "lib:/usr/lib/libopenblasp.so.0",
    ]  # in path order
    assert opened == ["/proc/self/maps"]

    def no_proc(path):
        raise PermissionError(path)

    monkeypatch.setattr(zygote, "open", no_proc, raising=False)
    assert zygote._openblas_libs() == []


def test_stopping_blas_threads_asks_each_build_that_can(monkeypatch):
    calls = []
    can = types.SimpleNamespace(blas_thread_shutdown_=lambda: calls.append("can"))
    cannot = types.SimpleNamespace()  # an old build: no such function
    monkeypatch.setattr(zygote, "_openblas_libs", lambda: [cannot, can, can])
    zygote.stop_blas_threads()
    assert calls == ["can", "can"]


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
    for k in zygote.THREAD_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    torch_calls = []
    monkeypatch.setitem(
        sys.modules, "torch", types.SimpleNamespace(set_num_threads=torch_calls.append)
    )
    plain = Blas(*zygote.BLAS_SET_THREADS)  # has them all: the first is called, once
    wide = Blas("openblas_set_num_threads64_", "scipy_openblas_set_num_threads")
    scipy = Blas("scipy_openblas_set_num_threads")
    none = Blas()
    monkeypatch.setattr(zygote, "_openblas_libs", lambda: [plain, wide, scipy, none])
    zygote.apply_thread_env()
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
    monkeypatch.setattr(zygote, "_openblas_libs", lambda: [blas])
    zygote.apply_thread_env()
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


# -- main ------------------------------------------------------------------------------


@pytest.fixture
def sigint():
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("sigint")
@pytest.mark.parametrize(("serve", "code"), [
    ("returns", 5),
    (BrokenPipeError, 0),
    (ConnectionResetError, 0),
])  # fmt: skip
def test_main_names_the_process_ignores_ctrl_c_and_serves_the_socket_it_is_given(
    monkeypatch, serve, code
):
    import omni_core.observability.logs as logs
    import omni_core.worker.process as process

    named, served = [], []
    monkeypatch.setattr(logs, "configure_logging", lambda: named.append("logging"))
    monkeypatch.setattr(process, "name_process", named.append)

    def fake_serve(sock, owner):
        served.append((sock.fileno(), sock.type, owner, signal.getsignal(signal.SIGINT)))
        if serve == "returns":
            return 5
        raise serve()

    monkeypatch.setattr(zygote, "_serve", fake_serve)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = b.detach()
    try:
        assert zygote.main([str(fd), "4321"]) == code
    finally:
        a.close()
        with pytest.raises(OSError):
            os.close(fd)  # closed with main's socket
    assert named == ["logging", "omni:zygote"]
    assert served == [(fd, socket.SOCK_SEQPACKET, 4321, signal.SIG_IGN)]


# -- the child's way into the worker (_become_worker), process calls faked -----------------


@pytest.fixture
def child(monkeypatch, tmp_path):
    """_become_worker's process calls faked: ``prctl`` noted, ``getppid`` the given owner
    (``state["ppid"]``), ``os._exit`` a SystemExit, the worker's main a fake noting where
    it runs; the cwd, environment and SIGINT handler put back after."""
    import omni_core.worker.process as process

    state: dict = {"ppid": 500, "prctl": [], "main": [], "threads": 0, "raise": None}
    libc = types.SimpleNamespace(prctl=lambda *a: state["prctl"].append(a))
    monkeypatch.setattr(zygote.ctypes, "CDLL", lambda name, use_errno=False: libc)
    monkeypatch.setattr(zygote.os, "getppid", lambda: state["ppid"])

    def _exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(zygote.os, "_exit", _exit)
    monkeypatch.setattr(zygote, "apply_thread_env", lambda: state.__setitem__("threads", 1))

    def worker_main(argv):
        state["main"].append((argv, os.getcwd(), dict(os.environ), signal.getsignal(signal.SIGINT)))
        if state["raise"] is not None:
            raise state["raise"]
        return 7

    monkeypatch.setattr(process, "main", worker_main)
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ)
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in the zygote
    try:
        yield state
    finally:
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGINT, before)


def go_pipe(data: bytes) -> int:
    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    return r


def become(fork: Fork, owner: int, go: int) -> int | str | None:
    with pytest.raises(SystemExit) as e:
        zygote._become_worker(fork, owner, go)
    return e.value.code


def test_a_child_told_to_go_becomes_the_worker_in_its_own_directory_and_environment(
    child, tmp_path
):
    work = tmp_path / "w"
    work.mkdir()
    go = go_pipe(b"g")
    assert become(Fork("w", "/x/w.spec.json", {"ONLY": "this"}, str(work)), 500, go) == 7
    assert child["prctl"] == [(zygote.PR_SET_PDEATHSIG, signal.SIGKILL)]
    assert child["main"] == [
        (["/x/w.spec.json"], str(work), {"ONLY": "this"}, signal.default_int_handler)
    ]
    assert child["threads"] == 1
    with pytest.raises(OSError):
        os.close(go)  # closed before the worker ran


@pytest.mark.parametrize(("ppid", "said"), [(501, b"g"), (500, b""), (500, b"x")])
def test_a_child_of_a_gone_orchestrator_or_never_told_to_go_exits_3(child, ppid, said):
    child["ppid"] = ppid
    go = go_pipe(said)
    try:
        assert become(Fork("w", "/s", {"A": "1"}), 500, go) == 3
    finally:
        os.close(go)
    assert child["main"] == [] and child["prctl"] == [(1, signal.SIGKILL)]


def test_a_worker_main_that_raises_exits_1_with_its_traceback_and_its_own_exit_passes(
    child, capsys
):
    child["raise"] = RuntimeError("broken worker")
    assert become(Fork("w", "/s", {}), 500, go_pipe(b"g")) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: broken worker" in err
    child["raise"] = SystemExit(4)
    assert become(Fork("w", "/s", {}), 500, go_pipe(b"g")) == 4
    assert capsys.readouterr().err == ""


# -- the launcher's handle (Zygote) on a fake socket and process --------------------------


class Sock:
    """The launcher's end of the pair: ``replies`` are what ``recv`` gives in turn (a
    message, raw bytes, or an exception to raise); past them a timeout (blocking) or
    BlockingIOError (non-blocking). ``fail_send`` maps a send's index to its error."""

    def __init__(self, replies=(), fail_send=None) -> None:
        self.replies = list(replies)
        self.fail_send = dict(fail_send or {})
        self.sent: list = []
        self.timeouts: list[float] = []
        self.blocking = True
        self.closed = False

    def send(self, data: bytes) -> int:
        n = len(self.sent)
        self.sent.append(_decoder.decode(data))
        if n in self.fail_send:
            raise self.fail_send[n]
        return len(data)

    def recv(self, size: int) -> bytes:
        assert size == MAX_MESSAGE
        if not self.replies:
            raise TimeoutError("timed out") if self.blocking else BlockingIOError()
        r = self.replies.pop(0)
        if isinstance(r, BaseException):
            raise r
        return r if isinstance(r, bytes) else _encoder.encode(r)

    def settimeout(self, t: float) -> None:
        self.timeouts.append(t)

    def setblocking(self, flag: bool) -> None:
        self.blocking = flag

    def close(self) -> None:
        self.closed = True


class Proc:
    """The zygote's Popen: ``code`` is its exit status (None: running); ``hang`` waits
    time out before it is killed."""

    pid = 4321

    def __init__(self, code: int | None = None, hang: int = 0) -> None:
        self.code, self.hang = code, hang
        self.calls: list = []

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int | None:
        self.calls.append(("wait", timeout))
        if self.hang and self.code is None:
            self.hang -= 1
            raise subprocess.TimeoutExpired("zygote", timeout or 0)
        return self.code

    def kill(self) -> None:
        self.calls.append("kill")
        self.code = -9


def handle(replies=(), proc=None, preloaded=True, fail_send=None) -> tuple[Zygote, list[str]]:
    lines: list[str] = []
    z = Zygote(["m"], lines.append)
    z.sock = Sock(replies, fail_send)  # type: ignore[assignment]
    z.proc = proc  # type: ignore[assignment]
    if preloaded:
        z.preloaded = Preloaded(0.1, {}, {}, 1)
    return z, lines


def test_a_handle_without_a_process_is_not_started():
    z = Zygote([], print)
    assert (z.pid, z.alive(), z.exit_reason()) == (None, False, "not started")
    z.proc = Proc()  # type: ignore[assignment]
    assert (z.pid, z.alive(), z.exit_reason()) == (4321, True, "running")
    z.proc.code = -9  # type: ignore[union-attr]
    assert (z.alive(), z.exit_reason()) == (False, "killed by SIGKILL")
    z.proc.code = 0  # type: ignore[union-attr]
    assert (z.alive(), z.exit_reason()) == (False, "exited with code 0")


def test_follow_reports_each_import_and_is_done_at_the_preloaded_message(clock):
    done = Preloaded(2.0, {"a": 1.0, "b": 1.0}, {}, 1)
    z, lines = handle(
        [Importing("a"), Forked(3), Importing("b"), done, Importing("c")], None, False
    )
    clock.step = 0.1
    assert z.follow(5.0) is True
    assert lines == ["zygote: importing a", "zygote: importing b"]
    assert z.preloaded == done
    # each read waits what is left of the deadline
    assert z.sock.timeouts == pytest.approx([4.9, 4.8, 4.7, 4.6])  # type: ignore[union-attr]
    assert z.follow(0.0) is True and len(z.sock.replies) == 1  # type: ignore[union-attr]


def test_follow_that_runs_out_of_time_is_false_and_waits_no_more(clock):
    z, lines = handle([Importing("a")], None, False)
    clock.step = 1.0  # past its deadline at the first read: what is there is still read
    assert z.follow(0.5) is False
    assert z.sock.timeouts == [0.000001, 0.000001]  # type: ignore[union-attr]
    assert z.preloaded is None and lines == ["zygote: importing a"]
    z, _ = handle([], None, False)
    clock.step = 0.0
    assert z.follow(0.5) is False
    assert z.sock.timeouts == [0.5]  # type: ignore[union-attr]


@pytest.mark.parametrize(("timeout", "set"), [(-1.0, 0.000001), (0.0, 0.000001), (0.25, 0.25)])
def test_a_read_never_blocks_without_end_nor_waits_past_its_time(timeout, set):
    z, _ = handle()
    assert z._recv(timeout) is False
    assert z.sock.timeouts == [set]  # type: ignore[union-attr]


@pytest.mark.parametrize(("proc", "said"), [
    (Proc(code=3), "zygote (pid 4321) exited with code 3"),
    (Proc(hang=1), "zygote (pid 4321) running"),
    (None, "zygote (pid None) not started"),
])  # fmt: skip
def test_the_end_of_the_zygotes_stream_is_zygote_gone_with_its_exit(proc, said):
    z, _ = handle([b""], proc)
    with pytest.raises(ZygoteGone) as e:
        z._recv(1.0)
    assert str(e.value) == said
    if proc is not None:
        assert proc.calls == [("wait", 1)]


def test_a_broken_socket_is_zygote_gone_a_timeout_is_not():
    z, _ = handle([ConnectionResetError("reset by peer")])
    with pytest.raises(ZygoteGone, match=r"^zygote: reset by peer$"):
        z._recv(1.0)
    z, _ = handle([TimeoutError("timed out")])
    assert z._recv(1.0) is False


def test_a_fork_sends_the_request_and_go_with_the_childs_pid():
    fork = Fork("w#0", "/tmp/w.spec.json", {"A": "1"}, "/srv")
    z, _ = handle([Forked(77)])
    assert z.fork(fork) == 77
    assert z.sock.sent == [fork, Go(77)]  # type: ignore[union-attr]
    assert z.sock.timeouts == [2.0] and z.lost == []  # type: ignore[union-attr]
    z, _ = handle([Forked(78)])
    assert z.fork(fork, timeout_s=0.25) == 78
    assert z.sock.timeouts == [0.25]  # type: ignore[union-attr]


@pytest.mark.parametrize(("preloaded", "has_sock"), [(False, True), (True, False)])
def test_a_fork_needs_a_started_and_preloaded_zygote(preloaded, has_sock):
    z, _ = handle([Forked(1)], preloaded=preloaded)
    if not has_sock:
        z.sock = None
    with pytest.raises(AssertionError):
        z.fork(Fork("w", "/s", {}))


def test_a_refused_fork_says_why():
    z, _ = handle([Refused("the zygote has 3 threads")])
    with pytest.raises(ForkRefused, match=r"^the zygote has 3 threads$"):
        z.fork(Fork("w", "/s", {}))


@pytest.mark.parametrize(("reply", "timeout"), [([Importing("late")], 2.0), ([], 0.5)])
def test_a_fork_not_answered_is_zygote_gone(reply, timeout):
    z, _ = handle(reply)
    with pytest.raises(ZygoteGone) as e:
        z.fork(Fork("w", "/s", {}), timeout_s=timeout)
    assert str(e.value) == f"zygote did not answer a fork within {timeout:g} s"


def test_a_fork_request_too_large_to_send_spawns_that_worker_the_zygote_stays():
    big = OSError(errno.EMSGSIZE, "Message too long")
    z, _ = handle([Forked(1)], fail_send={0: big})
    with pytest.raises(ForkUnsent, match=r"too large \(\[Errno 90\] Message too long\)"):
        z.fork(Fork("w", "/s", {}))
    z, _ = handle([Forked(1)], fail_send={0: BrokenPipeError(errno.EPIPE, "Broken pipe")})
    with pytest.raises(ZygoteGone, match=r"^zygote: \[Errno 32\] Broken pipe$"):
        z.fork(Fork("w", "/s", {}))


def test_a_child_whose_go_cannot_be_sent_is_lost_for_the_caller_to_reap():
    z, _ = handle([Forked(55)], fail_send={1: BrokenPipeError(errno.EPIPE, "Broken pipe")})
    with pytest.raises(ZygoteGone, match="Broken pipe"):
        z.fork(Fork("w", "/s", {}))
    assert z.lost == [55]


def test_a_real_request_over_the_message_size_is_unsent(tmp_path):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        z = Zygote([], print)
        z.sock, z.preloaded = ours, Preloaded(0.0, {}, {}, 1)
        with pytest.raises(ForkUnsent):
            z.fork(Fork("w", "/s", {"BIG": "x" * (8 << 20)}))
    finally:
        ours.close()
        theirs.close()


def test_close_collects_the_children_forked_but_never_read_and_waits_for_the_zygote():
    proc = Proc(code=0)
    z, _ = handle([Forked(6), Importing("x"), Forked(7), b"\xc1not msgpack", Forked(8)], proc)
    z.lost = [5]
    sock = z.sock
    assert z.close() == [5, 6, 7]  # what cannot be decoded ends the reading
    assert sock.closed and not sock.blocking and z.sock is None  # type: ignore[union-attr]
    assert z.lost == [] and proc.calls == [("wait", 2)]
    z, _ = handle([Forked(6), b"", Forked(7)], Proc(code=0))
    assert z.close() == [6]  # the end of the stream ends it
    z, _ = handle([], Proc(code=0))
    assert z.close() == []  # nothing queued: BlockingIOError


@pytest.mark.parametrize(("proc", "kill", "calls"), [
    (Proc(), False, [("wait", 2)]),
    (Proc(), True, ["kill", ("wait", 2)]),
    (Proc(code=1), True, [("wait", 2)]),  # ended already: not killed
    (Proc(hang=1), False, [("wait", 2), "kill", ("wait", None)]),
])  # fmt: skip
def test_close_kills_a_zygote_asked_to_or_that_does_not_exit(proc, kill, calls):
    z, _ = handle([], proc)
    assert z.close(kill=kill) == []
    assert proc.calls == calls


def test_close_without_a_socket_or_process_returns_the_lost():
    z = Zygote([], print)
    z.lost = [9]
    assert z.close() == [9] and z.lost == []


def test_overdue_counts_from_the_start_and_only_while_preloading(clock):
    z, _ = handle([], None, False)
    z.started_at = 10.0
    clock.now = 15.0
    assert z.overdue(5.0) is False  # at the limit
    assert z.overdue(4.9) is True
    z.preloaded = Preloaded(0.1, {}, {}, 1)
    assert z.overdue(4.9) is False


class Popen:
    """``subprocess.Popen`` for :meth:`Zygote.start`: keeps a copy of the zygote's end."""

    made: list[Popen] = []

    def __init__(self, args, pass_fds, close_fds, env) -> None:
        self.args, self.pass_fds, self.close_fds, self.env = args, pass_fds, close_fds, env
        self.theirs = socket.socket(fileno=os.dup(pass_fds[0]))
        self.pid = 999
        Popen.made.append(self)


def test_start_runs_the_boot_line_with_the_zygotes_end_and_hands_it_the_modules(monkeypatch, clock):
    clock.now = 42.0
    Popen.made = []
    monkeypatch.setattr(zygote.subprocess, "Popen", Popen)
    z = Zygote(["json", "email"], print)
    z.preloaded = Preloaded(0.1, {}, {}, 1)  # an earlier zygote's
    z.start()
    (p,) = Popen.made
    try:
        fd = p.pass_fds[0]
        assert p.args == [sys.executable, "-c", ZYGOTE_BOOT, str(fd), str(os.getpid())]
        assert p.close_fds is True and p.env == inherited_env()
        with pytest.raises(OSError):
            os.fstat(fd)  # our copy of their end is closed
        assert (z.preloaded, z.started_at, z.pid) == (None, 42.0, 999)
        p.theirs.settimeout(5)
        assert zygote.recv(p.theirs) == Preload(["json", "email"])
    finally:
        p.theirs.close()
        z.sock.close()  # type: ignore[union-attr]


def test_a_start_that_cannot_run_the_process_leaves_no_socket(monkeypatch):
    def fail(*a, **kw):
        raise OSError(errno.ENOENT, "no python")

    monkeypatch.setattr(zygote.subprocess, "Popen", fail)
    before = len(os.listdir("/proc/self/fd"))
    z = Zygote([], print)
    with pytest.raises(OSError, match="no python"):
        z.start()
    assert z.sock is None and z.proc is None
    assert len(os.listdir("/proc/self/fd")) == before  # both ends closed


def test_the_wire_rejects_what_is_not_a_message():
    with pytest.raises(msgspec.DecodeError):
        _decoder.decode(_encoder.encode({"type": "Nope"}))


# -- one real zygote -----------------------------------------------------------------------


def test_a_real_zygote_preloads_and_forks_a_worker_that_is_this_processs_child(tmp_path, capfd):
    """The boot line, ``main``, the preload and a real ``clone(CLONE_PARENT)``: the worker
    runs in its ``cwd`` (its spec, relative, is found there and is not a spec: exit 1)."""
    (tmp_path / "w.spec.json").write_text("not a spec")
    lines: list[str] = []
    z = Zygote(["json", "omni_nope_zz"], lines.append)
    z.start()
    try:
        assert z.follow(30) is True
        assert lines == ["zygote: importing json", "zygote: importing omni_nope_zz"]
        assert z.preloaded is not None and z.preloaded.threads == 1
        assert list(z.preloaded.failed) == ["omni_nope_zz"]
        pid = z.fork(Fork("w", "w.spec.json", {"PATH": os.environ["PATH"]}, str(tmp_path)), 30)
        _, status = os.waitpid(pid, 0)  # ours (CLONE_PARENT), not the zygote's
        assert os.waitstatus_to_exitcode(status) == 1
    finally:
        assert z.close() == []
    assert z.proc is not None and z.proc.returncode == 0  # its socket closed: it ended
    err = capfd.readouterr().err
    assert "DecodeError" in err and "FileNotFoundError" not in err
