"""Pipeline configuration: the YAML schema, and its validation with errors that say where.

Every error names the file, the key path (``stages[1].max_inflight``) and what was expected.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from omni_core.serial import DEFAULT_SHM_THRESHOLD

NAME_RE = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
DEVICES_RE = re.compile(r"^\d+(,\d+)*$")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class ConfigError(ValueError):
    """A pipeline configuration is invalid; the message names file, key path and expectation."""


class _Spec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class WindowSpec(_Spec, kw_only=True):
    size: int = -1
    overlap: Annotated[int, msgspec.Meta(ge=0)] = 0


class Defaults(_Spec, kw_only=True):
    window: WindowSpec = msgspec.field(default_factory=WindowSpec)
    max_inflight: PositiveInt = 1
    max_batch_size: PositiveInt = 1
    queue_capacity: PositiveInt = 64  # work items a stage holds; also the socket watermark


class MRS(_Spec, kw_only=True):
    enabled: bool = True
    defaults: Defaults = msgspec.field(default_factory=Defaults)


class Placement(_Spec, kw_only=True):
    """Where a stage's worker may run on a cluster backend (Ray): the resources its actor
    asks for. The local backend ignores it (``devices`` says which GPUs a worker sees)."""

    # CPUs held in Ray's accounting; 0 (the default) lets stages share a node's CPUs, as
    # the local backend's processes do: set it (or resources) to spread stages out
    num_cpus: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    num_gpus: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    resources: dict[str, Annotated[float, msgspec.Meta(gt=0)]] = msgspec.field(
        default_factory=dict
    )  # custom resources, e.g. {"node_b": 1} to land on the node that offers it
    node_labels: dict[str, str] = msgspec.field(default_factory=dict)  # label selector


class BackendSpec(_Spec, kw_only=True):
    """Where the stage workers run: ``local`` processes, or a ``ray`` cluster."""

    kind: Annotated[str, msgspec.Meta(pattern=NAME_RE)] = "local"
    address: str | None = None  # ray: the cluster to join (None: RAY_ADDRESS or a new one)
    namespace: str | None = None  # ray: the namespace of the pipeline's actors


class StageSpec(_Spec, kw_only=True):
    name: Annotated[str, msgspec.Meta(pattern=NAME_RE)]
    kind: str
    devices: str | Annotated[int, msgspec.Meta(ge=0)] | None = None
    extra_env: dict[str, str] = msgspec.field(default_factory=dict)
    max_inflight: PositiveInt | None = None
    max_batch_size: PositiveInt | None = None
    queue_capacity: PositiveInt | None = None
    # stream this stage's events to the caller (sinks do); "previews": only its previews
    # (image events before the last), which then go to the caller and not downstream
    client_stream: bool | Literal["previews"] | None = None
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = 3  # then the stage is dead
    restart_backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 0.5  # doubles per restart
    restart_window_s: PositiveFloat = 600.0  # max_restarts counts restarts within this
    # a stage busy on one step (or silent) this long is hung: killed and restarted
    stall_timeout_s: PositiveFloat | None = 300.0
    placement: Placement = msgspec.field(default_factory=Placement)
    options: dict[str, Any] = msgspec.field(default_factory=dict)


class EdgeSpec(_Spec, kw_only=True):
    source: str = msgspec.field(name="from")
    target: str = msgspec.field(name="to")
    window: WindowSpec | None = None
    capacity: PositiveInt | None = (
        None  # frames in flight on this edge (default: target's queue_capacity)
    )


class PipelineConfig(_Spec, kw_only=True):
    name: str = "pipeline"
    mrs: MRS = msgspec.field(default_factory=MRS)
    backend: BackendSpec = msgspec.field(default_factory=BackendSpec)
    stages: Annotated[list[StageSpec], msgspec.Meta(min_length=1)]
    edges: list[EdgeSpec] = msgspec.field(default_factory=list)
    shm_threshold_bytes: Annotated[int, msgspec.Meta(ge=0)] = DEFAULT_SHM_THRESHOLD
    shm_pool_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 1 << 30
    ready_timeout_s: PositiveFloat = 120.0
    heartbeat_interval_s: PositiveFloat = 0.5
    request_timeout_s: PositiveFloat | None = None
    # open requests past which submit raises OverloadedError (HTTP 429); None: no cap
    max_queued_requests: PositiveInt | None = 4096
    trace: bool = False  # record every trigger and emitted event (omni trace)
    source_file: str = ""  # set by the loader; not read from YAML

    def with_backend(self, kind: str | None, address: str | None) -> PipelineConfig:
        """This config with ``kind`` / ``address`` (those not None) over ``backend:``."""
        if kind is None and address is None:
            return self
        backend = msgspec.structs.replace(
            self.backend,
            kind=kind if kind is not None else self.backend.kind,
            address=address if address is not None else self.backend.address,
        )
        return msgspec.structs.replace(self, backend=backend)

    # -- resolved views ---------------------------------------------------------
    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def inbound(self, name: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.target == name]

    def outbound(self, name: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.source == name]

    def sources(self) -> list[str]:
        return [s.name for s in self.stages if not self.inbound(s.name)]

    def sinks(self) -> list[str]:
        return [s.name for s in self.stages if not self.outbound(s.name)]

    def window(self, edge: EdgeSpec) -> WindowSpec:
        return edge.window or self.mrs.defaults.window

    def setting(self, stage: StageSpec, key: str) -> Any:
        value = getattr(stage, key)
        return getattr(self.mrs.defaults, key) if value is None else value

    def streams_to_client(self, stage: StageSpec) -> bool:
        """Every event of ``stage`` goes to the caller."""
        if stage.client_stream is None:
            return not self.outbound(stage.name)
        return stage.client_stream is True

    def client_streams(self) -> list[str]:
        return [s.name for s in self.stages if self.streams_to_client(s)]

    def preview_streams(self) -> list[str]:
        """Stages whose previews go to the caller (and only there)."""
        return [s.name for s in self.stages if s.client_stream == "previews"]

    def topological_order(self) -> list[str]:
        order, seen = [], set()
        pending = {s.name: {e.source for e in self.inbound(s.name)} for s in self.stages}
        while pending:
            ready = [n for n, deps in pending.items() if deps <= seen]
            if not ready:
                raise ConfigError(f"{self.source_file or '<config>'}: edges: contain a cycle")
            for n in ready:
                order.append(n)
                seen.add(n)
                del pending[n]
        return order


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _explain(e: msgspec.ValidationError, word: str) -> tuple[str, str]:
    """(key path below ``$``, message) of a msgspec validation error, in our words."""
    m = _AT.match(str(e))
    assert m is not None
    msg, path = m.group("msg"), m.group("path") or ""
    field = re.search(r"unknown field `([^`]+)`", msg)
    if field:
        return f"{path}.{field.group(1)}", f"unknown {word}"
    missing = re.search(r"missing required field `([^`]+)`", msg)
    if missing:
        return f"{path}.{missing.group(1)}", f"required {word} is missing"
    return path, msg


def _where(path: str) -> str:
    return path.lstrip(".") or "<top>"


def _fail(source: str, path: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: {message}")


def parse_config(data: Any, source: str = "<config>", check_kinds: bool = True) -> PipelineConfig:
    """Validate already-parsed YAML/JSON data into a :class:`PipelineConfig`."""
    if not isinstance(data, dict):
        raise _fail(source, "<top>", f"expected a mapping, got {type(data).__name__}")
    # top-level `x-...` keys are free: a place for YAML anchors shared by several stages
    data = {k: v for k, v in data.items() if not (isinstance(k, str) and k.startswith("x-"))}
    try:
        cfg = msgspec.convert(data, PipelineConfig)
    except msgspec.ValidationError as e:
        path, msg = _explain(e, "key")
        raise _fail(source, _where(path), msg) from None
    cfg.source_file = source
    _check(cfg, source, check_kinds)
    return cfg


def load_config(path: str | os.PathLike[str], check_kinds: bool = True) -> PipelineConfig:
    """Read and validate a pipeline YAML file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: cannot read: not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<yaml>"
        raise ConfigError(f"{p}: {where}: invalid YAML: {getattr(e, 'problem', e)}") from None
    return parse_config(expand_env(data, str(p)), str(p), check_kinds)


