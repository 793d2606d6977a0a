"""Tests of omni_core.registry: entry-point indexing, duplicates and broken plug-ins.

The plug-in tests install real throwaway distributions (built by pip through a tiny
in-tree PEP 517 backend, so neither the network nor setuptools/wheel is needed) into a
temporary directory, and check them in a subprocess with that directory on PYTHONPATH, so
this process's entry points and registry caches stay as they are.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omni_core.registry import (
    STAGES_GROUP,
    Entry,
    Registry,
    RegistryError,
    default_registry,
    load_stage_class,
)
from omni_core.stage import Stage
from omni_testing.stages import TokenMap, TokenSource

CORE_KINDS = {
    "synthetic.source",
    "synthetic.map",
    "synthetic.sleep",
    "synthetic.join",
    "synthetic.array_source",
    "synthetic.array_sink",
    "synthetic.faulty",
}

# -- in-process: the core package's own kinds ----------------------------------


def test_core_kinds_are_registered() -> None:
    names = default_registry().names()
    assert set(names) >= CORE_KINDS
    assert names == sorted(names)


def test_synthetic_entries_name_their_distribution() -> None:
    claims = {c[0].name: c for c in default_registry().entries()}
    for kind in CORE_KINDS:
        (entry,) = claims[kind]
        assert entry.distribution == "omni-testing"
        assert entry.value.startswith("omni_testing.stages:")
        assert entry.version


def test_load_stage_class() -> None:
    assert load_stage_class("synthetic.source") is TokenSource
    assert load_stage_class("synthetic.map") is TokenMap
    for kind in CORE_KINDS:
        assert issubclass(load_stage_class(kind), Stage)


def test_default_registry_is_shared_and_caches_loads() -> None:
    assert default_registry() is default_registry()
    reg = Registry(STAGES_GROUP, "stage kind")
    first = reg.load("synthetic.source")
    assert reg.load("synthetic.source") is first is TokenSource


def test_unknown_kind_lists_known_kinds() -> None:
    with pytest.raises(RegistryError) as info:
        load_stage_class("no.such.kind")
    message = str(info.value)
    assert message.startswith(
        "unknown stage kind 'no.such.kind' (entry-point group 'omni.stages'); known: "
    )
    known = message.split("known: ", 1)[1].split(", ")
    assert set(known) >= CORE_KINDS
    assert known == sorted(known)


def test_empty_group() -> None:
    reg = Registry("omni.test.no-such-group", "widget")
    assert reg.names() == []
    assert reg.entries() == []
    with pytest.raises(RegistryError) as info:
        reg.load("x")
    assert str(info.value) == (
        "unknown widget 'x' (entry-point group 'omni.test.no-such-group'); known: none installed"
    )


def test_registry_error_is_a_lookup_error() -> None:
    assert issubclass(RegistryError, LookupError)


def test_entry_describe() -> None:
    e = Entry("k", "pkg.mod:Cls", "omni-thing", "1.2")
    assert e.describe() == "k = 'pkg.mod:Cls' from omni-thing 1.2"


def test_no_plugin_leaks_into_this_process(plugin_site: Path) -> None:
    assert not {"thirdparty.echo", "thirdparty.broken"} & set(default_registry().names())
    assert not {"thirdparty.echo", "thirdparty.broken"} & set(
        Registry(STAGES_GROUP, "stage kind").names()
    )


# -- throwaway plug-in distributions ------------------------------------------------

BACKEND = '''\
"""Minimal PEP 517 backend: packs the *.py modules beside pyproject.toml into a wheel."""
import base64
import hashlib
import tomllib
import zipfile
from pathlib import Path

HERE = Path(__file__).parent


def _digest(data):
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = tomllib.loads((HERE / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    stem = f"{name.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {p.name: p.read_bytes() for p in sorted(HERE.glob("*.py")) if p.name != "_backend.py"}
    meta = f"Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n"
    files[f"{info}/METADATA"] = meta.encode()
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\\nGenerator: omni-test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"
    )
    files[f"{info}/entry_points.txt"] = "".join(
        f"[{group}]\\n" + "".join(f"{k} = {v}\\n" for k, v in eps.items()) + "\\n"
        for group, eps in project.get("entry-points", {}).items()
    ).encode()
    record = [f"{p},sha256={_digest(d)},{len(d)}" for p, d in files.items()]
    files[f"{info}/RECORD"] = ("\\n".join([*record, f"{info}/RECORD,,"]) + "\\n").encode()
    wheel = f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(Path(wheel_directory) / wheel, "w") as z:
        for p, d in files.items():
            z.writestr(p, d)
    return wheel
'''

PLUGINS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    # distribution: ({entry-point name: value}, {module file: source})
    "omni-plugin-good": (
        {"thirdparty.echo": "omni_plugin_good:Echo"},
        {
            "omni_plugin_good.py": """\
                from omni_core import Stage

                class Echo(Stage):
                    def process(self, batch):
                        for inp in batch:
                            yield inp.segment([0], is_last=True)
                """,
        },
    ),
    "omni-plugin-dup": (
        {"synthetic.source": "omni_plugin_dup:Source"},
        {
            "omni_plugin_dup.py": """\
                from omni_core import Stage

                class Source(Stage):
                    pass
                """,
        },
    ),
    "omni-plugin-broken": (
        {
            "thirdparty.broken": "omni_plugin_broken:Broken",
            "thirdparty.not_a_stage": "omni_plugin_notstage:NotAStage",
        },
        {
            "omni_plugin_broken.py": """\
                raise ImportError("omni_plugin_broken needs libfrobnicate, which is missing")
                """,
            "omni_plugin_notstage.py": """\
                class NotAStage:
                    pass
                """,
        },
    ),
}


def _write_distribution(root: Path, name: str) -> Path:
    entry_points, modules = PLUGINS[name]
    src = root / name
    src.mkdir()
    eps = "\n".join(f'"{k}" = "{v}"' for k, v in entry_points.items())
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = []
            build-backend = "_backend"
            backend-path = ["."]

            [project]
            name = "{name}"
            version = "0.1.0"

            [project.entry-points."omni.stages"]
            """
        )
        + eps
        + "\n"
    )
    (src / "_backend.py").write_text(BACKEND)
    for filename, text in modules.items():
        (src / filename).write_text(textwrap.dedent(text))
    return src


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the three plug-in distributions installed into it by pip."""
    root = tmp_path_factory.mktemp("plugins")
    sources = [str(_write_distribution(root, name)) for name in PLUGINS]
    site = root / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "--disable-pip-version-check", "--target", str(site), *sources]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, f"pip install failed:\n{r.stdout}\n{r.stderr}"
    for name in PLUGINS:
        assert list(site.glob(f"{name.replace('-', '_')}-0.1.0.dist-info")), sorted(site.iterdir())
    return site


PRELUDE = """\
import json
from omni_core.registry import Registry, RegistryError, default_registry, load_stage_class

