"""The logic of tools/ci/standalone.py and its helpers, without building or installing
anything: discovery of the distributions, the plan of combinations, the module walk, the
import scan, the source-tree guard."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[1]
REPO = CI.parents[1]


def load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"ci_{name}", CI / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


standalone = load("standalone")
probe = load("standalone_probe")
guard = load("standalone_guard")


def write_dist(root: Path, folder: str, text: str) -> None:
    (root / "packages" / folder).mkdir(parents=True)
    (root / "packages" / folder / "pyproject.toml").write_text(text)


def test_discover_finds_every_distribution_under_packages():
    names = {d.name for d in standalone.discover(REPO)}
    expected = {
        tomllib.loads(p.read_text())["project"]["name"]
        for p in REPO.glob("packages/*/pyproject.toml")
    }
    assert names == expected
    assert {"omni-core", "omni-ar-stages", "omni-dit-stages", "omni-serve", "omni-ray"} <= names


def test_discover_reads_name_version_extras_and_skips_non_projects(tmp_path):
    write_dist(
        tmp_path,
        "omni-new",
        '[project]\nname = "Omni_New"\nversion = "1.2"\n'
        '[project.optional-dependencies]\ntest = ["pytest"]\nfast = []\n',
    )
    write_dist(tmp_path, "not-a-dist", "[tool.ruff]\nline-length = 100\n")
    (tmp_path / "packages" / "omni-new" / "tests").mkdir()
    (tmp_path / "packages" / "omni-new" / "tests" / "test_x.py").write_text("")
    [d] = standalone.discover(tmp_path)
    assert (d.name, d.version, d.extras, d.stem) == (
        "omni-new",
        "1.2",
        ("test", "fast"),
        "omni_new",
    )
    assert d.tests == tmp_path / "packages" / "omni-new" / "tests"


def test_plan_gives_a_distribution_no_row_tests_a_row_of_its_own(tmp_path):
    write_dist(tmp_path, "a", '[project]\nname = "omni-a"\n')
    write_dist(
        tmp_path, "b", '[project]\nname = "omni-b"\n[project.optional-dependencies]\ntest = []\n'
    )
    write_dist(tmp_path, "c", '[project]\nname = "omni-c"\n')
    table = (standalone.Combination("a", "omni-a", ("omni-a", "omni-c[x]")),)
    rows = standalone.plan(standalone.discover(tmp_path), table)
    assert [(c.name, c.package, c.requirements) for c in rows] == [
        ("a", "omni-a", ("omni-a", "omni-c[x]")),
        ("b", "omni-b", ("omni-b[test]",)),  # its test extra
        ("c", "omni-c", ("omni-c",)),  # installed by row a, but tested by none
    ]


def test_plan_refuses_a_row_naming_a_distribution_that_is_not_there(tmp_path):
    write_dist(tmp_path, "a", '[project]\nname = "omni-a"\n')
    table = (standalone.Combination("a", "omni-a", ("omni-a", "omni-gone[x]")),)
    with pytest.raises(SystemExit, match="omni-gone"):
        standalone.plan(standalone.discover(tmp_path), table)


def test_the_table_covers_the_issues_families_and_names_real_distributions():
    rows = standalone.plan(standalone.discover(REPO))  # raises if a row names a missing one
    tested = {c.package for c in rows}
    assert {"omni-core", "omni-ar-stages", "omni-dit-stages", "omni-serve", "omni-ray"} <= tested
    assert {d.name for d in standalone.discover(REPO)} <= tested  # every one, alone or not
    ar = next(c for c in rows if c.name == "ar")
    assert any("transformers" in r for r in ar.requirements)


def test_clean_env_drops_other_virtual_environments_from_path(tmp_path, monkeypatch):
    other = tmp_path / "other"
    (other / "bin").mkdir(parents=True)
    (other / "pyvenv.cfg").write_text("")
    monkeypatch.setenv("PATH", f"{other / 'bin'}:/usr/bin")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = standalone.clean_env(tmp_path / "v")
    assert env["PATH"].split(":") == [str(tmp_path / "v" / "bin"), "/usr/bin"]
    assert "PYTHONPATH" not in env and env["VIRTUAL_ENV"] == str(tmp_path / "v")


@pytest.mark.parametrize(
    ("relpath", "module"),
    [
        ("omni_x/__init__.py", "omni_x"),
        ("omni_x/sub/mod.py", "omni_x.sub.mod"),
        ("omni_x/sub/__init__.py", "omni_x.sub"),
        ("omni_x/data/model.json", None),
        ("omni_x-0.1.0.dist-info/RECORD", None),
        ("../../bin/omni", None),
        ("omni_x/not-a-module.py", None),
        ("omni_x/assets-1/x.py", None),
    ],
)
def test_module_name(relpath, module):
    assert probe.module_name(relpath) == module


def test_imported_names_takes_top_level_absolute_imports_anywhere_in_the_file():
    source = (
        "import os, numpy.linalg as la\nfrom torch import nn\nfrom . import sibling\n"
        "def f():\n    import transformers\n    from .x import y\n"
    )
    assert probe.imported_names(source) == {"os", "numpy", "torch", "transformers"}


@pytest.mark.parametrize(
    ("req", "name"),
    [
        ('torch==2.13.0; extra == "transformers"', "torch"),
        ("PyYAML>=6", "pyyaml"),
        ("omni_core", "omni-core"),
        ("ray[default]<3,>=2.40", "ray"),
    ],
)
def test_requirement_name(req, name):
    assert probe.requirement_name(req) == name


def test_guard_names_modules_loaded_from_a_source_folder(tmp_path):
    src = tmp_path / "packages" / "omni-x" / "src"
    (src / "omni_x").mkdir(parents=True)
    (tmp_path / "tools" / "bench" / "src").mkdir(parents=True)
    mods = {
        "omni_x": types.SimpleNamespace(__file__=str(src / "omni_x" / "__init__.py")),
        "json": types.SimpleNamespace(__file__="/usr/lib/python3.11/json/__init__.py"),
        "builtin": types.SimpleNamespace(),
    }
    assert guard.shadowed(tmp_path, mods) == [f"omni_x: {src / 'omni_x' / '__init__.py'}"]


SAMPLE = """
import pytest

