"""``OMNI_API_KEY`` leaves the server's environment block, not just ``os.environ``: the
server executes itself again without it (the key in an inherited memfd), so
``/proc/PID/environ`` of the server, the zygote and every worker holds neither the
variable nor the key, while the key still guards the API."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from omni_serve import cli
from omni_serve.settings import SettingsError
from omni_testing.configs import chain

from .conftest import start_server, stop_server

KEY = "k3y-0nly-in-the-environment"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``source`` forked from the zygote (where the machine allows), ``map`` spawned."""
    cfg = chain(
        ("source", "synthetic.source", {"tokens": 4}),
        ("map", "synthetic.map", {}, {"extra_env": {"PYTHONOMNISPAWNED": "1"}}),
        name="keyenv",
    )
    os.environ["OMNI_API_KEY"] = KEY
    try:
        s = start_server(cfg, tmp_path_factory.mktemp("keyenv"))
    finally:
        del os.environ["OMNI_API_KEY"]
    yield s
    stop_server(s)


def test_the_key_from_the_environment_guards_the_api(server):
    for headers, status in (({"Authorization": f"Bearer {KEY}"}, 200), ({}, 401)):
        r = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10)
        assert r.status_code == status, r.text


def test_no_environment_block_holds_the_key(server):
    me = psutil.Process(server.proc.pid)
    procs = [me, *me.children(recursive=True)]
    assert len(procs) >= 3, procs  # the server, its workers (and the zygote)
    for p in procs:
        environ = Path(f"/proc/{p.pid}/environ").read_bytes()
        assert KEY.encode() not in environ and b"OMNI_API_KEY" not in environ, p
        # nor an open descriptor: the memfd is closed once read
        for fd in Path(f"/proc/{p.pid}/fd").iterdir():
            try:
                assert cli.KEY_MEMFD not in os.readlink(fd), (p, fd)
            except FileNotFoundError:
                pass
    assert me.cmdline()[-1] != KEY and KEY not in " ".join(me.cmdline())


def test_called_in_process_it_never_executes_again(monkeypatch):
    monkeypatch.setenv("OMNI_API_KEY", KEY)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("executed again"))
    cli.reexec_without_key(["x.yaml"])  # sys.argv is pytest's, not omni serve x.yaml
    assert cli.key_from_environment() == KEY and "OMNI_API_KEY" not in os.environ


def test_the_key_travels_in_a_memfd_across_the_execution(monkeypatch):
    """What the re-executed process finds: the key in the memfd, read once and closed."""
    monkeypatch.setenv("OMNI_API_KEY", KEY)
    monkeypatch.setattr(sys, "argv", ["omni", "serve", "x.yaml"])
    seen: dict[str, object] = {}

    def execve(path: str, argv: list[str], env: dict[bytes, bytes]) -> None:
        seen.update(path=path, argv=argv, env=env)

    monkeypatch.setattr(os, "execve", execve)
    cli.reexec_without_key(["x.yaml"])
    env = seen["env"]
    assert seen["path"] == sys.executable and seen["argv"] == sys.orig_argv
    assert b"OMNI_API_KEY" not in env and KEY.encode() not in b"".join(env.values())
    monkeypatch.delenv("OMNI_API_KEY")
    monkeypatch.setenv(cli.KEY_FD_ENV, env[cli.KEY_FD_ENV.encode()].decode())
    fd = int(os.environ[cli.KEY_FD_ENV])
    assert os.get_inheritable(fd)
    assert cli.key_from_environment() == KEY
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    assert cli.KEY_FD_ENV not in os.environ


@pytest.mark.parametrize("number", ["x", "0", "999"])
def test_a_key_fd_that_is_not_the_key_s_memfd_is_a_settings_error(monkeypatch, number):
    monkeypatch.setenv(cli.KEY_FD_ENV, number)
    with pytest.raises(SettingsError, match=cli.KEY_FD_ENV):
        cli.key_from_environment()
    if number == "0":
        os.fstat(0)  # not closed: it is not the key's
