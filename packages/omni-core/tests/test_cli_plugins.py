"""Subcommands from the ``omni.commands`` entry-point group."""

from omni_core import cli
from omni_core.registry import Registry


def test_a_known_plugin_command_that_is_not_installed_names_its_package(monkeypatch, capsys):
    monkeypatch.setattr(cli, "command_registry", lambda: Registry("omni.commands.none", "command"))
    assert cli.main(["serve", "configs/demo.yaml", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "omni-serve" in err and "pip install omni-serve" in err
