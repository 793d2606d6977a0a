"""Named models and ``omni models``: what each installed family can run by name, where
it is on disk, and one command that makes it ready.

A family registers a function under the entry-point group ``omni.models`` that returns
its :class:`NamedModel` list. ``omni models list`` shows them all (ready or not, where,
how big); ``omni models pull NAME`` fetches or builds one once (the only step that may
use the network: nothing is fetched when a pipeline runs), showing its progress: timed
lines for its steps, a bar for a loop of known length
(:class:`~omni_core.observability.progress.Reporter`; plain lines when the output is not
a terminal).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_core.observability.progress import Reporter
from omni_core.registry import RegistryError, model_registry


@dataclass(frozen=True)
class NamedModel:
    """A model ``omni models`` lists and pulls by name: a family's ``omni.models`` entry
    point returns a list of them."""

    name: str
    family: str  # the distribution that runs it
    about: str
    locate: Callable[[], Path | None]  # where it is when ready, else None
    # make it ready, reporting to the Reporter: ``report("what")`` for a step,
    # ``report.bar("what", total)`` for a loop of known length
    pull: Callable[[Reporter], Path]
    pulls: str  # what a pull does, in a few words


def installed_models() -> list[NamedModel]:
    """Every installed family's named models (a family that fails to load is an error
    naming it)."""
    reg = model_registry()
    found: list[NamedModel] = []
    for name in reg.names():
        found.extend(reg.load(name)())
    return sorted(found, key=lambda m: (m.family, m.name))


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _list(as_json: bool) -> int:
    rows: list[dict[str, Any]] = []
    for m in installed_models():
        path = m.locate()
        rows.append(
            {
                "name": m.name,
                "family": m.family,
                "ready": path is not None,
                "path": str(path) if path else None,
                "bytes": size_of(path) if path else None,
                "about": m.about,
                "pull": m.pulls,
            }
        )
    if as_json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no named models: install a stage family (omni-ar-stages, omni-dit-stages)")
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        if r["ready"]:
            state = f"ready  {_human(r['bytes']):>9}  {r['path']}"
        else:
            state = f"not pulled (omni models pull {r['name']}: {r['pull']})"
        print(f"{r['name']:<{width}}  {r['family']:<16} {state}")
        print(f"{'':<{width}}  {r['about']}")
    return 0


def _pull(name: str) -> int:
    models = {m.name: m for m in installed_models()}
    if name not in models:
        known = ", ".join(sorted(models)) or "none installed"
        print(f"omni models pull: unknown model {name!r}; known: {known}", file=sys.stderr)
        return 2
    m = models[name]
    report = Reporter(name)  # on stdout: a bar on a terminal, timed lines otherwise

    if (path := m.locate()) is not None:
        report(f"ready at {path}")
        return 0
    try:
        path = m.pull(report)
    except Exception as e:  # noqa: BLE001 - a failed pull says what and why, then exits 1
        print(f"omni models pull {name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    report(f"ready at {path} ({_human(size_of(path))})")
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="omni models", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="action")
    p = sub.add_parser("list", help="the named models, ready or not, where, how big")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("pull", help="fetch or build a named model once")
    p.add_argument("name")
    args = ap.parse_args(argv)
    try:
        if args.action == "pull":
            return _pull(args.name)
        return _list(getattr(args, "json", False))
    except RegistryError as e:
        print(f"omni models: {e}", file=sys.stderr)
        return 2
