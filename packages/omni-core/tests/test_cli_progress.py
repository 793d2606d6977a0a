"""``omni run`` shows long work as it happens: a bar per request while it samples (plain
lines when stderr is not a terminal), never garbling the text it streams; and its
summary says how long each stage's work waited in its queue."""

from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from omni_core import cli
from omni_core.cli import RunView
from omni_core.observability.progress import Bar, Reporter

pytest.importorskip("omni_testing")  # the synthetic stages


def _write(tmp_path, cfg: dict) -> str:
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


PREVIEWS = {
    "name": "previews",
    "heartbeat_interval_s": 0.2,
    "stages": [
        {
            "name": "gen",
            "kind": "synthetic.previews",
            "options": {"steps": 12, "step_s": 0.02, "size": 4},
        }
    ],
    "edges": [],
}


def _summary(err: str) -> dict[str, list[str]]:
    header, *rows = err[err.index("stage ") :].strip().splitlines()
    assert header.split()[-3:] == ["queued", "blocked", "errors"]
    return {r.split()[0]: r.split() for r in rows}


def test_sampling_progress_is_plain_lines_off_a_terminal(tmp_path, capsys):
    assert cli.main(["run", _write(tmp_path, PREVIEWS)]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in err and "\033[" not in err  # no terminal controls in a log
    lines = [ln for ln in err.splitlines() if re.match(r"[0-9a-f]{8} gen ", ln)]
    assert lines, err
    assert re.search(r" 1 steps  \d+\.\ds", lines[0])  # the first step, as it happens
    assert re.search(r" 12/12 steps \(100%\)  \d+\.\ds", lines[-1])  # the end, a line
    assert out.count("[gen] image") == 13  # the events themselves, on stdout as before
    gen = _summary(err)["gen"]
    assert gen[4] == "12" and float(gen[7].rstrip("s")) >= 0.0  # steps, queued


def test_summary_shows_how_long_work_waited_in_each_queue(tmp_path, capsys):
    """A slow map behind a fast source: its windows pile up in its queue."""
    cfg = {
        "name": "queueing",
        "heartbeat_interval_s": 0.2,
        "stages": [
            {
                "name": "source",
                "kind": "synthetic.source",
                "options": {"tokens": 16, "segment": 2, "delay_s": 0.0},
            },
            {
                "name": "slow",
                "kind": "synthetic.map",
                "client_stream": True,
                "options": {"delay_s": 0.1},
            },
        ],
        "edges": [{"from": "source", "to": "slow", "window": {"size": 2}}],
    }
    assert cli.main(["run", _write(tmp_path, cfg)]) == 0
    table = _summary(capsys.readouterr().err)
    slow_queued = float(table["slow"][7].rstrip("s"))
    # 8 windows, 0.1 s each, all queued at once: they waited about 0.1 * (0+1+...+7)
    assert 0.8 < slow_queued < 20.0, table["slow"]
    assert float(table["source"][7].rstrip("s")) < 1.0  # the submit is taken at once


def _event(kind: str, step: int | None = None, last: bool = False, text: str | None = None):
    return SimpleNamespace(
        stage="gen" if kind == "image" else "post",
        event_type=kind,
        sequence=0,
        request_id="abcdef0123",
        payload={"text": text} if text is not None else {"steps": 4},
        step=step,
        is_last=last,
        terminal=kind in ("completed", "error"),
        arrays={},
    )


def _screen(raw: str) -> list[str]:
    """The lines a terminal keeps of ``raw`` (``\\r\\033[K`` erases the current line)."""
    lines, current = [], ""
    for part in re.split(r"(\r\033\[K|\n)", raw):
        if part == "\r\033[K":
            current = ""
        elif part == "\n":
            lines.append(current)
            current = ""
        else:
            current += part
    return [*lines, current]


def test_the_bar_never_garbles_streamed_text_on_one_screen():
    screen = io.StringIO()  # stdout and stderr on one terminal
    view = RunView(out=screen, err=screen, tty=True)
    view.text(_event("segment", text="a red"), "a red")
    view.event(_event("image", 1), [])
    view.text(_event("segment", text=" square"), " square")  # text between two steps
    view.text(_event("segment", text=" on green"), " on green")
    view.event(_event("image", 2), [])
    view.event(_event("image", 4, last=True), [])
    view.event(_event("completed"), [])
    view.end()
    kept = _screen(screen.getvalue())
    assert "a red" in kept and " square on green" in kept  # the text, whole
    (final,) = [ln for ln in kept if ln.startswith("abcdef01 gen |")]
    assert "4/4 steps" in final and "#" * 24 in final  # the bar's last state stays
    assert "\r\033[K" in screen.getvalue()  # it was drawn in place


def test_bar_lines_and_terminal_rendering():
    now = [0.0]
    plain = io.StringIO()
    bar = Bar("convert", 100, unit="tensors", stream=plain, tty=False, clock=lambda: now[0])
    for i in range(1, 101):
        now[0] += 0.01
        bar.update(i)
    bar.close()
    lines = plain.getvalue().splitlines()
    # the first, one per quarter crossed (25, 50, 75), and the end
    assert [ln.split()[1] for ln in lines] == ["1/100", "25/100", "50/100", "75/100", "100/100"]
    assert lines[-1].startswith("convert 100/100 tensors (100%)  1.0s  100.0 tensors/s")

    term = io.StringIO()
    bar = Bar("convert", 4, stream=term, tty=True, refresh_s=0.0, clock=lambda: now[0])
    for item in bar.iterate(["a", "b", "c", "d"]):
        assert item
    raw = term.getvalue()
    assert raw.count("\r\033[K") >= 4 and raw.endswith("\n")
    assert _screen(raw)[-2].startswith("convert |" + "#" * 24 + "| 4/4 steps")


def test_reporter_prints_timed_steps(capsys):
    now = [10.0]
    report = Reporter("tiny", tty=False, clock=lambda: now[0])
    now[0] += 1.5
    report("building it")
    assert capsys.readouterr().out == "[   1.5s] tiny: building it\n"
    bar = report.bar("tensors", 2, unit="tensors")
    for _ in bar.iterate([1, 2]):
        pass
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[   1.5s] tiny: tensors 1/2 tensors (50%)")
    assert out[-1].startswith("[   1.5s] tiny: tensors 2/2 tensors (100%)")


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_run_on_a_terminal_draws_the_bar_in_place(tmp_path):
    """stdout and stderr on a pseudo-terminal, as a user at a shell has them."""
    config = _write(tmp_path, PREVIEWS)
    primary, secondary = os.openpty()
    code = "import sys; from omni_core.cli import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "run", config],
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
        close_fds=True,
    )
    os.close(secondary)
    raw = b""
    while True:
        ready, _, _ = select.select([primary], [], [], 60)
        if not ready:
            proc.kill()
            pytest.fail(f"omni run on a terminal hung; so far: {raw[-2000:]!r}")
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the other side closed
            break
        if not chunk:
            break
        raw += chunk
    os.close(primary)
    assert proc.wait(timeout=60) == 0, raw[-4000:]
    text = raw.decode(errors="replace").replace("\r\n", "\n")  # the terminal's newlines
    assert "\r\033[K" in text and "Traceback" not in text
    kept = _screen(text)
    (final,) = [ln for ln in kept if re.match(r"[0-9a-f]{8} gen \|", ln)]
    assert "#" * 24 in final and "12/12 steps" in final
    assert any(ln.startswith("stage ") and "queued" in ln for ln in kept)
