"""Run inside a standalone virtual environment (``python -P standalone_probe.py DIST ...``)
by ``tools/ci/standalone.py``: is the installed distribution DIST whole on its own?

1. Every module DIST installs is imported (``--skip MODULE``
   names one that needs an extra this environment does not have). An import that fails
   means DIST imports something its metadata does not bring.
2. Each imported module's file must lie in this environment (``sys.prefix``), not in the
   workspace's ``packages/*/src``: the test is of the wheel, not of the source tree.
3. Every ``import X`` in DIST's source (top level or nested) whose X belongs to an
   installed distribution must name DIST itself or a distribution DIST declares (in its
   dependencies or any extra): not one that merely came along with another.

Prints one JSON object (``{"modules": [...], "skipped": {...}, "errors": [...]}``) on
its last line and exits 1 when ``errors`` is not empty. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata as md
import json
import os
import re
import sys


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    """The distribution a requirement string names (``'torch==2.13.0; extra == "x"'`` ->
    ``torch``)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise ValueError(f"not a requirement: {req!r}")
    return normalize(m.group(1))


def module_name(relpath: str) -> str | None:
    """The module a file installed at ``relpath`` (relative to site-packages) is, or None
    when it is not a Python module (``pkg/sub/mod.py`` -> ``pkg.sub.mod``,
    ``pkg/__init__.py`` -> ``pkg``; files under ``*.dist-info`` or ``bin/`` are none)."""
    parts = relpath.replace("\\", "/").split("/")
    if not parts[-1].endswith(".py") or parts[0].endswith((".dist-info", ".data")):
        return None
    if parts[0] in ("..", "bin") or any(not p.isidentifier() for p in parts[:-1]):
        return None
    stem = parts[-1][:-3]
    if not stem.isidentifier():
        return None
    return ".".join(parts[:-1] if stem == "__init__" else [*parts[:-1], stem])


def imported_names(source: str) -> set[str]:
    """Top-level names of the absolute imports anywhere in ``source`` (relative imports are
    of the module's own package, so they are left out)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dist")
    ap.add_argument("--skip", action="append", default=[], metavar="MODULE=REASON")
    args = ap.parse_args(argv)
    skip = dict(s.split("=", 1) if "=" in s else (s, "") for s in args.skip)

    dist = md.distribution(args.dist)
    own = normalize(dist.metadata["Name"])
    declared = {requirement_name(r) for r in dist.requires or []}
    owners = md.packages_distributions()  # import name -> distributions providing it
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    prefix = os.path.realpath(sys.prefix)

    errors: list[str] = []
    modules: list[str] = []
    skipped: dict[str, str] = {}
    own_top: set[str] = set()
    for f in dist.files or []:
        mod = module_name(str(f))
        if mod is None:
            continue
        own_top.add(mod.split(".")[0])
        path = os.path.realpath(f.locate())
        if not path.startswith(prefix + os.sep):
            errors.append(f"{mod}: installed at {path}, outside this environment {prefix}")
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        for name in sorted(imported_names(source)):
            if name in stdlib or name in own_top or name == mod.split(".")[0]:
                continue
            providers = {normalize(d) for d in owners.get(name, [])}
            if not providers:
                continue  # not installed here: an optional import, or an extra not asked for
            if own in providers or providers & declared:
                continue
            errors.append(
                f"{mod} imports {name!r} (from {', '.join(sorted(providers))}), which "
                f"{own} does not declare"
            )
        if any(mod == s or mod.startswith(s + ".") for s in skip):
            skipped[mod] = next(r for s, r in skip.items() if mod == s or mod.startswith(s + "."))
            continue
        modules.append(mod)

    for mod in sorted(modules):
        try:
            m = importlib.import_module(mod)
        except BaseException as e:  # noqa: BLE001 - any failure to import is the finding
            errors.append(f"import {mod} failed: {type(e).__name__}: {e}")
            continue
        file = getattr(m, "__file__", None)
        if file and not os.path.realpath(file).startswith(prefix + os.sep):
            errors.append(f"import {mod} came from {file}, outside this environment {prefix}")

    print(json.dumps({"modules": sorted(modules), "skipped": skipped, "errors": errors}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