def attempt(fn, *args):
    try:
        value = fn(*args)
    except RegistryError as e:
        cause = e.__cause__
        return {"error": str(e), "cause": type(cause).__name__ if cause else None}
    if isinstance(value, type):
        return {"ok": f"{value.__module__}:{value.__qualname__}"}
    return {"ok": repr(value)}

def claims(reg, name):
    # the distributions claiming name, one list per entry of reg.entries() for it
    return [[e.distribution for e in c] for c in reg.entries() if c[0].name == name]

out = {}
"""


def run_python(args: list[str], *path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` in a fresh interpreter with ``path`` first on sys.path."""
    pythonpath = [str(p) for p in path]
    if os.environ.get("PYTHONPATH"):
        pythonpath.append(os.environ["PYTHONPATH"])
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=path[0],
    )


def run_with_plugins(code: str, *path: Path) -> dict:
    """Run ``code`` after PRELUDE with ``path`` first on sys.path; return its ``out``."""
    script = PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    r = run_python(["-c", script], *path)
    assert r.returncode == 0, f"subprocess failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_good_plugin_is_listed_and_loads(plugin_site: Path) -> None:
    out = run_with_plugins(
        """
        from omni_core import Stage
        reg = Registry("omni.stages", "stage kind")
        out["names"] = reg.names()
        out["load"] = attempt(load_stage_class, "thirdparty.echo")
        out["is_stage"] = issubclass(load_stage_class("thirdparty.echo"), Stage)
        out["describe"] = reg.entry("thirdparty.echo")[0].describe()
        """,
        plugin_site,
    )
    assert {"thirdparty.echo", "thirdparty.broken", "thirdparty.not_a_stage"} <= set(out["names"])
    assert set(out["names"]) >= CORE_KINDS
    assert out["load"] == {"ok": "omni_plugin_good:Echo"}
    assert out["is_stage"] is True
    assert (
        out["describe"] == "thirdparty.echo = 'omni_plugin_good:Echo' from omni-plugin-good 0.1.0"
    )


def test_duplicate_name_names_both_distributions(plugin_site: Path) -> None:
    out = run_with_plugins(
        """
        from omni_core.config import ConfigError, parse_config
        reg = Registry("omni.stages", "stage kind")
        out["claims"] = claims(reg, "synthetic.source")
        out["load"] = attempt(load_stage_class, "synthetic.source")
        out["other"] = attempt(load_stage_class, "synthetic.map")
        try:
            parse_config({"stages": [{"name": "a", "kind": "synthetic.source"}]}, "p.yaml")
        except ConfigError as e:
            out["config"] = str(e)
        """,
        plugin_site,
    )
    assert len(out["claims"]) == 1
    assert sorted(out["claims"][0]) == ["omni-plugin-dup", "omni-testing"]
    message = out["load"]["error"]
    assert message.startswith(
        "stage kind 'synthetic.source' is registered by more than one distribution: "
    )
    assert "'omni_testing.stages:TokenSource' from omni-testing " in message
    assert "synthetic.source = 'omni_plugin_dup:Source' from omni-plugin-dup 0.1.0" in message
    # a conflict on one name leaves the others usable
    assert out["other"] == {"ok": "omni_testing.stages:TokenMap"}
    # and a config using the contested kind says where and why
    assert out["config"].startswith("p.yaml: stages[0].kind: stage kind 'synthetic.source' is ")
    assert "omni-testing" in out["config"]
    assert "omni-plugin-dup" in out["config"]


