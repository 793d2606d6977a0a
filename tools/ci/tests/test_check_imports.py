"""tools/ci/check_imports.py over small fake trees: circles (lazy imports included,
``TYPE_CHECKING`` ones not) and another distribution's private names fail it; a clean
tree passes."""

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
            from alpha.types import Thing  # a circle for the type checker only


        def run() -> None:
            _helper()
            _util._helper()
        """,
    "packages/alpha/src/alpha/_util.py": "def _helper() -> None: ...\n",
    "packages/alpha/src/alpha/types.py": "from alpha.core import run\n\nThing = int\n",
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


def test_a_module_importing_itself_is_a_circle(tmp_path):
    files = {**CLEAN, "packages/alpha/src/alpha/types.py": "import alpha.types\n"}
    code, out = run(tree(tmp_path, files))
    assert code == 1 and "alpha: 1 modules in a circle: alpha.types" in out, out


def test_the_repository():
    """The check runs over this repository (what it finds fails `hatch run lint`)."""
    code, out = run()
    assert code in (0, 1) and "Traceback" not in out, out
