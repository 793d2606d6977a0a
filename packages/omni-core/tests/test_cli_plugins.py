"""Subcommands from the ``omni.commands`` entry-point group."""

from omni_core import cli
from omni_core.registry import Registry


def test_a_known_plugin_command_that_is_not_installed_names_its_package(monkeypatch, capsys):
    monkeypatch.setattr(cli, "command_registry", lambda: Registry("omni.commands.none", "command"))
    assert cli.main(["serve", "configs/demo.yaml", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "omni-serve" in err and "pip install omni-serve" in err


def test_omni_run_with_a_stage_that_fails_to_load_says_which_and_why(tmp_path, capsys):
    """Exit 1 with one line naming the stage and its error, not the caller's traceback."""
    path = tmp_path / "p.yaml"
    path.write_text(
        "ready_timeout_s: 60\n"
        "stages:\n"
        "  - {name: bad, kind: synthetic.faulty, options: {fail_on_load: true}}\n"
    )
    assert cli.main(["run", str(path), "--input", "{}"]) == 1
    err = capsys.readouterr().err
    assert "omni run: stage 'bad'" in err and "synthetic load failure" in err
    assert "Traceback" not in err


def test_omni_run_ends_with_a_per_stage_summary(capsys):
    """What each stage emitted, how long its work waited in its queue and how long it
    waited on its downstream (the workers' counters), and what the caller saw of it:
    events, tokens, when."""
    assert cli.main(["run", "configs/demo.yaml", "--set", "n=8"]) == 0
    err = capsys.readouterr().err
    header, *rows = err[err.index("stage ") :].strip().splitlines()
    assert header.split() == [
        "stage", "emitted", "to", "you", "tokens", "steps", "first", "last", "queued",
        "blocked", "errors",
    ]  # fmt: skip
    table = {r.split()[0]: r.split() for r in rows}
    assert list(table) == ["source", "double", "shift", "join"]  # the config's order
    assert int(table["source"][1]) == 9 and int(table["join"][1]) == 3  # emitted
    assert table["join"][3] == "8" and table["join"][5].endswith("s")  # tokens, first
    assert table["double"][2] == "0" and table["double"][5] == "-"  # nothing to the caller
    for row in table.values():  # queued and blocked: the workers' measured seconds
        queued, blocked = float(row[7].rstrip("s")), float(row[8].rstrip("s"))
        assert 0.0 <= queued < 30.0 and 0.0 <= blocked < 30.0
