#!/usr/bin/env python3
"""No import circle inside a distribution, no use of another distribution's private names,
no plug-in reaching into the runtime.

    python3 tools/ci/check_imports.py            # this repository (run by `hatch run lint`)
    python3 tools/ci/check_imports.py --root DIR # another tree of the same layout

A distribution is a folder ``packages/*``, ``tools/*`` or ``examples/*`` with a ``src``;
the top-level modules under its ``src`` are its own. Every module is read with :mod:`ast`
(nothing is imported). Three checks:

* **Circles.** The module graph of each distribution: an edge for every import of a module
  of the same distribution, at module level or inside a function (a lazy import that only
  hides a circle is still one) or under ``if TYPE_CHECKING:`` (a circle for the type
  checker is one a reader follows too; a protocol breaks it). ``from P import n``
  is an edge to ``P.n`` where that is a module, else to ``P``. Importing ``P.m`` is an edge
  to ``P.m`` alone (not to ``P``, which Python runs first: a package's ``__init__`` that
  imports its submodules would otherwise be in a circle with each of them). Every strongly
  connected component of more than one module (or a module importing itself) is reported,
  with one circle through it and where each of its imports is.
* **Private names.** ``from X import _n``, ``import X._m``, and ``X._n`` through a name
  bound by an import, where ``X`` is a module of another distribution: a private name
  (one leading underscore, not a dunder) anywhere in the path.
* **The plug-in surface.** A distribution whose ``pyproject.toml`` lists
  ``[tool.omni] public-modules`` (omni-core: ``omni_core`` and ``omni_core.plugin``) is a
  runtime: its other modules are internal. A plug-in (a distribution registering
  ``omni.stages`` or ``omni.models`` entry points) imports none of them, lazily or not,
  unless its ``pyproject.toml`` says why it must (``[tool.omni] runtime-internals =
  "..."``: test support that drives the runtime's insides).

Exits 1 with the report when it finds anything, 0 when the tree is clean.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIST_GLOBS = ("packages/*/src", "tools/*/src", "examples/*/src")
PLUGIN_GROUPS = ("omni.stages", "omni.models")


@dataclass(frozen=True)
class Import:
    """One import of ``target`` (a dotted module or module.name) at ``line``."""

    target: str
    line: int


@dataclass
class Module:
    name: str
    path: Path
    dist: str
    is_package: bool
    imports: list[Import] = field(default_factory=list)
    private_uses: list[Import] = field(default_factory=list)  # dotted names, last part private


@dataclass(frozen=True)
class Finding:
    kind: str  # "circle" | "private" | "internal"
    text: str


@dataclass(frozen=True)
class Distribution:
    """What a distribution's ``pyproject.toml`` says about its imports."""

    public_modules: frozenset[str] = frozenset()  # a runtime's public modules
    plugin: bool = False  # it registers omni.stages or omni.models entry points
    internals_why: str = ""  # why this plug-in may use a runtime's internals


def distributions(root: Path) -> dict[str, Distribution]:
    """Each distribution's :class:`Distribution`, by folder name."""
    out: dict[str, Distribution] = {}
    for pattern in DIST_GLOBS:
        for src in sorted(root.glob(pattern)):
            path = src.parent / "pyproject.toml"
            meta = tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
            omni = meta.get("tool", {}).get("omni", {})
            groups = meta.get("project", {}).get("entry-points", {})
            out[src.parent.name] = Distribution(
                public_modules=frozenset(omni.get("public-modules", ())),
                plugin=any(g in groups for g in PLUGIN_GROUPS),
                internals_why=omni.get("runtime-internals", ""),
            )
    return out


def is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def discover(root: Path) -> dict[str, Module]:
    """Every module under the distributions' ``src`` folders, by dotted name."""
    modules: dict[str, Module] = {}
    for pattern in DIST_GLOBS:
        for src in sorted(root.glob(pattern)):
            dist = src.parent.name
            for path in sorted(src.rglob("*.py")):
                parts = list(path.relative_to(src).with_suffix("").parts)
                is_package = parts[-1] == "__init__"
                if is_package:
                    parts.pop()
                if parts:
                    name = ".".join(parts)
                    modules[name] = Module(name, path, dist, is_package)
    return modules


