"""Entry-point registries: stage kinds (``omni.stages``), benchmarks (``omni.benchmarks``),
extra ``omni`` subcommands (``omni.commands``), execution backends (``omni.backends``)
and the families' named models (``omni.models``).

The index is built lazily from installed distributions' metadata; nothing is imported
until a name is asked for. Two distributions registering one name is an error that names
both; a plug-in that fails to import is an error that names the entry point and its
distribution.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

STAGES_GROUP = "omni.stages"
BENCHMARKS_GROUP = "omni.benchmarks"
COMMANDS_GROUP = "omni.commands"
BACKENDS_GROUP = "omni.backends"
MODELS_GROUP = "omni.models"
SECTIONS_GROUP = "omni.config_sections"


class RegistryError(LookupError):
    pass


@dataclass(frozen=True)
class Entry:
    name: str
    value: str  # "module:attr"
    distribution: str
    version: str

    def describe(self) -> str:
        return f"{self.name} = {self.value!r} from {self.distribution} {self.version}"


def _entry(ep: EntryPoint) -> Entry:
    dist = ep.dist
    return Entry(
        ep.name, ep.value, dist.name if dist else "<unknown>", dist.version if dist else "?"
    )


class Registry:
    """Names of one entry-point group, indexed on first use."""

    def __init__(self, group: str, what: str) -> None:
        self.group = group
        self.what = what
        self._index: dict[str, list[tuple[Entry, EntryPoint]]] | None = None
        self._loaded: dict[str, Any] = {}

    def _build(self) -> dict[str, list[tuple[Entry, EntryPoint]]]:
        if self._index is None:
            index: dict[str, list[tuple[Entry, EntryPoint]]] = {}
            for ep in entry_points(group=self.group):
                e = _entry(ep)
                same = index.setdefault(ep.name, [])
                # one distribution seen twice on sys.path is not a conflict
                if not any(
                    x.distribution == e.distribution and x.value == e.value for x, _ in same
                ):
                    same.append((e, ep))
            self._index = index
        return self._index

    def names(self) -> list[str]:
        return sorted(self._build())

    def entries(self) -> list[list[Entry]]:
        """Every name with the entries claiming it (more than one is a conflict)."""
        return [[e for e, _ in self._build()[n]] for n in self.names()]

    def entry(self, name: str) -> tuple[Entry, EntryPoint]:
        claims = self._build().get(name)
        if not claims:
            known = ", ".join(self.names()) or "none installed"
            raise RegistryError(
                f"unknown {self.what} {name!r} (entry-point group {self.group!r}); known: {known}"
            )
        if len(claims) > 1:
            who = "; ".join(e.describe() for e, _ in claims)
            raise RegistryError(
                f"{self.what} {name!r} is registered by more than one distribution: {who}"
            )
        return claims[0]

    def load(self, name: str) -> Any:
        if name in self._loaded:
            return self._loaded[name]
        e, ep = self.entry(name)
        try:
            obj = ep.load()
        except Exception as exc:  # any import-time failure of a plug-in
            raise RegistryError(
                f"{self.what} {name!r}: entry point {e.value!r} of distribution "
                f"{e.distribution} {e.version} failed to import: {type(exc).__name__}: {exc}"
            ) from exc
        self._loaded[name] = obj
        return obj


@functools.cache
def default_registry() -> Registry:
    return Registry(STAGES_GROUP, "stage kind")


@functools.cache
def benchmark_registry() -> Registry:
    return Registry(BENCHMARKS_GROUP, "benchmark")


@functools.cache
def command_registry() -> Registry:
    """Subcommands plug-ins add to ``omni``: each entry point is ``main(argv) -> int``."""
    return Registry(COMMANDS_GROUP, "command")


@functools.cache
def backend_registry() -> Registry:
    """Execution backends besides ``local``: each entry point is a factory taking the
    pipeline config and returning a :class:`~omni_core.client.backend.Backend`."""
    return Registry(BACKENDS_GROUP, "backend")


@functools.cache
def model_registry() -> Registry:
    """Named models by family: each entry point is a function returning that family's
    :class:`~omni_core.models.named_models.NamedModel` list."""
    return Registry(MODELS_GROUP, "model family")


@functools.cache
def config_section_registry() -> Registry:
    """Sections a family adds to a config's ``mrs:`` in the design doc's spelling (the
    entry point's name is the key, ``mrs.<name>``): each is a
    :data:`~omni_core.config_spelling.Section`."""
    return Registry(SECTIONS_GROUP, "config section")


def load_stage_class(kind: str) -> type:
    from omni_core.stage import Stage

    cls = default_registry().load(kind)
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        e, _ = default_registry().entry(kind)
        raise RegistryError(
            f"stage kind {kind!r}: entry point {e.value!r} of {e.distribution} is not a "
            "subclass of omni_core.Stage"
        )
    return cls
