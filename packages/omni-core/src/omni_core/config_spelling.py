"""The MRS design doc's spelling of a pipeline config (its section 11 and example YAML),
rewritten into omni's canonical spelling before the config is validated.

=================================  ===============================================
design doc                         omni
=================================  ===============================================
``mrs.defaults.window_size: N``    ``mrs.defaults.window: {size: N}``
``edges[].window_size: N``         ``edges[].window: {size: N}``
``mrs.stages: [{name, ...}]``      the keys merged into ``stages[]`` of that name
                                   (an entry with a ``kind`` may add a stage)
``mrs.stages[].process: true``     nothing (every stage is its own process)
``mrs.edges: [{from, to, ...}]``   the keys merged into ``edges[]`` of that pair
                                   (else a new edge)
``mrs.<section>: {...}``           what the family that registered ``<section>``
                                   under ``omni.config_sections`` makes of it (the AR
                                   family's ``mrs.ar``: :mod:`omni_ar.config_section`)
=================================  ===============================================

Every error names the key as the user wrote it; :meth:`Spelling.written` maps a
canonical key path back to it, so that errors found after the rewrite do too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

OptionNames = Callable[[str], "frozenset[str] | None"]
"""The option keys a stage kind takes (empty: unknown kind; None: kinds are not checked)."""
Section = Callable[[Any, "Spelling", OptionNames], None]
"""A family's ``mrs.<name>`` section: ``apply(value, spelling, option_names)`` rewrites
``spelling.data`` into omni's keys, records each key it set in ``spelling.origins`` and
raises :class:`SpellingError` naming the key as written."""


class SpellingError(ValueError):
    """A key of the design doc's spelling that omni cannot take: ``path`` as written."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass
class Spelling:
    """A config in the canonical spelling, and where its rewritten keys were written."""

    data: dict[str, Any]
    origins: dict[str, str] = field(default_factory=dict)
    """canonical key path -> the key path as written (only for keys the rewrite moved)"""

    def written(self, path: str) -> str:
        """``path`` (canonical) as the user wrote it: its longest rewritten prefix mapped."""
        for end in sorted(_prefix_ends(path), reverse=True):
            origin = self.origins.get(path[:end])
            if origin is not None:
                return origin + path[end:]
        return path


def _prefix_ends(path: str) -> list[int]:
    """Where ``path``'s prefixes end: before each ``.key`` and ``[i]``, and at its end."""
    return [m.start() for m in re.finditer(r"[.\[]", path)] + [len(path)]


def canonical_spelling(
    data: dict[str, Any],
    option_names: OptionNames,
    sections: Callable[[str], Section | None] = lambda name: None,
) -> Spelling:
    """``data`` (a parsed config) with the design doc's keys rewritten into omni's.
    ``option_names(kind)``: the option keys a stage kind takes. ``sections(name)``: the
    installed family's handler of ``mrs.<name>``, or None (the key is left to the
    config's own check). Raises :class:`SpellingError` for a key omni does not support
    or set twice."""
    out = Spelling(dict(data))
    mrs = data.get("mrs")
    if not isinstance(mrs, dict):
        _edges_window_size(out, "edges")
        return out
    mrs = dict(mrs)
    defaults = mrs.get("defaults")
    if isinstance(defaults, dict):
        mrs["defaults"] = _window_size(defaults, "mrs.defaults", "mrs.defaults", out.origins)
    doc_stages, doc_edges = mrs.pop("stages", None), mrs.pop("edges", None)
    handled = [(name, handler, mrs.pop(name)) for name in list(mrs) if (handler := sections(name))]
    if mrs:
        out.data["mrs"] = mrs
    else:
        del out.data["mrs"]
    _edges_window_size(out, "edges")
    if doc_stages is not None:
        _merge(out, "stages", doc_stages, "mrs.stages", ("name",), _stage_entry)
    if doc_edges is not None:
        _merge(out, "edges", doc_edges, "mrs.edges", ("from", "to"), _edge_entry)
    for _, handler, value in handled:
        handler(value, out, option_names)
    return out


def _window_size(
    entry: dict[str, Any], written: str, canonical: str, origins: dict[str, str]
) -> dict[str, Any]:
    """``entry`` with ``window_size: N`` as ``window: {size: N}``."""
    if "window_size" not in entry:
        return entry
    entry = dict(entry)
    size = entry.pop("window_size")
    window = entry.get("window")
    if window is not None and not (isinstance(window, dict) and "size" not in window):
        both = f"{written}.window" + (".size" if isinstance(window, dict) else "")
        raise SpellingError(
            f"{written}.window_size",
            f"the window size is set twice, here and as {both}: keep one "
            f"({written}.window.size is omni's spelling)",
        )
    entry["window"] = {"size": size, **(window or {})}
    origins[f"{canonical}.window.size"] = f"{written}.window_size"
    return entry


