"""The MRS design doc's spelling of a config (omni_core.config_spelling): the doc's example
loads, means its canonical spelling and runs; ``omni config normalize`` round-trips; every
key omni does not support, and every setting written in both spellings, is an error that
names the keys as written. The example's ``mrs.ar`` section is the AR family's
(``omni_ar.config_section``, registered under ``omni.config_sections``), so this is a
test of the core with that family; how the core hands a section to its family is
``packages/omni-core/tests/test_config_sections.py``'s."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from omni_core import Pipeline
from omni_core.cli import main
from omni_core.config import ConfigError, PipelineConfig, load_config, normalized_yaml, parse_config
from omni_core.scheduling import uses_priority

DESIGN_DOC = Path(__file__).parent / "fixtures" / "design_doc.yaml"

# the fixture as omni spells it
CANONICAL: dict[str, Any] = {
    "mrs": {"enabled": True, "defaults": {"window": {"size": -1}, "max_inflight": 1}},
    "stages": [
        {
            "name": "source",
            "kind": "synthetic.source",
            "options": {"tokens": 12, "segment": 4},
            "devices": "0",
            "extra_env": {},
        },
        {
            "name": "double",
            "kind": "synthetic.map",
            "options": {"scale": 2},
            "devices": "1,2",
            "extra_env": {},
        },
    ],
    "edges": [{"from": "source", "to": "double", "window": {"size": -1}}],
}


def meaning(cfg: PipelineConfig) -> dict[str, Any]:
    out = msgspec.to_builtins(cfg)
    out.pop("source_file")
    return out


def doc() -> dict[str, Any]:
    return yaml.safe_load(DESIGN_DOC.read_text())


def error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data, "doc.yaml")
    return str(e.value)


def test_design_doc_example_means_its_canonical_spelling() -> None:
    assert meaning(load_config(DESIGN_DOC)) == meaning(parse_config(CANONICAL))


def test_design_doc_example_runs_on_synthetic_stages() -> None:
    with Pipeline(DESIGN_DOC) as pipe:
        [out] = pipe.generate([{"n": 12}], timeout_s=60)
    assert out.ok, out.error
    assert [t for e in out.by_stage("double") for t in e.tokens] == [2 * t for t in range(12)]


def test_normalize_prints_the_canonical_spelling_and_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "normalize", str(DESIGN_DOC)]) == 0
    printed = capsys.readouterr().out
    assert printed == normalized_yaml(DESIGN_DOC)
    assert yaml.safe_load(printed) == CANONICAL
    again = tmp_path / "canonical.yaml"
    again.write_text(printed)
    assert normalized_yaml(again) == printed


def test_normalize_of_an_invalid_config_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    data = doc()
    data["mrs"]["stages"][0]["process"] = False
    bad.write_text(yaml.safe_dump(data))
    assert main(["config", "normalize", str(bad)]) == 2
    assert "mrs.stages[0].process" in capsys.readouterr().err


def test_mrs_stages_entry_with_a_kind_adds_a_stage() -> None:
    data = doc()
    data["mrs"]["stages"].append({"name": "more", "kind": "synthetic.map", "process": True})
    data["mrs"]["edges"].append({"from": "double", "to": "more"})
    cfg = parse_config(data)
    assert [s.name for s in cfg.stages] == ["source", "double", "more"]
    assert cfg.stage("more").kind == "synthetic.map"
    assert cfg.window(cfg.edges[1]).size == -1


def test_mrs_ar_sets_the_defaults_of_ar_stages_and_their_edges() -> None:
    pytest.importorskip("omni_ar")
    data = {
        "mrs": {
            "ar": {"default_window_size": 4, "max_segment_tokens": 2, "min_flush_interval_ms": 10}
        },
        "stages": [
            {"name": "generate", "kind": "ar.generate", "options": {"model": "m"}},
            {
                "name": "decode",
                "kind": "ar.decode",
                "options": {"model": "m", "max_segment_tokens": 16},
            },
            {"name": "post", "kind": "ar.postprocess", "options": {"model": "m"}},
            {"name": "map", "kind": "synthetic.map"},
        ],
        "edges": [
            {"from": "generate", "to": "post"},
            {"from": "decode", "to": "map", "window": {"size": 1}},
            {"from": "post", "to": "map", "window": {"overlap": 0}},
        ],
    }
    written = copy.deepcopy(data)
    cfg = parse_config(data)
    assert data == written  # the caller's data is left as it was
    generate, decode, post, _ = cfg.stages
    assert generate.options == {"model": "m", "max_segment_tokens": 2, "min_flush_interval_ms": 10}
    assert decode.options == {"model": "m", "max_segment_tokens": 16, "min_flush_interval_ms": 10}
    assert post.options == {"model": "m"}  # ar.postprocess has no such options
    assert [cfg.window(e).size for e in cfg.edges] == [4, 1, 4]
    bad = copy.deepcopy(data)
    bad["mrs"]["ar"]["max_segment_tokens"] = "many"
    assert "doc.yaml: mrs.ar.max_segment_tokens: Expected `int`" in error(bad)


def test_mrs_ar_scheduler_policy_fcfs_is_todays_behaviour() -> None:
    data = doc()
    del data["mrs"]["ar"]["scheduler_policy"]
    assert meaning(parse_config(data)) == meaning(load_config(DESIGN_DOC))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_mrs_ar_scheduler_policy_is_every_ar_stages_unless_it_sets_its_own(policy) -> None:
    data = {
        "mrs": {"ar": {"scheduler_policy": policy}},
        "stages": [
            {"name": "generate", "kind": "ar.generate", "options": {"model": "m"}},
            {"name": "own", "kind": "ar.postprocess", "scheduler_policy": "fcfs"},
            {"name": "map", "kind": "synthetic.map"},
        ],
        "edges": [{"from": "generate", "to": "own"}, {"from": "own", "to": "map"}],
    }
    cfg = parse_config(data, check_kinds=False)
    policies = [cfg.setting(s, "scheduler_policy") for s in cfg.stages]
    assert policies == [policy, "fcfs", "fcfs"]
    assert uses_priority(cfg) == (policy == "priority")


def with_change(change: Any) -> dict[str, Any]:
    data = doc()
    change(data)
    return data


def _set(path: str, value: Any) -> Any:
    """A change setting the dotted ``path`` (list indexes as numbers) to ``value``."""

    def change(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value

    return change


UNSUPPORTED = {
    "process false": (
        _set("mrs.stages.0.process", False),
        "doc.yaml: mrs.stages[0].process: a stage outside a worker process of its own is not "
        "supported: remove `process: false`",
        "write `mrs.enabled: false`",
    ),
    "process not a bool": (
        _set("mrs.stages.0.process", "yes"),
        "doc.yaml: mrs.stages[0].process: expected true, got 'yes'",
        "",
    ),
    "another policy": (
        _set("mrs.ar.scheduler_policy", "lifo"),
        "doc.yaml: mrs.ar.scheduler_policy: expected one of fcfs, priority, got 'lifo'",
        "",
    ),
    "unknown mrs.ar key": (
        _set("mrs.ar.prefill_chunk", 512),
        "doc.yaml: mrs.ar.prefill_chunk: unknown key; mrs.ar takes default_window_size, "
        "max_segment_tokens, min_flush_interval_ms, scheduler_policy",
        "its own `options`",
    ),
    "unknown mrs.stages key": (
        _set("mrs.stages.1.pinned_memory", True),
        "doc.yaml: mrs.stages[1].pinned_memory: unknown key",
        "",
    ),
    "undefined stage": (
        _set("mrs.stages.1.name", "talker"),
        "doc.yaml: mrs.stages[1]: stage 'talker' is not defined (no stage of `stages` has "
        "that name)",
        "add `kind: KIND` to this entry",
    ),
    "no stages at all": (
        lambda data: data.pop("stages"),
        "doc.yaml: mrs.stages[0]: stage 'source' is not defined (the config has no `stages`)",
        "define the stage under `stages` (`- {name: source, kind: KIND}`)",
    ),
    "a stage twice": (
        lambda data: data["mrs"]["stages"].append({"name": "source", "devices": "1"}),
        "doc.yaml: mrs.stages[2]: 'source' again (first at mrs.stages[0])",
        "",
    ),
    "bad window size": (
        _set("mrs.defaults.window_size", 0),
        "doc.yaml: mrs.defaults.window_size: expected -1 (whole stream) or an integer >= 1",
        "",
    ),
    "edge to nowhere": (
        _set("mrs.edges.0.to", "vae"),
        "doc.yaml: mrs.edges[0].to: unknown stage 'vae'",
        "",
    ),
    "stages not a list": (
        _set("mrs.stages", {"source": {}}),
        "doc.yaml: mrs.stages: expected a list, got dict",
        "",
    ),
}


@pytest.mark.parametrize("case", UNSUPPORTED, ids=list(UNSUPPORTED))
def test_unsupported_settings_say_what_to_write(case: str) -> None:
    change, message, advice = UNSUPPORTED[case]
    text = error(with_change(change))
    assert text.startswith(message), text
    assert advice in text


CONFLICTS = {
    "defaults window": (
        _set("mrs.defaults.window", {"size": 4}),
        "mrs.defaults.window_size",
        "mrs.defaults.window.size",
    ),
    "edge window": (
        _set("mrs.edges.0.window", {"size": 4}),
        "mrs.edges[0].window_size",
        "mrs.edges[0].window.size",
    ),
    "top-level edge window": (
        lambda data: data.update(
            edges=[{"from": "source", "to": "double", "window_size": 2, "window": {"size": 2}}]
        ),
        "edges[0].window_size",
        "edges[0].window.size",
    ),
    "edge in both lists": (
        lambda data: data.update(edges=[{"from": "source", "to": "double", "window": {"size": 2}}]),
        "mrs.edges[0].window_size",
        "edges[0].window",
    ),
    "stage devices": (
        _set("stages.1.devices", "3"),
        "mrs.stages[1].devices",
        "stages[1].devices",
    ),
    "stage extra_env": (
        _set("stages.0.extra_env", {"A": "1"}),
        "mrs.stages[0].extra_env",
        "stages[0].extra_env",
    ),
}


@pytest.mark.parametrize("case", CONFLICTS, ids=list(CONFLICTS))
def test_a_setting_in_both_spellings_names_both(case: str) -> None:
    change, doc_key, omni_key = CONFLICTS[case]
    text = error(with_change(change))
    assert text.startswith(f"doc.yaml: {doc_key}: "), text
    assert omni_key in text and "keep one" in text


def test_window_size_beside_an_overlap_is_one_window() -> None:
    data = doc()
    data["mrs"]["edges"][0].update(window_size=4, window={"overlap": 1})
    window = parse_config(data).edges[0].window
    assert window is not None and (window.size, window.overlap) == (4, 1)
