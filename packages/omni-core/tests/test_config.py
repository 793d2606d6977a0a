"""Tests of omni_core.config: the pipeline YAML schema and its error messages.

Every error must name the source (file), the key path and what was expected.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from omni_core.config import ConfigError, PipelineConfig, load_config, parse_config
from omni_core.registry import default_registry

REPO_ROOT = Path(__file__).resolve().parents[3]
SRC = "pipelines/bad.yaml"
CORE_KINDS = [
    "synthetic.array_sink",
    "synthetic.array_source",
    "synthetic.faulty",
    "synthetic.join",
    "synthetic.map",
    "synthetic.sleep",
    "synthetic.source",
]


def stage(name: str = "a", kind: str = "synthetic.source", **kw: Any) -> dict[str, Any]:
    return {"name": name, "kind": kind, **kw}


def two(edge: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """Stages a -> b, with extra keys on the edge and at the top level."""
    return {
        "stages": [stage("a"), stage("b", "synthetic.map")],
        "edges": [{"from": "a", "to": "b", **(edge or {})}],
        **top,
    }


# (id, data, key path, fragment of what was expected)
BAD_CONFIGS = [
    ("unknown-top-level-key", {"stages": [stage()], "bogus": 1}, "bogus", "unknown key"),
    (
        "unknown-backend-key",
        {"stages": [stage()], "backend": {"kind": "ray", "adress": "auto"}},
        "backend.adress",
        "unknown key",
    ),
    (
        "negative-gpus-in-placement",
        {"stages": [stage(placement={"num_gpus": -1})]},
        "stages[0].placement.num_gpus",
        "Expected `float` >= 0",
    ),
    (
        "zero-custom-resource",
        {"stages": [stage(placement={"resources": {"node_b": 0}})]},
        "stages[0].placement.resources[...]",
        "Expected `float` > 0.0",
    ),
    ("unknown-stage-key", {"stages": [stage(bogus=1)]}, "stages[0].bogus", "unknown key"),
    (
        "unknown-edge-window-key",
        two({"window": {"sise": 3}}),
        "edges[0].window.sise",
        "unknown key",
    ),
    (
        "unknown-defaults-key",
        {"mrs": {"defaults": {"max_inflite": 2}}, "stages": [stage()]},
        "mrs.defaults.max_inflite",
        "unknown key",
    ),
    (
        "max-inflight-wrong-type",
        {"stages": [stage(max_inflight="x")]},
        "stages[0].max_inflight",
        "Expected `int | null`, got `str`",
    ),
    (
        "max-inflight-bool",
        {"stages": [stage(max_inflight=True)]},
        "stages[0].max_inflight",
        "got `bool`",
    ),
    (
        "max-inflight-zero",
        {"stages": [stage(max_inflight=0)]},
        "stages[0].max_inflight",
        "Expected `int` >= 1",
    ),
    (
        "default-max-batch-size-zero",
        {"mrs": {"defaults": {"max_batch_size": 0}}, "stages": [stage()]},
        "mrs.defaults.max_batch_size",
        "Expected `int` >= 1",
    ),
    (
        "second-stage-queue-capacity-zero",
        {"stages": [stage("a"), stage("b", queue_capacity=0)]},
        "stages[1].queue_capacity",
        "Expected `int` >= 1",
    ),
    ("missing-kind", {"stages": [{"name": "a"}]}, "stages[0].kind", "required key is missing"),
    (
        "missing-name",
        {"stages": [{"kind": "synthetic.source"}]},
        "stages[0].name",
        "required key is missing",
    ),
    ("missing-stages", {"name": "p"}, "stages", "required key is missing"),
    ("empty-stages", {"stages": []}, "stages", "Expected `array` of length >= 1"),
    ("stages-not-a-list", {"stages": {"a": 1}}, "stages", "Expected `array`, got `object`"),
    (
        "bad-stage-name",
        {"stages": [stage("a b")]},
        "stages[0].name",
        "Expected `str` matching regex",
    ),
    (
        "duplicate-stage-name",
        {"stages": [stage("a"), stage("b"), stage("a")]},
        "stages[2].name",
        "duplicate stage name 'a' (first at stages[0])",
    ),
    (
        "edge-from-missing-stage",
        {"stages": [stage("a")], "edges": [{"from": "zz", "to": "a"}]},
        "edges[0].from",
        "unknown stage 'zz'; stages are: a",
    ),
    (
        "edge-to-missing-stage",
        {"stages": [stage("a"), stage("b")], "edges": [{"from": "a", "to": "zz"}]},
        "edges[0].to",
        "unknown stage 'zz'; stages are: a, b",
    ),
    (
        "edge-missing-to",
        {"stages": [stage("a")], "edges": [{"from": "a"}]},
        "edges[0].to",
        "required key is missing",
    ),
    (
        "self-edge",
        {"stages": [stage("a")], "edges": [{"from": "a", "to": "a"}]},
        "edges[0]",
        "stage 'a' cannot feed itself",
    ),
    (
        "duplicate-edge",
        {
            "stages": [stage("a"), stage("b")],
            "edges": [{"from": "a", "to": "b"}, {"from": "a", "to": "b"}],
        },
        "edges[1]",
        "duplicate edge a -> b (first at edges[0])",
    ),
    (
        "cycle",
        {
            "stages": [stage("a"), stage("b"), stage("c")],
            "edges": [
                {"from": "a", "to": "b"},
                {"from": "b", "to": "c"},
                {"from": "c", "to": "b"},
            ],
        },
        "edges",
        "cycle b -> c -> b; a pipeline must be a DAG",
    ),
    (
        "edge-window-size-zero",
        two({"window": {"size": 0}}),
        "edges[0].window.size",
        "expected -1 (whole stream) or an integer >= 1, got 0",
    ),
    (
        "default-window-size-minus-five",
        {"mrs": {"defaults": {"window": {"size": -5}}}, "stages": [stage()]},
        "mrs.defaults.window.size",
        "expected -1 (whole stream) or an integer >= 1, got -5",
    ),
    (
        "overlap-with-whole-stream-window",
        two({"window": {"size": -1, "overlap": 2}}),
        "edges[0].window.overlap",
        "an overlap needs a window size >= 1 (size is -1)",
    ),
    (
        "default-overlap-with-default-size",
        {"mrs": {"defaults": {"window": {"overlap": 1}}}, "stages": [stage()]},
        "mrs.defaults.window.overlap",
        "an overlap needs a window size >= 1",
    ),
    (
        "negative-overlap",
        two({"window": {"size": 4, "overlap": -1}}),
        "edges[0].window.overlap",
        "Expected `int` >= 0",
    ),
    (
        "devices-gpu0",
        {"stages": [stage(devices="gpu0")]},
        "stages[0].devices",
        'expected a device list like "0" or "1,2", a logical index, or "cpu"; got \'gpu0\'',
    ),
    (
        "devices-trailing-comma",
        {"stages": [stage(devices="0,")]},
        "stages[0].devices",
        "got '0,'",
    ),
    (
        "devices-negative",
        {"stages": [stage(devices=-1)]},
        "stages[0].devices",
        "Expected `int` >= 0",
    ),
    (
        "extra-env-not-str",
        {"stages": [stage(extra_env={"A": 1})]},
        "stages[0].extra_env[...]",
        "Expected `str`, got `int`",
    ),
    (
        "shm-pool-too-small",
        {"stages": [stage()], "shm_pool_bytes": 5},
        "shm_pool_bytes",
        "Expected `int` >= 1048576",
    ),
    (
        "ready-timeout-zero",
        {"stages": [stage()], "ready_timeout_s": 0},
        "ready_timeout_s",
        "Expected `float` > 0",
    ),
    (
        "unknown-stage-kind",
        {"stages": [stage("a"), stage("b", "nope.x")]},
        "stages[1].kind",
        "unknown stage kind 'nope.x' (entry-point group 'omni.stages'); known: ",
    ),
    (
        "unknown-option",
        {"stages": [stage(options={"tokens": 4, "bogus": 1})]},
        "stages[0].options.bogus",
        "unknown option",
    ),
    (
        "wrongly-typed-option",
        {"stages": [stage("a"), stage("b", options={"tokens": "many"})]},
        "stages[1].options.tokens",
        "Expected `int`, got `str`",
    ),
    (
        "wrongly-typed-option-of-map",
        {"stages": [stage("a", "synthetic.map", options={"scale": 1.5})]},
        "stages[0].options.scale",
        "Expected `int`, got `float`",
    ),
]


@pytest.mark.parametrize(
    ("data", "path", "expected"),
    [pytest.param(d, p, x, id=i) for i, d, p, x in BAD_CONFIGS],
)
def test_bad_config_names_source_path_and_expectation(
    data: dict[str, Any], path: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, SRC)
    message = str(info.value)
    assert message.startswith(f"{SRC}: {path}: "), message
    assert expected in message, message


def test_bad_config_ids_are_unique() -> None:
    ids = [i for i, *_ in BAD_CONFIGS]
    assert len(ids) == len(set(ids))


def test_unknown_kind_lists_every_known_kind() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"stages": [stage(kind="nope.x")]}, SRC)
    known = str(info.value).split("known: ", 1)[1].split(", ")
    assert set(CORE_KINDS) <= set(known)
    assert known == sorted(known)


def test_check_kinds_false_skips_kind_and_option_checks() -> None:
    cfg = parse_config(
        {"stages": [stage(kind="nope.x"), stage("b", options={"bogus": 1})]},
        SRC,
        check_kinds=False,
    )
    assert [s.kind for s in cfg.stages] == ["nope.x", "synthetic.source"]
    assert cfg.stages[1].options == {"bogus": 1}


def test_structure_is_checked_before_kinds() -> None:
    data = {"stages": [stage(kind="nope.x")], "edges": [{"from": "a", "to": "a"}]}
    with pytest.raises(ConfigError, match=r"edges\[0\]: stage 'a' cannot feed itself"):
        parse_config(data, SRC)


@pytest.mark.parametrize("data", [[1, 2], "stages", 3, None], ids=repr)
def test_top_level_must_be_a_mapping(data: Any) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, SRC)
    assert str(info.value) == f"{SRC}: <top>: expected a mapping, got {type(data).__name__}"


def test_default_source_name() -> None:
    with pytest.raises(ConfigError, match=r"^<config>: stages: required key is missing$"):
        parse_config({})


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("devices", ["cpu", "0", "1,2", "0,1,2,3", 0, 3, None])
def test_valid_devices(devices: str | int | None) -> None:
    cfg = parse_config({"stages": [stage(devices=devices)]}, SRC)
    assert cfg.stages[0].devices == devices


def test_valid_options_are_accepted() -> None:
    options = {"tokens": 16, "segment": 2, "delay_s": 0.5, "array_bytes": 64}
    cfg = parse_config({"stages": [stage(options=options)]}, SRC)
    assert cfg.stages[0].options == options


# -- load_config: files --------------------------------------------------------

VALID_YAML = """\
name: demo
mrs:
  defaults:
    max_inflight: 3
    window: {size: 4, overlap: 1}