def _absolute(module: Module, level: int, name: str | None) -> str:
    """A relative import's module, absolute."""
    if not level:
        return name or ""
    parts = module.name.split(".")
    base = parts if module.is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def read(module: Module, modules: dict[str, Module]) -> None:
    """Fill ``module.imports`` and ``module.private_uses`` from its source."""
    tree = ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))
    bound: dict[str, str] = {}  # a local name -> the module it stands for
    nodes = list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                module.imports.append(Import(alias.name, node.lineno))
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node.level, node.module)
            for alias in node.names:
                if alias.name == "*":
                    module.imports.append(Import(base, node.lineno))
                    continue
                full = f"{base}.{alias.name}"
                module.imports.append(Import(full if full in modules else base, node.lineno))
                if is_private(alias.name):
                    module.private_uses.append(Import(full, node.lineno))
                if full in modules:
                    bound[alias.asname or alias.name] = full
    for node in nodes:
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            chain = _dotted(node.value)
            if chain is not None and chain[0] in bound:
                target = ".".join([bound[chain[0]], *chain[1:]])
                module.private_uses.append(Import(f"{target}.{node.attr}", node.lineno))


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _owner(dotted: str, modules: dict[str, Module]) -> Module | None:
    """The module ``dotted`` names, or the longest module prefix of it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        found = modules.get(".".join(parts[:n]))
        if found is not None:
            return found
    return None


def _foreign_private(use: Import, importer: Module, modules: dict[str, Module]) -> bool:
    owner = _owner(use.target, modules)
    return (
        owner is not None
        and owner.dist != importer.dist
        and any(is_private(p) for p in use.target.split("."))
    )


def private_findings(modules: dict[str, Module]) -> list[Finding]:
    out = []
    for m in modules.values():
        uses = {u for u in [*m.private_uses, *m.imports] if _foreign_private(u, m, modules)}
        for use in sorted(uses, key=lambda u: (u.line, u.target)):
            # ``from X._m import _n``: one finding, the longest name of the line
            if any(o.line == use.line and o.target.startswith(f"{use.target}.") for o in uses):
                continue
            owner = _owner(use.target, modules)
            assert owner is not None
            out.append(
                Finding(
                    "private",
                    f"{m.path}:{use.line}: {m.name} ({m.dist}) uses {use.target}, "
                    f"a private name of {owner.dist}",
                )
            )
    return out


def internal_findings(modules: dict[str, Module], dists: dict[str, Distribution]) -> list[Finding]:
    """A plug-in's imports of a runtime's modules outside its ``public-modules``."""
    out = []
    for m in modules.values():
        here = dists.get(m.dist, Distribution())
        if not here.plugin or here.internals_why:
            continue
        seen: set[tuple[int, str]] = set()
        for imp in m.imports:
            owner = _owner(imp.target, modules)
            if owner is None or owner.dist == m.dist:
                continue
            public = dists.get(owner.dist, Distribution()).public_modules
            if not public or owner.name in public or (imp.line, owner.name) in seen:
                continue
            seen.add((imp.line, owner.name))
            listed = ", ".join(sorted(public))
            out.append(
                Finding(
                    "internal",
                    f"{m.path}:{imp.line}: {m.name} ({m.dist}, a plug-in) imports "
                    f"{owner.name}, internal to {owner.dist} (a plug-in may import {listed})",
                )
            )
    return out


def graph(modules: dict[str, Module]) -> dict[str, dict[str, int]]:
    """module -> {module of the same distribution it imports: the first line}."""
    edges: dict[str, dict[str, int]] = {name: {} for name in modules}
    for m in modules.values():
        for imp in m.imports:
            target = modules.get(imp.target)
            if target is not None and target.dist == m.dist:
                first = edges[m.name].get(target.name, imp.line)
                edges[m.name][target.name] = min(first, imp.line)
    return edges


def components(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    out.append(sorted(comp))
    return out


def _circle(comp: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """One circle through the component's first module (a shortest one)."""
    start, members = comp[0], set(comp)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(edges[node]):
            if child == start:
                return [*paths[node], start]
            if child in members and child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    return [start, start]


def circle_findings(modules: dict[str, Module]) -> list[Finding]:
    edges = graph(modules)
    out = []
    for comp in components(edges):
        if len(comp) == 1 and comp[0] not in edges[comp[0]]:
            continue
        circle = _circle(comp, edges)
        steps = "\n".join(
            f"    {modules[a].path}:{edges[a][b]}: {a} imports {b}"
            for a, b in zip(circle, circle[1:], strict=False)
        )
        text = (
            f"{modules[comp[0]].dist}: {len(comp)} modules in a circle: {', '.join(comp)}\n"
            f"  e.g. {' -> '.join(circle)}\n{steps}"
        )
        out.append(Finding("circle", text))
    return out


def check(root: Path) -> list[Finding]:
    modules = discover(root)
    for m in modules.values():
        read(m, modules)
    dists = distributions(root)
    return circle_findings(modules) + private_findings(modules) + internal_findings(modules, dists)


def report(findings: list[Finding], root: Path) -> str:
    circles = [f.text for f in findings if f.kind == "circle"]
    private = [f.text for f in findings if f.kind == "private"]
    internal = [f.text for f in findings if f.kind == "internal"]
    lines = []
    if circles:
        lines.append(f"import circles inside a distribution ({len(circles)}):")
        lines += [f"  {c}" for c in circles]
    if private:
        lines.append(f"imports of another distribution's private names ({len(private)}):")
        lines += [f"  {p}" for p in private]
    if internal:
        lines.append(f"plug-ins importing a runtime's internal modules ({len(internal)}):")
        lines += [f"  {i}" for i in internal]
    return "\n".join(lines).replace(f"{root}/", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    findings = check(root)
    if findings:
        print(report(findings, root))
        return 1
    print(
        "imports: no circle inside a distribution, no private name of another one, "
        "no plug-in importing the runtime's internals"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
