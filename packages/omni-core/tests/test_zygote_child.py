"""The zygote's ``main`` and the forked child's way into the worker
(``_become_worker``), without a pipeline: the process calls (``prctl``, ``getppid``,
``_exit``, the worker's own ``main``) faked, the cwd, environment and SIGINT handler put
back after each test."""

from __future__ import annotations

import os
import signal
import socket
import types

import pytest
from omni_core.control import zygote
from omni_core.control.zygote import Fork

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
