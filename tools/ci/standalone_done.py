"""A pytest plug-in for CI's workspace run (``.ci/run``): with ``OMNI_STANDALONE_PASSED``
naming the file that ``tools/ci/standalone.py --passed FILE`` wrote, the tests listed there
(they passed in their package's own environment, installed from its wheel) are deselected,
so that each test runs once in CI. Everything else runs: ``integration_tests``,
``tools/*/tests``, and every package test that was skipped standalone because it needs
more than its family (the vLLM engine, torch in omni-core's tests, the DiT family in
omni-serve's).

Loaded with ``-p standalone_done`` on the command line (``tools/ci`` on ``PYTHONPATH``);
without the variable it does nothing, and so it does in a pytest session rooted elsewhere
(one that a test starts in a folder of its own). A listed id that the workspace run does
not collect is ignored.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def repo() -> Path:
    """The repository root (``OMNI_STANDALONE_REPO``, for this plug-in's own tests)."""
    return Path(os.environ.get("OMNI_STANDALONE_REPO") or Path(__file__).parents[2]).resolve()


def passed_ids(path: str | os.PathLike[str]) -> set[str]:
    return {line.strip() for line in Path(path).read_text().splitlines() if line.strip()}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = os.environ.get("OMNI_STANDALONE_PASSED")
    if not path or config.rootpath.resolve() != repo():
        return  # not CI's workspace run (a nested pytest a test starts is left alone)
    done = passed_ids(path)
    keep = [i for i in items if i.nodeid not in done]
    gone = [i for i in items if i.nodeid in done]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = keep
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(
            f"standalone_done: {len(gone)} tests deselected, passed standalone ({path}); "
            f"{len(keep)} run here"
        )