@pytest.fixture
def bad_teardown():
    yield
    raise RuntimeError("teardown")

def test_ok(): pass
def test_skipped(): pytest.skip("no")
def test_fails(): assert False
def test_teardown_fails(bad_teardown): pass
@pytest.mark.xfail(reason="x")
def test_xfail(): assert False
@pytest.mark.parametrize("n", [1, 2])
def test_param(n): assert n == 1
"""


def run_pytest(where: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(CI), **env}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_guard_lists_passed_tests_and_the_workspace_run_leaves_them_out(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    passed = tmp_path / "passed.txt"
    p = run_pytest(tmp_path, {"OMNI_STANDALONE_PASSED": str(passed)}, "-p", "standalone_guard")
    assert p.returncode == 1, p.stdout  # test_fails and the tear-down
    assert passed.read_text().splitlines() == [
        "test_sample.py::test_ok",
        "test_sample.py::test_param[1]",
    ]

    done = {"OMNI_STANDALONE_PASSED": str(passed), "OMNI_STANDALONE_REPO": str(tmp_path)}
    p = run_pytest(tmp_path, done, "-p", "standalone_done")
    assert "standalone_done: 2 tests deselected" in p.stdout, p.stdout
    assert "2 deselected" in p.stdout
    p = run_pytest(tmp_path, {}, "-p", "standalone_done")  # no variable: everything runs
    assert "deselected" not in p.stdout
    elsewhere = {**done, "OMNI_STANDALONE_REPO": str(REPO)}  # a session rooted elsewhere
    p = run_pytest(tmp_path, elsewhere, "-p", "standalone_done")
    assert "deselected" not in p.stdout


def test_the_guard_fails_a_run_that_imported_from_a_source_folder(tmp_path):
    src = tmp_path / "packages" / "omni-x" / "src"
    (src / "omni_x").mkdir(parents=True)
    (src / "omni_x" / "__init__.py").write_text("")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_x.py").write_text(
        f"import sys\nsys.path.insert(0, {str(src)!r})\nimport omni_x\ndef test_x(): pass\n"
    )
    p = run_pytest(tmp_path, {"OMNI_STANDALONE_REPO": str(tmp_path)}, "-p", "standalone_guard")
    assert p.returncode == 1 and "omni_x: " in p.stdout, p.stdout
