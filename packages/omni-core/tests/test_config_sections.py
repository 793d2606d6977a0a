"""How the core hands a family's ``mrs.<name>`` section of a config to the family that
registered it (``omni.config_sections``): the section's rewrite and its errors, named as
written; a section no installed family adds is an error that says so. The sections here
are fakes standing in for a family's (the AR family's ``mrs.ar`` is tested with it)."""

from __future__ import annotations

from typing import Any

import pytest
from omni_core import config
from omni_core.config import ConfigError, parse_config
from omni_core.plugin import OptionNames, Spelling, SpellingError


def doc(**section: Any) -> dict[str, Any]:
    return {
        "mrs": {"demo": section, "defaults": {"max_inflight": 1}},
        "stages": [
            {"name": "a", "kind": "synthetic.source", "options": {"tokens": 3}},
            {"name": "b", "kind": "synthetic.map"},
        ],
        "edges": [{"from": "a", "to": "b"}],
    }


def demo(value: Any, spelling: Spelling, option_names: OptionNames) -> None:
    """A family's section: ``scale`` becomes every synthetic.map stage's option."""
    if set(value) - {"scale"}:
        bad = sorted(set(value) - {"scale"})[0]
        raise SpellingError(f"mrs.demo.{bad}", "unknown key; mrs.demo takes scale")
    stages = spelling.data["stages"] = list(spelling.data["stages"])
    for i, s in enumerate(stages):
        takes = option_names(s["kind"])
        if "scale" in value and (takes is None or "scale" in takes):
            stages[i] = {**s, "options": {**s.get("options", {}), "scale": value["scale"]}}
            spelling.origins[f"stages[{i}].options.scale"] = "mrs.demo.scale"


@pytest.fixture
def sections(monkeypatch):
    installed = {"demo": demo}
    monkeypatch.setattr(config, "_section", installed.get)
    return installed


def test_a_section_is_rewritten_by_its_family(sections):
    cfg = parse_config(doc(scale=3))
    assert cfg.stages[1].options == {"scale": 3}
    assert cfg.stages[0].options == {"tokens": 3}  # a kind without the option: unchanged
    assert cfg.mrs.defaults.max_inflight == 1  # the core's own keys are still read


def test_an_error_after_the_rewrite_names_the_key_as_written(sections):
    with pytest.raises(ConfigError, match=r"mrs\.demo\.scale: Expected `int`"):
        parse_config(doc(scale="big"))


def test_the_sections_own_error_names_its_key(sections):
    with pytest.raises(ConfigError, match=r"mrs\.demo\.bogus: unknown key; mrs\.demo takes scale"):
        parse_config(doc(bogus=1))


def test_unchecked_kinds_hand_the_section_none(sections):
    seen: list[Any] = []
    sections["demo"] = lambda value, spelling, option_names: seen.append(option_names("x.y"))
    parse_config(doc(scale=1), check_kinds=False)
    assert seen == [None]


def test_a_section_no_installed_family_adds_says_so(monkeypatch):
    monkeypatch.setattr(config, "_section", lambda name: None)
    with pytest.raises(ConfigError) as e:
        parse_config(doc(scale=3))
    msg = str(e.value)
    assert "mrs.demo: unknown key; mrs takes enabled, defaults" in msg
    assert "needs that family installed" in msg
