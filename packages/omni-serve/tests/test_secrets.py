"""Secrets and internals: the API key from a file or ``OMNI_API_KEY`` (never in ``ps``,
never in a worker's environment, spawned or forked from the zygote); ``/health`` says
only its status without the key; a stage's text reaches a client only from a
``UserInputError``; the page gets a CSP and frame headers, and keeps the key in
sessionStorage."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from omni_testing.configs import chain

from .conftest import OMNI, start_server, stop_server

KEY = "k3y-from-the-file"
OTHER = "k3y-from-the-environment"


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (the zygote, the workers)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A server with its key in a file while ``OMNI_API_KEY`` holds another: the file
    wins, and neither reaches a worker. ``map`` is spawned (its extra_env sets a variable
    read at import), ``source`` forked from the zygote (where the machine allows)."""
    where = tmp_path_factory.mktemp("keyed")
    key_file = where / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    cfg = chain(
        ("source", "synthetic.source", {"tokens": 4}),
        ("map", "synthetic.map", {}, {"extra_env": {"PYTHONOMNISPAWNED": "1"}}),
        name="keyed",
        heartbeat_interval_s=0.1,
    )
    os.environ["OMNI_API_KEY"] = OTHER
    try:
        s = start_server(cfg, where, "--api-key-file", str(key_file))
    finally:
        del os.environ["OMNI_API_KEY"]
    yield s
    stop_server(s)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_key_file_wins_and_the_key_is_not_on_the_command_line(keyed):
    for key, status in ((KEY, 200), (OTHER, 401)):
        r = httpx.get(f"{keyed.url}/v1/models", headers=auth(key), timeout=10)
        assert r.status_code == status, r.text
    cmdline = Path(f"/proc/{keyed.proc.pid}/cmdline").read_bytes()
    assert KEY.encode() not in cmdline


def test_no_worker_nor_the_zygote_has_the_key(keyed):
    log = keyed.log()
    starts = dict(re.findall(r"(\w+): (forked|spawned) \(pid \d+\)", log))
    assert starts.get("map") == "spawned", log
    pids = descendants(keyed.proc.pid)
    workers = {s["pid"] for s in keyed_health(keyed)["stages"].values()}
    assert workers <= set(pids), (workers, pids)
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert b"OMNI_API_KEY" not in environ, pid
        assert KEY.encode() not in environ and OTHER.encode() not in environ, pid
    if "forked" not in starts.values():
        pytest.skip(f"no worker was forked from the zygote here (only spawned): {starts}")


def keyed_health(server) -> dict:
    r = httpx.get(f"{server.url}/health", headers=auth(), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_health_without_the_key_says_only_its_status(keyed):
    r = keyed.health()
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    wrong = httpx.get(f"{keyed.url}/health", headers=auth(OTHER), timeout=10)
    assert wrong.json() == {"status": "ok"}
    body = keyed_health(keyed)
    assert body["status"] == "ok"
    assert {s["pid"] for s in body["stages"].values()} and "stages_summary" in body


def test_a_key_file_that_cannot_be_read_is_a_startup_error(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("name: p\nstages: [{name: s, kind: synthetic.source}]\n")
    missing = tmp_path / "no-such-key"
    r = subprocess.run(
        [sys.executable, "-c", OMNI, "serve", str(cfg), "--api-key-file", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--api-key-file" in r.stderr and str(missing) in r.stderr
    assert "Traceback" not in r.stderr


def test_the_page_has_a_csp_and_frame_headers_and_no_local_storage(keyed):
    r = httpx.get(f"{keyed.url}/", timeout=10)
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert "connect-src 'self'" in csp and "'unsafe-inline'" not in csp
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
    # the page's own script and style run: their hashes are the policy's
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        (block,) = re.findall(rf"<{tag}>(.*?)</{tag}>", r.text, flags=re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}'" in csp
    assert "localStorage." not in r.text and "sessionStorage.getItem" in r.text


def test_only_a_user_input_error_reaches_the_client(boom_server):
    url = f"{boom_server.url}/v1/completions"
    r = httpx.post(url, json={"prompt": "hello " * 200}, timeout=30)  # over 64 tokens
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "max_prompt_tokens=64" in err["message"]
    r = httpx.post(url, json={"prompt": "hello"}, timeout=30)
    assert r.status_code == 500, r.text
    rid = r.headers["x-request-id"]
    assert r.json()["error"]["message"] == f"stage 'boom' failed; request id {rid}"
    assert "expect" not in r.text and "KeyError" not in r.text


def test_a_chat_templates_own_refusal_is_shown_other_failures_are_not():
    jinja2 = pytest.importorskip("jinja2")
    from omni_ar.params import template_error
    from omni_core.errors import UserInputError

    said = template_error(jinja2.TemplateError("Conversation roles must alternate"))
    assert isinstance(said, UserInputError) and "roles must alternate" in str(said)
    hidden = template_error(jinja2.UndefinedError("'secret_variable' is undefined"))
    assert isinstance(hidden, UserInputError) and "secret_variable" not in str(hidden)
    assert str(hidden).startswith("field 'messages': ")
    assert "secret" not in str(template_error(KeyError("secret_path")))


def test_the_key_is_not_in_the_settings_repr():
    from omni_serve import ServeSettings

    settings = ServeSettings(model_name="m", api_key=KEY)
    assert KEY not in repr(settings) and KEY not in str(settings)
    assert settings.api_key == KEY


@pytest.mark.parametrize(
    ("mode", "warned"), [(0o600, False), (0o400, False), (0o640, True), (0o604, True)]
)
def test_a_key_file_others_may_read_is_warned_about(tmp_path, monkeypatch, caplog, mode, warned):
    import logging

    from omni_serve.cli import api_key_of, parser

    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(mode)
    monkeypatch.delenv("OMNI_API_KEY", raising=False)
    args = parser().parse_args(["x.yaml", "--api-key-file", str(key_file)])
    with caplog.at_level(logging.WARNING, logger="omni.serve"):
        assert api_key_of(args) == KEY
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if warned:
        assert len(said) == 1 and str(key_file) in said[0] and f"{mode:o}" in said[0], said
        assert "chmod 600" in said[0] and KEY not in said[0]
    else:
        assert not said, said
