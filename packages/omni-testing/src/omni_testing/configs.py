"""Config builders for tests and benchmarks."""

from __future__ import annotations

from typing import Any


def chain(*stages: tuple[Any, ...], edges: list[dict[str, Any]] | None = None, **top: Any) -> dict:
    """A config dict from ``(name, kind, options[, extra])`` tuples, chained unless ``edges``."""
    specs = []
    for s in stages:
        name, kind, options, *extra = s
        spec = {"name": name, "kind": kind, "options": options}
        if extra:
            spec.update(extra[0])
        specs.append(spec)
    if edges is None:
        edges = [
            {"from": a["name"], "to": b["name"]} for a, b in zip(specs, specs[1:], strict=False)
        ]
    return {"stages": specs, "edges": edges, **top}
