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

from omni_core.config_spelling import Section, Spelling, SpellingError, canonical_spelling
from omni_core.dataplane.serial import DEFAULT_SHM_THRESHOLD
from omni_core.scheduling import SchedulerPolicy

NAME_RE = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
DEVICES_RE = re.compile(r"^\d+(,\d+)*$")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class ConfigError(ValueError):
    """A pipeline configuration is invalid; the message names file, key path and expectation."""

    def __init__(self, message: str, *, path: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.path = path  # the key path, when the error is about one key
        self.detail = detail  # the message without file and key path


class _Spec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# Every field below carries an attribute docstring (the string under it): the docs site's
# configuration reference is generated from these classes and those strings
# (docs/hooks/config_reference.py), and a field without one fails the docs build.


class WindowSpec(_Spec, kw_only=True):
    """How an edge's stream is cut into the windows that trigger the consuming stage, per
    request. A *unit* is a token of a token segment, one image event, else a row (axis 0)
    of a segment's arrays of two or more dimensions, else the whole segment."""

    size: int = -1
    """Units per window: -1, one window once the upstream stream ends; N >= 1, a window
    every N new units (and the rest at the end)."""
    overlap: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Units of the previous window repeated at the start of the next one as left context
    (needs ``size`` >= 1)."""


class Defaults(_Spec, kw_only=True):
    """Settings every stage and edge takes unless it sets its own."""

    window: WindowSpec = msgspec.field(default_factory=WindowSpec)
    """The window of every edge that sets none."""
    max_inflight: PositiveInt = 1
    """Requests a stage works on at once (1: one after another, in order of arrival)."""
    max_batch_size: PositiveInt = 1
    """Work items handed to one ``process`` call: the first ready item, then up to N-1
    more that are ready, without waiting for them."""
    queue_capacity: PositiveInt = 64
    """Work items a stage holds; also its sockets' watermark (backpressure)."""
    scheduler_policy: SchedulerPolicy = "fcfs"
    """How a stage orders the requests that wait in it (its work queue, the batch it
    forms, the requests it admits up to ``max_inflight``, an engine's own scheduler):
    ``fcfs``, by arrival; ``priority``, by the request's ``priority`` (lower first), then
    by arrival. A pipeline refuses a request whose priority is not 0 unless some stage
    schedules by priority."""


class MRS(_Spec, kw_only=True):
    """The multi-process runtime."""

    enabled: bool = True
    """``false``: every stage runs in the caller's process, one request after another,
    through the same windows and encoding (the parity oracle)."""
    defaults: Defaults = msgspec.field(default_factory=Defaults)
    """Settings every stage and edge takes unless it sets its own."""


class Placement(_Spec, kw_only=True):
    """Where a stage's worker may run on a cluster backend (Ray): the resources its actor
    asks for. The local backend ignores it (``devices`` says which GPUs a worker sees)."""

    num_cpus: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """CPUs held in Ray's accounting; 0 lets stages share a node's CPUs, as the local
    backend's processes do: set it (or ``resources``) to spread stages out."""
    num_gpus: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """GPUs the stage's actor asks Ray for; ``devices`` then indexes the GPUs Ray gave it."""
    resources: dict[str, Annotated[float, msgspec.Meta(gt=0)]] = msgspec.field(default_factory=dict)
    """Custom resources, e.g. ``{node_b: 1}`` to land on the node that offers ``node_b``."""
    node_labels: dict[str, str] = msgspec.field(default_factory=dict)
    """A node label selector (Ray's), e.g. ``{ray.io/accelerator-type: H100}``."""


class BackendSpec(_Spec, kw_only=True):
    """Where the stage workers run: ``local`` processes, or a ``ray`` cluster
    (``omni run/serve/trace --backend`` overrides it)."""

    kind: Annotated[str, msgspec.Meta(pattern=NAME_RE)] = "local"
    """``local``: one process per stage on this machine; ``ray``: Ray actors (needs
    ``omni-ray``); or another backend registered under ``omni.backends``."""
    address: str | None = None
    """ray: the cluster to join. ``null``: ``RAY_ADDRESS``, a cluster started with
    ``ray start`` on this machine, else a new one here; ``"local"``: always a new one here."""
    namespace: str | None = None
    """ray: the namespace of the pipeline's actors."""
    start: Literal["zygote", "spawn"] = "zygote"
    """local: how workers start. ``zygote``: forked from one process per pipeline that
    imported the stages' libraries once (a start or restart then costs the stage's own
    load only); ``spawn``: a fresh interpreter per worker, importing everything itself."""


class ReplicaSpec(_Spec, kw_only=True):
    """An autoscaled stage: between ``min`` and ``max`` replicas, sized so that each holds
    about ``target`` outstanding requests (bound to it and not yet past it)."""

    min: PositiveInt = 1
    """Replicas always running (started with the pipeline)."""
    max: PositiveInt
    """Replicas at most; a replica that cannot be placed is reported, not retried at once."""
    target: PositiveFloat = 2.0
    """Outstanding requests per replica the autoscaler aims at."""
    upscale_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """How long the load must stay above target before a replica is added."""
    downscale_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    """How long the load must stay low before a replica is drained and stopped."""


class StageSpec(_Spec, kw_only=True):
    """One stage: a worker process (or Ray actor) running a registered stage kind. Keys
    left ``null`` take the value of ``mrs.defaults``."""

    name: Annotated[str, msgspec.Meta(pattern=NAME_RE)]
    """The stage's name in this pipeline (letters, digits, ``_``, ``.``, ``-``); edges,
    events, metrics and logs name it."""
    kind: str
    """The registered stage kind, a name listed by ``omni stages`` (entry-point group
    ``omni.stages``)."""
    devices: str | Annotated[int, msgspec.Meta(ge=0)] | list[str | int] | None = None
    """The GPUs the worker sees (``CUDA_VISIBLE_DEVICES``, set before anything is
    imported): ``"0"``, ``"1,2"``, a logical index into the parent's list, or ``"cpu"``
    (none). Unset: the worker sees what its parent sees. With ``replicas``, a list gives
    each replica its own group, one entry per replica (``["0", "1"]``); a single value
    is shared by every replica."""
    replicas: PositiveInt | ReplicaSpec = 1
    """Workers running this stage: ``N`` (fixed), or ``{min, max, target, ...}``
    (autoscaled on outstanding requests per replica). To its neighbours and the caller the
    stage is still one stage; each request is bound to one replica. With more than one
    (or autoscaled), workers are named ``STAGE#0``, ``STAGE#1``, ..."""
    extra_env: dict[str, str] = msgspec.field(default_factory=dict)
    """Environment variables set in the worker before anything is imported, e.g.
    ``{OMP_NUM_THREADS: "1"}``."""
    max_inflight: PositiveInt | None = None
    """Overrides ``mrs.defaults.max_inflight`` for this stage."""
    max_batch_size: PositiveInt | None = None
    """Overrides ``mrs.defaults.max_batch_size`` for this stage."""
    queue_capacity: PositiveInt | None = None
    """Overrides ``mrs.defaults.queue_capacity`` for this stage."""
    scheduler_policy: SchedulerPolicy | None = None
    """Overrides ``mrs.defaults.scheduler_policy`` for this stage."""
    client_stream: bool | Literal["previews"] | None = None
    """``true``: this stage's events go to the caller too (a sink's always do);
    ``"previews"``: only its previews (image events before the last), which then go to the
    caller and not downstream. ``null``: only if the stage is a sink."""
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = 3
    """Restarts allowed within ``restart_window_s``; one more crash and the stage is dead."""
    restart_backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    """Wait before a restart, doubling with each restart within the window (at most 10 s)."""
    restart_window_s: PositiveFloat = 600.0
    """The window ``max_restarts`` counts restarts in."""
    stall_timeout_s: PositiveFloat | None = 300.0
    """A stage silent (no heartbeat) or busy on one step this long is hung: its requests
    end with ``stage_hung`` and it is killed and restarted. ``null``: never."""
    placement: Placement = msgspec.field(default_factory=Placement)
    """Ray backend only: what the stage's actor asks Ray for."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """The stage's own options, validated against the stage class's ``Options`` struct
    when the config is loaded."""


class EdgeSpec(_Spec, kw_only=True):
    """A data edge: the ``from`` stage's events flow to the ``to`` stage."""

    source: str = msgspec.field(name="from")
    """The producing stage's name."""
    target: str = msgspec.field(name="to")
    """The consuming stage's name."""
    window: WindowSpec | None = None
    """How the consuming stage's windows are cut on this edge (``null``:
    ``mrs.defaults.window``)."""
    capacity: PositiveInt | None = None
    """Frames in flight on this edge (``null``: the target's ``queue_capacity``)."""


class PipelineConfig(_Spec, kw_only=True):
    """A pipeline: stages (one worker each) and the edges between them, a DAG. Top-level
    keys starting with ``x-`` are ignored (a place for YAML anchors)."""

    name: str = "pipeline"
    """The pipeline's name (``omni serve`` serves it as the model name by default)."""
    mrs: MRS = msgspec.field(default_factory=MRS)
    """The multi-process runtime: on or off, and the defaults of every stage and edge."""
    backend: BackendSpec = msgspec.field(default_factory=BackendSpec)
    """Where the workers run."""
    stages: Annotated[list[StageSpec], msgspec.Meta(min_length=1)]
    """The stages, at least one."""
    edges: list[EdgeSpec] = msgspec.field(default_factory=list)
    """The data edges; fan-out and fan-in are allowed, cycles are not."""
    shm_threshold_bytes: Annotated[int, msgspec.Meta(ge=0)] = DEFAULT_SHM_THRESHOLD
    """Arrays at or above this size travel through shared memory; smaller ones inline."""
    shm_pool_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 1 << 30
    """Each producing stage's shared-memory arena (sparse: it costs only what is written)."""
    ready_timeout_s: PositiveFloat = 120.0
    """Limit for every worker to load and report ready, per pipeline start."""
    heartbeat_interval_s: PositiveFloat = 0.5
    """How often each worker reports its liveness and progress."""
    request_timeout_s: PositiveFloat | None = None
    """The default per-request timeout (``null``: none); a request's own ``timeout_s``
    overrides it."""
    max_queued_requests: PositiveInt | None = 4096
    """Open requests past which ``submit`` raises ``OverloadedError`` (HTTP 429);
    ``null``: no cap."""
    trace: bool = False
    """Record a span per trigger and a mark per emitted event, for ``pipe.trace()`` and
    ``omni trace``."""
    source_file: str = ""
    """Set by the loader (the file read); not a YAML key."""

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

    def replica_range(self, name: str) -> tuple[int, int]:
        """(replicas started with the pipeline, replicas at most) of stage ``name``."""
        r = self.stage(name).replicas
        return (r, r) if isinstance(r, int) else (r.min, r.max)

    def replicated(self, name: str) -> bool:
        """Stage ``name`` may run more than one worker (its workers are ``name#i``)."""
        return self.stage(name).replicas != 1

    def workers(self, name: str) -> list[str]:
        """Every worker name stage ``name`` may have (up to its ``max`` replicas)."""
        if not self.replicated(name):
            return [name]
        return [replica_name(name, i) for i in range(self.replica_range(name)[1])]

    def all_workers(self) -> list[str]:
        return [w for s in self.stages for w in self.workers(s.name)]

    def worker_devices(self, name: str, index: int) -> str | int | None:
        """The ``devices`` entry of replica ``index`` of stage ``name``."""
        devices = self.stage(name).devices
        return devices[index] if isinstance(devices, list) else devices

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


REPLICA_SEP = "#"  # never in a stage name (NAME_RE), so a worker name parses back


def replica_name(stage: str, index: int) -> str:
    """The worker name of replica ``index`` of a replicated stage: ``stage#index``."""
    return f"{stage}{REPLICA_SEP}{index}"


def split_worker(worker: str) -> tuple[str, int]:
    """(stage, replica index) of a worker name; a plain stage name is replica 0."""
    stage, sep, index = worker.partition(REPLICA_SEP)
    return stage, int(index) if sep else 0


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
    return ConfigError(f"{source}: {path}: {message}", path=path, detail=message)


def parse_config(data: Any, source: str = "<config>", check_kinds: bool = True) -> PipelineConfig:
    """Validate already-parsed YAML/JSON data into a :class:`PipelineConfig`. The design
    doc's spelling (:mod:`omni_core.config_spelling`) is rewritten into omni's first;
    errors name a key as it was written."""
    if not isinstance(data, dict):
        raise _fail(source, "<top>", f"expected a mapping, got {type(data).__name__}")
    # top-level `x-...` keys are free: a place for YAML anchors shared by several stages
    data = {k: v for k, v in data.items() if not (isinstance(k, str) and k.startswith("x-"))}
    spelling = _canonical(data, source, check_kinds)
    try:
        try:
            cfg = msgspec.convert(spelling.data, PipelineConfig)
        except msgspec.ValidationError as e:
            path, msg = _explain(e, "key")
            raise _fail(source, _where(path), msg) from None
        cfg.source_file = source
        _check(cfg, source, check_kinds)
    except ConfigError as e:
        written = spelling.written(e.path) if e.path else e.path
        if written == e.path:
            raise
        raise _fail(source, written, e.detail) from None
    return cfg


def _canonical(data: dict[str, Any], source: str, check_kinds: bool = True) -> Spelling:
    # unchecked kinds (not loaded): a section's defaults reach every stage of its family,
    # the same on every machine whatever is installed
    option_names = _option_names if check_kinds else _unchecked
    try:
        spelling = canonical_spelling(data, option_names, _section)
    except SpellingError as e:
        raise _fail(source, e.path, e.message) from None
    mrs = spelling.data.get("mrs")
    for key in mrs if isinstance(mrs, dict) else ():
        if key not in MRS.__struct_fields__:
            raise _fail(source, f"mrs.{key}", _unknown_section(key))
    return spelling


def _unknown_section(key: str) -> str:
    from omni_core.registry import config_section_registry

    added = ", ".join(config_section_registry().names()) or "none"
    return (
        f"unknown key; mrs takes {', '.join(MRS.__struct_fields__)} and the sections "
        f"installed stage families add (here: {added}); a family's section (mrs.{key}) "
        "needs that family installed: `omni stages` lists the installed kinds"
    )


def _unchecked(kind: str) -> None:
    return None


def _section(name: str) -> Section | None:
    """The installed family's handler of ``mrs.<name>``, if one registered it."""
    from omni_core.registry import RegistryError, config_section_registry

    registry = config_section_registry()
    if name not in registry.names():
        return None
    try:
        handler: Section = registry.load(name)
    except RegistryError as e:
        raise SpellingError(f"mrs.{name}", str(e)) from None
    return handler


def _option_names(kind: str) -> frozenset[str]:
    """The option keys stage kind ``kind`` takes (none if it cannot be loaded: the kind's
    own check reports why)."""
    from omni_core.registry import RegistryError, load_stage_class

    try:
        options_type = getattr(load_stage_class(kind), "Options", None)
    except RegistryError:
        return frozenset()
    if options_type is None:
        return frozenset()
    return frozenset(f.encode_name for f in msgspec.structs.fields(options_type))


def normalized_yaml(path: str | os.PathLike[str]) -> str:
    """The config file at ``path`` in omni's canonical spelling, as YAML (validated first;
    ``${VAR}`` references are kept as written, YAML anchors resolved)."""
    p = Path(path)
    data = _read_yaml(p)
    parse_config(expand_env(data, str(p)), str(p))  # (a mapping, valid, once read)
    canonical = _canonical(data, str(p)).data
    return yaml.safe_dump(canonical, sort_keys=False, allow_unicode=True, default_flow_style=False)


def load_config(path: str | os.PathLike[str], check_kinds: bool = True) -> PipelineConfig:
    """Read and validate a pipeline YAML file."""
    p = Path(path)
    return parse_config(expand_env(_read_yaml(p), str(p)), str(p), check_kinds)


def _read_yaml(p: Path) -> Any:
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
    return data


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
        _check_replicas(s, src, f"stages[{i}]")
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


def _check_replicas(s: StageSpec, src: str, where: str) -> None:
    if isinstance(s.replicas, ReplicaSpec) and s.replicas.min > s.replicas.max:
        raise _fail(
            src,
            f"{where}.replicas.min",
            f"min ({s.replicas.min}) is larger than max ({s.replicas.max})",
        )
    n = s.replicas if isinstance(s.replicas, int) else s.replicas.max
    groups = s.devices if isinstance(s.devices, list) else [s.devices]
    if isinstance(s.devices, list) and len(s.devices) != n:
        what = "replicas" if isinstance(s.replicas, int) else "replicas.max"
        raise _fail(
            src,
            f"{where}.devices",
            f"a list gives one device group per replica: expected {n} entries ({what} is "
            f"{n}), got {len(s.devices)}",
        )
    for k, d in enumerate(groups):
        if isinstance(d, int) and d < 0:
            raise _fail(src, f"{where}.devices[{k}]", f"expected an index >= 0, got {d}")
        if isinstance(d, str) and d != "cpu" and not DEVICES_RE.match(d):
            at = f"{where}.devices" + (f"[{k}]" if isinstance(s.devices, list) else "")
            raise _fail(
                src,
                at,
                f'expected a device list like "0" or "1,2", a logical index, or "cpu"; got {d!r}',
            )


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
