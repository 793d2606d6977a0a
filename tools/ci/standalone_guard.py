"""A pytest plug-in that ``tools/ci/standalone.py`` loads (``-p standalone_guard``) when it
runs a package's tests in a standalone virtual environment.

- At the end of the session, any module imported from the workspace's source tree
  (``packages/*/src``, ``tools/*/src``) instead of the installed wheel fails the run.
  ``OMNI_STANDALONE_REPO`` is the repository root.
- With ``OMNI_STANDALONE_PASSED`` set to a file, the node id of every test that passed
  (set-up, call and tear-down) is appended to it, one a line: ``standalone_done`` reads it
  to leave those tests out of the workspace run that follows in CI.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def shadowed(repo: Path, modules: dict[str, object]) -> list[str]:
    """``name: file`` of each module in ``modules`` whose file lies in a ``src`` folder of
    one of the repository's distributions."""
    roots = [
        str(p.resolve()) + os.sep for p in [*repo.glob("packages/*/src"), *repo.glob("tools/*/src")]
    ]
    found = []
    for name, mod in list(modules.items()):
        file = getattr(mod, "__file__", None)
        if isinstance(file, str) and any(os.path.realpath(file).startswith(r) for r in roots):
            found.append(f"{name}: {file}")
    return sorted(found)


_passed: dict[str, bool] = {}  # node id -> every phase so far passed


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    ok = report.passed and not hasattr(report, "wasxfail")
    if report.when == "call":
        _passed[report.nodeid] = _passed.get(report.nodeid, True) and ok
    elif not ok:
        _passed[report.nodeid] = False  # set-up skipped or failed, or tear-down failed
    elif report.when == "setup":
        _passed.setdefault(report.nodeid, True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    passed_file = os.environ.get("OMNI_STANDALONE_PASSED")
    if passed_file:
        with open(passed_file, "a", encoding="utf-8") as f:
            f.writelines(f"{nodeid}\n" for nodeid, ok in _passed.items() if ok)
    repo = os.environ.get("OMNI_STANDALONE_REPO")
    if not repo:
        return
    bad = shadowed(Path(repo), sys.modules)
    if bad:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = "modules imported from the source tree, not the installed wheel:\n  "
        msg += "\n  ".join(bad)
        if tr is not None:
            tr.write_line(f"standalone_guard: {msg}", red=True)
        else:
            print(f"standalone_guard: {msg}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