def _edges_window_size(out: Spelling, key: str) -> None:
    edges = out.data.get(key)
    if isinstance(edges, list):
        out.data[key] = [
            _window_size(e, f"{key}[{i}]", f"{key}[{i}]", out.origins) if isinstance(e, dict) else e
            for i, e in enumerate(edges)
        ]


def _stage_entry(entry: dict[str, Any], written: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A ``mrs.stages`` entry in omni's keys (``process`` checked and dropped)."""
    entry = dict(entry)
    if "process" in entry:
        process = entry.pop("process")
        if process is False:
            raise SpellingError(
                f"{written}.process",
                "a stage outside a worker process of its own is not supported: remove "
                "`process: false` (every stage runs in its own process), or write "
                "`mrs.enabled: false` to run every stage in the caller's process",
            )
        if process is not True:
            raise SpellingError(f"{written}.process", f"expected true, got {process!r}")
    return entry, {}


def _edge_entry(entry: dict[str, Any], written: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A ``mrs.edges`` entry in omni's keys; its moved keys relative to the entry."""
    origins: dict[str, str] = {}
    return _window_size(entry, written, "", origins), origins


EntryRewrite = Callable[[dict[str, Any], str], tuple[dict[str, Any], dict[str, str]]]


def _merge(
    out: Spelling,
    key: str,
    doc: Any,
    doc_key: str,
    fields: tuple[str, ...],
    rewrite: EntryRewrite,
) -> None:
    """Each entry of ``mrs.<key>`` merged into the ``<key>`` entry it names (by its
    ``fields``), else appended; a key set in both is an error naming both."""
    if not isinstance(doc, list):
        raise SpellingError(doc_key, f"expected a list, got {type(doc).__name__}")
    merged = out.data.get(key)
    merged = list(merged) if isinstance(merged, list) else []
    index: dict[Hashable, int] = {}
    for i, e in enumerate(merged):
        if isinstance(e, dict):
            index.setdefault(_identity(e, fields), i)
    seen: dict[Hashable, int] = {}
    for k, raw in enumerate(doc):
        written = f"{doc_key}[{k}]"
        if not isinstance(raw, dict):
            raise SpellingError(written, f"expected a mapping, got {type(raw).__name__}")
        for f in fields:
            if f not in raw:
                raise SpellingError(f"{written}.{f}", "required key is missing")
            if not isinstance(raw[f], str):
                raise SpellingError(f"{written}.{f}", f"expected a stage name, got {raw[f]!r}")
        ident = _identity(raw, fields)
        if ident in seen:
            raise SpellingError(
                written, f"{_show(raw, fields)} again (first at {doc_key}[{seen[ident]}])"
            )
        seen[ident] = k
        entry, moved = rewrite(raw, written)
        i = index.get(ident)
        if i is None:
            if key == "stages" and "kind" not in entry:
                raise SpellingError(written, _no_stage(raw["name"], written, bool(merged)))
            i = index[ident] = len(merged)
            merged.append(entry)
            out.origins[f"{key}[{i}]"] = written
        else:
            target = dict(merged[i])
            for name, value in entry.items():
                if name in fields:
                    continue
                if name in target:
                    mine = moved.get(f".{name}.size", f"{written}.{name}")
                    raise SpellingError(
                        mine,
                        f"set twice, here and as {key}[{i}].{name}: keep one "
                        f"({key}[{i}].{name} is omni's spelling)",
                    )
                target[name] = value
                out.origins[f"{key}[{i}].{name}"] = f"{written}.{name}"
            merged[i] = target
        for rel, origin in moved.items():
            out.origins[f"{key}[{i}]{rel}"] = origin
    out.data[key] = merged


def _identity(entry: dict[str, Any], fields: tuple[str, ...]) -> Hashable:
    return tuple(str(entry.get(f)) for f in fields)


def _show(entry: dict[str, Any], fields: tuple[str, ...]) -> str:
    return " -> ".join(repr(entry[f]) for f in fields)


def _no_stage(name: str, written: str, has_stages: bool) -> str:
    where = "no stage of `stages` has that name" if has_stages else "the config has no `stages`"
    return (
        f"stage {name!r} is not defined ({where}); {written} gives a stage's process "
        "settings (devices, extra_env): define the stage under `stages` "
        f"(`- {{name: {name}, kind: KIND}}`), or add `kind: KIND` to this entry (KIND: "
        "a stage kind listed by `omni stages`)"
    )
