"""tools/ci/check_imports.py over small fake trees: circles (lazy and ``TYPE_CHECKING``
imports included), another distribution's private names and a plug-in importing
the runtime's internal modules fail it; a clean tree passes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CI = Path(__file__).resolve().parents[1]


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


CLEAN = {
    "packages/alpha/src/alpha/__init__.py": "from alpha.core import run\n",
    "packages/alpha/src/alpha/core.py": """\
        from __future__ import annotations

        from typing import TYPE_CHECKING

        from alpha import _util
        from alpha._util import _helper

        if TYPE_CHECKING:
            from alpha.types import Thing  # types imports nothing of alpha: no circle


        def run() -> None:
            _helper()
            _util._helper()
        """,
    "packages/alpha/src/alpha/_util.py": "def _helper() -> None: ...\n",
    "packages/alpha/src/alpha/types.py": "Thing = int\n",
    # another distribution's public names, and a dunder
    "tools/gamma/src/gamma/__init__.py": "import alpha\nfrom alpha.core import run\nalpha.__doc__",
}


def run(root: Path | None = None) -> tuple[int, str]:
    where = [] if root is None else ["--root", str(root)]
    r = subprocess.run(
        [sys.executable, str(CI / "check_imports.py"), *where], capture_output=True, text=True
    )
    return r.returncode, r.stdout + r.stderr


def test_a_clean_tree_passes(tmp_path):
    code, out = run(tree(tmp_path, CLEAN))
    assert code == 0 and "no circle" in out, out


def test_a_circle_and_private_imports_fail(tmp_path):
    bad = {
        **CLEAN,
        # a circle hidden by a lazy import, through a relative one
        "packages/alpha/src/alpha/_util.py": """\
            def _helper() -> None:
                from .core import run

                run()
            """,
        # another distribution's private names, three ways
        "packages/beta/src/beta/__init__.py": """\
            import alpha.core as core
            from alpha.core import _util
            from alpha._util import _helper


            def go() -> None:
                core._hidden()
            """,
    }
    code, out = run(tree(tmp_path, bad))
    assert code == 1, out
    assert "alpha: 2 modules in a circle: alpha._util, alpha.core" in out
    assert "alpha._util -> alpha.core -> alpha._util" in out
    assert "packages/alpha/src/alpha/_util.py:2: alpha._util imports alpha.core" in out
    private = out.split("private names (3):\n")[1].splitlines()
    uses = sorted(t.split(" uses ")[1].split(",")[0] for t in private)
    assert uses == ["alpha._util._helper", "alpha.core._hidden", "alpha.core._util"]
    assert all("beta (beta)" in t and "a private name of alpha" in t for t in private)


def test_a_circle_for_the_type_checker_only_is_a_circle(tmp_path):
    files = {**CLEAN, "packages/alpha/src/alpha/types.py": "from alpha.core import run\n"}
    code, out = run(tree(tmp_path, files))
    assert code == 1, out
    assert "alpha: 2 modules in a circle: alpha.core, alpha.types" in out
    assert "packages/alpha/src/alpha/core.py:9: alpha.core imports alpha.types" in out


def test_a_module_importing_itself_is_a_circle(tmp_path):
    files = {**CLEAN, "packages/alpha/src/alpha/types.py": "import alpha.types\n"}
    code, out = run(tree(tmp_path, files))
    assert code == 1 and "alpha: 1 modules in a circle: alpha.types" in out, out


RUNTIME = {
    "packages/core/pyproject.toml": """\
        [project]
        name = "core"

        [tool.omni]
        public-modules = ["core", "core.plugin"]
        """,
    "packages/core/src/core/__init__.py": "from core.client import Pipeline\n",
    "packages/core/src/core/client.py": "class Pipeline: ...\n",
    "packages/core/src/core/plugin.py": "from core.worker.host import Stage\n",
    "packages/core/src/core/worker/__init__.py": "",
    "packages/core/src/core/worker/host.py": "class Stage: ...\n",
    "packages/core/src/core/control.py": "def apply() -> None: ...\n",
    # not a plug-in (no omni.stages entry points): the server may use the runtime's insides
    "packages/server/pyproject.toml": '[project]\nname = "server"\n',
    "packages/server/src/server/__init__.py": "from core.worker.host import Stage\n",
}


def plugin(name: str, extra: str = "") -> dict[str, str]:
    """A plug-in distribution's pyproject.toml (entry points under omni.stages)."""
    return {
        f"packages/{name}/pyproject.toml": f"""\
            [project]
            name = "{name}"

            [project.entry-points."omni.stages"]
            "{name}.kind" = "{name}:Kind"
            {extra}
            """
    }


def test_a_plugin_on_the_public_surface_passes(tmp_path):
    files = {
        **RUNTIME,
        **plugin("fam"),
        "packages/fam/src/fam/__init__.py": """\
            import core
            from core import Pipeline
            from core.plugin import Stage
            import core.plugin as plugin


            class Kind(Stage): ...
            """,
    }
    code, out = run(tree(tmp_path, files))
    assert code == 0 and "no plug-in importing" in out, out


def test_a_plugin_importing_the_runtimes_internals_fails(tmp_path):
    files = {
        **RUNTIME,
        **plugin("fam"),
        "packages/fam/src/fam/__init__.py": """\
            from core.plugin import Stage
            from core.worker.host import Stage as Host
            from core import worker


            def late() -> None:
                import core.control

                core.control.apply()
            """,
        # an example plug-in under examples/, registering named models only
        "examples/demo/pyproject.toml": """\
            [project]
            name = "demo"

            [project.entry-points."omni.models"]
            demo = "demo:models"
            """,
        "examples/demo/src/demo/__init__.py": "from core.control import apply\n",
    }
    code, out = run(tree(tmp_path, files))
    assert code == 1, out
    found = out.split("runtime's internal modules (4):\n")[1].splitlines()
    assert [f.strip().split(": ", 1)[0] for f in found] == [
        "packages/fam/src/fam/__init__.py:2",
        "packages/fam/src/fam/__init__.py:3",
        "packages/fam/src/fam/__init__.py:7",
        "examples/demo/src/demo/__init__.py:1",
    ]
    assert "imports core.worker.host, internal to core" in found[0]
    assert "imports core.worker, internal to core" in found[1]
    assert "imports core.control, internal to core" in found[2]
    assert all("(a plug-in may import core, core.plugin)" in f for f in found)
    assert "server" not in out  # not a plug-in


def test_a_plugin_that_says_why_may_use_the_internals(tmp_path):
    why = '[tool.omni]\n            runtime-internals = "test support"'
    files = {
        **RUNTIME,
        **plugin("fam", why),
        "packages/fam/src/fam/__init__.py": "from core.worker.host import Stage\n",
    }
    code, out = run(tree(tmp_path, files))
    assert code == 0, out


def test_the_repository():
    """The check runs over this repository (what it finds fails `hatch run lint`)."""
    code, out = run()
    assert code in (0, 1) and "Traceback" not in out, out