_ENV_REF = re.compile(r"\$\$\{|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


def expand_env(data: Any, source: str = "<config>", path: str = "") -> Any:
    """``${NAME}`` and ``${NAME:-default}`` in the string values of a config, from the
    environment (a model directory given per machine); as in a shell, the default also
    stands for a variable that is set but empty. An unset variable without a default is
    an error naming it and where it is used. ``$${`` is a literal ``${``. Values stay
    strings; top-level ``x-`` keys (anchors only) are left alone."""
    if isinstance(data, dict):
        return {
            k: v if not path and str(k).startswith("x-") else expand_env(v, source, f"{path}.{k}")
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [expand_env(v, source, f"{path}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, str) or "${" not in data:
        return data

    def value(m: re.Match[str]) -> str:
        name, default = m.group("name"), m.group("default")
        if name is None:  # $${
            return "${"
        found = os.environ.get(name)
        if default is not None and not found:
            return default
        if found is None:
            raise _fail(
                source,
                _where(path),
                f"environment variable {name} is not set (and no ${{{name}:-default}} is given)",
            )
        return found

    return _ENV_REF.sub(value, data)


def _check(cfg: PipelineConfig, src: str, check_kinds: bool) -> None:
    names: dict[str, int] = {}
    for i, s in enumerate(cfg.stages):
        if s.name in names:
            raise _fail(
                src,
                f"stages[{i}].name",
                f"duplicate stage name {s.name!r} (first at stages[{names[s.name]}])",
            )
        names[s.name] = i
        if isinstance(s.devices, str) and s.devices != "cpu" and not DEVICES_RE.match(s.devices):
            raise _fail(
                src,
                f"stages[{i}].devices",
                f'expected a device list like "0" or "1,2", a logical index, or "cpu"; '
                f"got {s.devices!r}",
            )
    known = ", ".join(names)
    seen_edges: dict[tuple[str, str], int] = {}
    for i, e in enumerate(cfg.edges):
        for key, value in (("from", e.source), ("to", e.target)):
            if value not in names:
                raise _fail(
                    src, f"edges[{i}].{key}", f"unknown stage {value!r}; stages are: {known}"
                )
        if e.source == e.target:
            raise _fail(src, f"edges[{i}]", f"stage {e.source!r} cannot feed itself")
        if (e.source, e.target) in seen_edges:
            raise _fail(
                src,
                f"edges[{i}]",
                f"duplicate edge {e.source} -> {e.target} "
                f"(first at edges[{seen_edges[e.source, e.target]}])",
            )
        seen_edges[e.source, e.target] = i
    _check_window(cfg.mrs.defaults.window, src, "mrs.defaults.window")
    for i, e in enumerate(cfg.edges):
        if e.window is not None:
            _check_window(e.window, src, f"edges[{i}].window")
    _check_acyclic(cfg, src)
    if check_kinds:
        from omni_core.registry import RegistryError, load_stage_class

        for i, s in enumerate(cfg.stages):
            try:
                cls = load_stage_class(s.kind)
            except RegistryError as e:
                raise _fail(src, f"stages[{i}].kind", str(e)) from None
            options_type = getattr(cls, "Options", None)
            if options_type is not None:
                try:
                    msgspec.convert(s.options, options_type)
                except msgspec.ValidationError as e:
                    path, msg = _explain(e, "option")
                    raise _fail(src, f"stages[{i}].options{path}".rstrip("."), msg) from None


def _check_window(w: WindowSpec, src: str, where: str) -> None:
    if w.size == 0 or w.size < -1:
        raise _fail(
            src, f"{where}.size", f"expected -1 (whole stream) or an integer >= 1, got {w.size}"
        )
    if w.size == -1 and w.overlap:
        raise _fail(src, f"{where}.overlap", "an overlap needs a window size >= 1 (size is -1)")


def _check_acyclic(cfg: PipelineConfig, src: str) -> None:
    graph: dict[str, list[str]] = {s.name: [] for s in cfg.stages}
    for e in cfg.edges:
        graph[e.source].append(e.target)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in graph[n]:
            if state.get(m) == 1:
                cycle = stack[stack.index(m) :] + [m]
                raise _fail(src, "edges", f"cycle {' -> '.join(cycle)}; a pipeline must be a DAG")
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n)