stages:
  - name: src
    kind: synthetic.source
    options: {tokens: 16, segment: 2}
  - name: left
    kind: synthetic.map
    max_inflight: 2
    devices: "0"
    extra_env: {OMNI_TEST: "1"}
  - name: right
    kind: synthetic.map
    client_stream: true
  - name: join
    kind: synthetic.join
edges:
  - {from: src, to: left}
  - {from: src, to: right, window: {size: -1}}
  - {from: left, to: join}
  - {from: right, to: join}
"""


@pytest.fixture
def valid_cfg(tmp_path: Path) -> PipelineConfig:
    path = tmp_path / "demo.yaml"
    path.write_text(VALID_YAML)
    return load_config(path)


def test_valid_config_loads(valid_cfg: PipelineConfig, tmp_path: Path) -> None:
    assert valid_cfg.name == "demo"
    assert valid_cfg.source_file == str(tmp_path / "demo.yaml")
    assert [s.name for s in valid_cfg.stages] == ["src", "left", "right", "join"]
    assert valid_cfg.stage("left").devices == "0"
    assert valid_cfg.stage("left").extra_env == {"OMNI_TEST": "1"}
    assert valid_cfg.stage("src").options == {"tokens": 16, "segment": 2}
    with pytest.raises(KeyError):
        valid_cfg.stage("missing")


def test_settings_fall_back_to_mrs_defaults(valid_cfg: PipelineConfig) -> None:
    left, right = valid_cfg.stage("left"), valid_cfg.stage("right")
    assert valid_cfg.setting(left, "max_inflight") == 2  # the stage's own value
    assert valid_cfg.setting(right, "max_inflight") == 3  # mrs.defaults
    assert valid_cfg.setting(right, "max_batch_size") == 1  # built-in default
    assert valid_cfg.setting(right, "queue_capacity") == 64


def test_edge_window_falls_back_to_default(valid_cfg: PipelineConfig) -> None:
    e_left, e_right = valid_cfg.outbound("src")
    assert (e_left.target, e_right.target) == ("left", "right")
    assert (valid_cfg.window(e_left).size, valid_cfg.window(e_left).overlap) == (4, 1)
    assert (valid_cfg.window(e_right).size, valid_cfg.window(e_right).overlap) == (-1, 0)


def test_graph_views(valid_cfg: PipelineConfig) -> None:
    assert valid_cfg.sources() == ["src"]
    assert valid_cfg.sinks() == ["join"]
    assert [e.source for e in valid_cfg.inbound("join")] == ["left", "right"]
    assert valid_cfg.topological_order() == ["src", "left", "right", "join"]


def test_streams_to_client(valid_cfg: PipelineConfig) -> None:
    streams = {s.name: valid_cfg.streams_to_client(s) for s in valid_cfg.stages}
    # sinks stream by default; client_stream: true makes an inner stage stream too
    assert streams == {"src": False, "left": False, "right": True, "join": True}
    assert valid_cfg.client_streams() == ["right", "join"]


def test_client_stream_false_silences_a_sink() -> None:
    cfg = parse_config({"stages": [stage("a"), stage("b", client_stream=False)]}, SRC)
    assert cfg.sinks() == ["a", "b"]
    assert cfg.client_streams() == ["a"]


def test_topological_order_respects_every_edge() -> None:
    edges = [("e", "d"), ("d", "c"), ("c", "b"), ("b", "a"), ("e", "a")]
    cfg = parse_config(
        {
            "stages": [stage(n) for n in "abcde"],
            "edges": [{"from": s, "to": t} for s, t in edges],
        },
        SRC,
    )
    order = cfg.topological_order()
    assert sorted(order) == list("abcde")
    assert all(order.index(s) < order.index(t) for s, t in edges)
    assert cfg.sources() == ["e"]
    assert cfg.sinks() == ["a"]


def test_topological_order_reports_a_cycle_it_was_given() -> None:
    # built without parse_config's checks, so the cycle reaches topological_order
    cfg = msgspec.convert(
        {
            "stages": [stage("a"), stage("b")],
            "edges": [{"from": "a", "to": "b"}, {"from": "b", "to": "a"}],
        },
        PipelineConfig,
    )
    cfg.source_file = SRC
    with pytest.raises(ConfigError, match=rf"^{SRC}: edges: contain a cycle$"):
        cfg.topological_order()


def test_minimal_config_defaults() -> None:
    cfg = parse_config({"stages": [stage()]}, SRC)
    assert cfg.name == "pipeline"
    assert cfg.mrs.enabled is True
    d = cfg.mrs.defaults
    assert (d.max_inflight, d.max_batch_size, d.queue_capacity) == (1, 1, 64)
    assert (d.window.size, d.window.overlap) == (-1, 0)
    assert cfg.edges == []
    assert cfg.sources() == cfg.sinks() == cfg.topological_order() == ["a"]
    assert cfg.shm_pool_bytes == 1 << 30
    assert cfg.request_timeout_s is None
    assert cfg.source_file == SRC


def test_bad_config_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("stages:\n  - name: a\n    kind: synthetic.source\n    max_inflight: 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: stages[0].max_inflight: Expected `int` >= 1"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("name: x\nstages:\n  - name: a\n   kind: [\n", 4),
        ("name: x\nstages:\n  - {name: a\n", 4),
        ("name: x\n\tstages: []\n", 2),
    ],
    ids=["bad-indent", "unclosed-flow-mapping", "tab"],
)
def test_invalid_yaml_names_file_and_line(tmp_path: Path, text: str, line: int) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: line {line}, column "), message
    assert "invalid YAML: " in message


def test_empty_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(ConfigError, match="expected a mapping, got NoneType") as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: <top>: ")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: cannot read: No such file or directory"


def test_directory_is_not_readable_as_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(info.value) == f"{tmp_path}: cannot read: Is a directory"


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files regardless of mode"
)
def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "secret.yaml"
    path.write_text("stages: []\n")
    path.chmod(0)
    try:
        with pytest.raises(ConfigError) as info:
            load_config(path)
    finally:
        path.chmod(0o600)
    assert str(info.value) == f"{path}: cannot read: Permission denied"


def test_non_utf8_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: caf\xe9\nstages: []\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: cannot read: not UTF-8")


def test_load_config_check_kinds_false(tmp_path: Path) -> None:
    path = tmp_path / "later.yaml"
    path.write_text("stages:\n  - {name: a, kind: not.installed.yet}\n")
    with pytest.raises(ConfigError, match=r"stages\[0\]\.kind: unknown stage kind 'not.installed"):
        load_config(path)
    assert load_config(path, check_kinds=False).stages[0].kind == "not.installed.yet"


# -- the repository's own configs -------------------------------------------------

REPO_CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, id=p.name) for p in REPO_CONFIGS]
    or [pytest.param(None, marks=pytest.mark.skip(reason="configs/ holds no *.yaml yet"))],
)
def test_repo_config_loads(path: Path) -> None:
    cfg = load_config(path, check_kinds=False)
    assert cfg.source_file == str(path)
    assert cfg.topological_order()
    # kinds and options too, where every kind the config names is installed here
    if {s.kind for s in cfg.stages} <= set(default_registry().names()):
        load_config(path)


def test_environment_variables_in_yaml(tmp_path, monkeypatch):
    """${NAME} and ${NAME:-default} in string values come from the environment; an unset
    one without a default names itself and where it is used; $${ is a literal."""
    from omni_core.config import ConfigError, load_config

    path = tmp_path / "p.yaml"
    path.write_text(
        "stages:\n"
        "  - name: a\n"
        "    kind: synthetic.count\n"
        "    options: {label: '${OMNI_T_LABEL}-x', other: '${OMNI_T_UNSET:-fallback}',"
        " raw: '$${KEEP}'}\n"
    )
    monkeypatch.setenv("OMNI_T_LABEL", "from-env")
    monkeypatch.delenv("OMNI_T_UNSET", raising=False)
    cfg = load_config(path, check_kinds=False)
    assert cfg.stages[0].options == {"label": "from-env-x", "other": "fallback", "raw": "${KEEP}"}
    monkeypatch.setenv("OMNI_T_UNSET", "")  # set but empty: the default, as in a shell
    monkeypatch.setenv("OMNI_T_LABEL", "a$${b")  # a value is not expanded again
    cfg = load_config(path, check_kinds=False)
    assert cfg.stages[0].options == {"label": "a$${b-x", "other": "fallback", "raw": "${KEEP}"}
    monkeypatch.delenv("OMNI_T_LABEL")
    with pytest.raises(ConfigError) as e:
        load_config(path, check_kinds=False)
    assert "OMNI_T_LABEL" in str(e.value) and "stages[0].options.label" in str(e.value)
    # anchors under x- keys are not expanded where they stand (their uses are)
    path.write_text("x-unused: '${OMNI_T_LABEL}'\nstages:\n  - {name: a, kind: synthetic.count}\n")
    assert load_config(path, check_kinds=False).stages[0].name == "a"