def test_broken_plugin_names_entry_point_and_distribution(plugin_site: Path) -> None:
    out = run_with_plugins(
        """
        reg = Registry("omni.stages", "stage kind")
        out["names"] = reg.names()  # indexing imports nothing, so a broken plug-in is listed
        out["load"] = attempt(reg.load, "thirdparty.broken")
        out["again"] = attempt(reg.load, "thirdparty.broken")
        out["good"] = attempt(reg.load, "thirdparty.echo")
        """,
        plugin_site,
    )
    assert "thirdparty.broken" in out["names"]
    assert out["load"] == {
        "error": "stage kind 'thirdparty.broken': entry point 'omni_plugin_broken:Broken' of "
        "distribution omni-plugin-broken 0.1.0 failed to import: ImportError: "
        "omni_plugin_broken needs libfrobnicate, which is missing",
        "cause": "ImportError",
    }
    assert out["again"] == out["load"]  # a failure is not cached as a success
    assert out["good"] == {"ok": "omni_plugin_good:Echo"}


def test_entry_point_that_is_not_a_stage(plugin_site: Path) -> None:
    out = run_with_plugins(
        'out["load"] = attempt(load_stage_class, "thirdparty.not_a_stage")', plugin_site
    )
    assert out["load"]["error"] == (
        "stage kind 'thirdparty.not_a_stage': entry point 'omni_plugin_notstage:NotAStage' of "
        "omni-plugin-broken is not a subclass of omni_core.Stage"
    )


def test_unknown_name_lists_known_names_including_plugins(plugin_site: Path) -> None:
    out = run_with_plugins(
        'out["load"] = attempt(load_stage_class, "thirdparty.nope")', plugin_site
    )
    message = out["load"]["error"]
    prefix = "unknown stage kind 'thirdparty.nope' (entry-point group 'omni.stages'); known: "
    assert message.startswith(prefix)
    known = message[len(prefix) :].split(", ")
    assert {"thirdparty.echo", "thirdparty.broken", "thirdparty.not_a_stage"} <= set(known)
    assert set(known) >= CORE_KINDS
    assert known == sorted(known)


def test_same_distribution_twice_on_path_is_not_a_conflict(
    plugin_site: Path, tmp_path: Path
) -> None:
    second = tmp_path / "site2"
    shutil.copytree(plugin_site, second)
    out = run_with_plugins(
        """
        reg = Registry("omni.stages", "stage kind")
        out["claims"] = claims(reg, "thirdparty.echo")
        out["load"] = attempt(load_stage_class, "thirdparty.echo")
        """,
        plugin_site,
        second,
    )
    assert out["claims"] == [["omni-plugin-good"]]
    assert out["load"] == {"ok": "omni_plugin_good:Echo"}


def test_omni_stages_cli_lists_plugins(plugin_site: Path) -> None:
    r = run_python(["-m", "omni_core.cli", "stages", "--json"], plugin_site)
    # (the exit status of --json is not checked: it is 0 even with a conflict, unlike the text form)
    rows = {(row["name"], row["distribution"]): row for row in json.loads(r.stdout)}
    assert rows["thirdparty.echo", "omni-plugin-good"]["value"] == "omni_plugin_good:Echo"
    assert rows["thirdparty.echo", "omni-plugin-good"]["conflict"] is False
    assert rows["thirdparty.broken", "omni-plugin-broken"]["version"] == "0.1.0"
    assert rows["synthetic.source", "omni-testing"]["conflict"] is True
    assert rows["synthetic.source", "omni-plugin-dup"]["conflict"] is True
    assert rows["synthetic.map", "omni-testing"]["conflict"] is False

    r = run_python(["-m", "omni_core.cli", "stages"], plugin_site)
    assert r.returncode == 1, r.stderr  # a conflict makes `omni stages` fail
    lines = r.stdout.splitlines()
    echo = next(line for line in lines if line.startswith("thirdparty.echo "))
    assert "omni-plugin-good 0.1.0" in echo
    assert "omni_plugin_good:Echo" in echo
    assert "CONFLICT" not in echo
    dup = [line for line in lines if line.startswith("synthetic.source ")]
    assert len(dup) == 2
    assert all("CONFLICT" in line for line in dup)
    assert any("omni-plugin-dup" in line for line in dup)


def test_production_distributions_register_no_test_stage() -> None:
    """A user's install lists real stages only: the synthetic stages, fault injectors and
    the stand-in encoder are omni-testing's."""
    from importlib.metadata import PackageNotFoundError, distribution

    for name in ("omni-core", "omni-ar-stages", "omni-dit-stages", "omni-serve", "omni-ray"):
        try:
            eps = distribution(name).entry_points
        except PackageNotFoundError:
            continue
        stages = [ep.name for ep in eps if ep.group == "omni.stages"]
        assert not [s for s in stages if s.startswith("synthetic.") or "hash" in s], name
        assert not [ep.value for ep in eps if "testing" in ep.value.split(":")[0]], name
