"""The launcher's handle on its zygote (:class:`Zygote`) at its edges: its reads,
forks, close and start on a fake socket, process and clock, and one real zygote that
preloads and forks a worker (a second)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

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
)

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
