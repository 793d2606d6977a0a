"""Large arrays between nodes through Ray's object store, with the life of a slot.

An array of at least :data:`OBJECT_THRESHOLD` bytes bound for readers on other nodes is
put into Ray's object store once, and the message carries a handle whose segment names
the object (``ray:<pipeline>:<object id>``). When every reader of the array is on another
node, the producer puts it itself (:class:`ObjectWriter`, the
:class:`~omni_core.dataplane.shm.ExternalWriter` of its process: one copy, no slot) and hands the
reference, in-band, to each reader's node's gateway before the message leaves. Else it
takes a slot as usual, and the gateway of the producer's node puts it (``ray.put`` from
the slot, which goes back at once, as after a copy) when it forwards the message to a
reader on another node, with the reference in-band in its gateway-to-gateway call.
Either way the receiving gateway borrows the reference (Ray's reference counting) and
*holds* it for the reader. The reader's process maps the array from its own node's object
store (zero-copy: a read-only view of Ray's shared memory) after asking its node's gateway
to *lend* it the reference (another in-band borrow; ``SegmentReader.buffer`` calls the
resolver this module registers in :data:`omni_core.dataplane.shm.EXTERNAL_SEGMENTS`).

The reference is held for exactly as long as a shared-memory slot would stay rented: the
reader's :class:`~omni_core.events.Release` for it (sent, like every release, through its
node's gateway toward the producer) is taken out of the stream by that gateway, which then
drops its reference, and Ray frees the object once no process holds one. A reader that
dies (its worker is routed elsewhere or nowhere), a :class:`~omni_core.events.ReaderLost`,
a gateway that closes and a node that goes away (Ray's own borrower and owner failure
handling) drop them too, so nothing stays pinned in the object store.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from typing import Any

import msgspec
from omni_core.dataplane.serial import decode_control_frame, encode_frame
from omni_core.dataplane.shm import EXTERNAL_SEGMENTS, EXTERNAL_WRITERS
from omni_core.events import ReaderLost, Release
from omni_core.worker.host import CLIENT

from omni_ray.grants import Pass, node_pass
from omni_ray.routes import DRIVER, gateway_name, inbox_of

log = logging.getLogger("omni.ray.objects")

PREFIX = "ray:"
# arrays from this size cross nodes through the object store; smaller ones ride in frames
OBJECT_THRESHOLD = 4 << 20
LEND_TIMEOUT_S = 60.0  # the reader's call to its node's gateway
GET_TIMEOUT_S = 600.0  # pulling the object to the reader's node (a slow network, a big array)


def segment_name(pipeline_id: str, key: str) -> str:
    return f"{PREFIX}{pipeline_id}:{key}"


def key_of(segment: str) -> str:
    return segment.rsplit(":", 1)[1]


def is_object(segment: str) -> bool:
    return segment.startswith(PREFIX)


_NOT_LET_GO = object()


class HeldObjects:
    """A gateway's references to objects lent to readers on its node, until released.

    One object may be held for several readers (a fan-out to stages on one node: the
    producer put it once); it goes when the last of them released it. A release that
    comes before its hold (the producer gave up waiting for this gateway's answer and
    let go; a threaded actor may run the two calls in either order) is remembered, and
    the hold then takes nothing.

    Each object is held as one node's (its *holder*: the node whose producer or gateway
    asked): a release from another node lets go of none of it, nor does its early
    release make the holder's hold take nothing. Releases from this node (its readers',
    through its gateway) need no holder."""

    LET_GO_MAX = 4096  # releases of what was not held, remembered (each object id is new)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refs: dict[str, Any] = {}  # object id (hex) -> its reference
        self.readers: dict[str, set[str]] = {}  # object id -> the readers it is held for
        self.owners: dict[str, str] = {}  # object id -> the producer that put it, until lent
        self.released = 0  # releases taken (one per object and reader)
        self.holders: dict[str, str] = {}  # object id -> the node it is held as ("": here)
        # (reader, id) -> the node that released it before its hold came (None: this one)
        self.let_go: OrderedDict[tuple[str, str], str | None] = OrderedDict()

    def hold(self, reader: str, refs: list[Any], producer: str = "", holder: str = "") -> int:
        """Hold ``refs`` for ``reader`` (a worker's name) as ``holder``'s (the asking
        node; "": this one); ``producer``: the worker that put them (and owns them), if
        not a gateway. Returns how many were refused: held already as another node's."""
        refused = 0
        with self.lock:
            for ref in refs:
                key = ref.hex()
                if self.holders.get(key, holder) != holder:
                    refused += 1
                    continue
                early = self.let_go.get((reader, key), _NOT_LET_GO)
                if early is None or early == holder:  # released before it came
                    del self.let_go[(reader, key)]
                    continue
                self.refs[key] = ref
                self.holders[key] = holder
                self.readers.setdefault(key, set()).add(reader)
                if producer:
                    self.owners[key] = producer
        return refused

    def lend(self, keys: list[str], reader: str) -> list[Any]:
        """The references for ``keys`` (None: not held here, or no more, or not held for
        ``reader``: a handle it got names another's object)."""
        with self.lock:
            out = []
            for k in keys:
                if reader not in self.readers.get(k, ()):
                    out.append(None)
                    continue
                self.owners.pop(k, None)  # on its reader's side now: its release ends it
                out.append(self.refs.get(k))
            return out

    def forget_producer(self, producer: str) -> int:
        """``producer``'s life ended: drop what it put that no reader was lent yet (its
        message may have died in its process, and the object died with it anyway)."""
        with self.lock:
            mine = [k for k, p in self.owners.items() if p == producer]
            for k in mine:
                self._drop(k)
            return len(mine)

    def _drop(self, key: str) -> None:
        del self.readers[key], self.refs[key], self.holders[key]
        self.owners.pop(key, None)

    def release(self, reader: str, keys: list[str], holder: str | None = None) -> int:
        """``reader`` is done with ``keys``; from ``holder`` (another node: only what it
        holds here; None: this node, anything). Returns how many were refused: held as
        another node's."""
        refused = 0
        with self.lock:
            for k in keys:
                readers = self.readers.get(k)
                if readers is None or reader not in readers:
                    self.let_go[(reader, k)] = holder  # its hold may be on its way
                    if len(self.let_go) > self.LET_GO_MAX:
                        self.let_go.popitem(last=False)
                    continue
                if holder is not None and self.holders[k] != holder:
                    refused += 1
                    continue
                readers.discard(reader)
                self.released += 1
                if not readers:
                    self._drop(k)
        return refused

    def forget_reader(self, reader: str) -> int:
        """Drop every hold for ``reader`` (it died); returns how many."""
        with self.lock:
            mine = [k for k, readers in self.readers.items() if reader in readers]
            for k in mine:
                self.readers[k].discard(reader)
                if not self.readers[k]:
                    self._drop(k)
            return len(mine)

    def clear(self) -> None:
        with self.lock:
            self.refs.clear()
            self.readers.clear()
            self.owners.clear()
            self.holders.clear()
            self.let_go.clear()

    def __len__(self) -> int:
        with self.lock:
            return len(self.refs)

    def by_reader(self) -> dict[str, int]:
        """How many objects are held for each reader (one held for two counts twice)."""
        with self.lock:
            return dict(Counter(r for readers in self.readers.values() for r in readers))


def take_releases(frame: bytes, held: HeldObjects) -> bytes | None:
    """A control frame on its way to a producer, less the releases of objects (they end
    here, at the reader's node: its gateway drops the reference); a
    :class:`~omni_core.events.ReaderLost` also drops the references held for that reader
    (and goes on). None: nothing is left of the frame. Always decoded: no byte pattern
    tells what a frame holds (msgpack spells a string in more than one way)."""
    try:
        msgs = decode_control_frame(frame)
    except msgspec.DecodeError:
        return frame  # not ours to judge: it goes on as it is
    kept: list[Any] = []
    for m in msgs:
        if type(m) is Release and is_object(m.segment):
            held.release(m.reader, [key_of(m.segment)])
            continue
        if type(m) is ReaderLost:
            held.forget_reader(m.reader)
        kept.append(m)
    if len(kept) == len(msgs):
        return frame
    return encode_frame(kept) if kept else None


# ---------------------------------------------------------------------- reading side
def install_reader(pipeline_id: str, gateway: Any, caller: Pass, reader: str = CLIENT) -> None:
    """Let this process, ``reader`` (a worker's name, or the caller's), read the pipeline's
    objects held for it: ``gateway`` is its node's gateway (an actor handle), which lends
    the references to the holder of this node's pass ``caller``."""
    EXTERNAL_SEGMENTS[segment_name(pipeline_id, "")] = _Resolver(gateway, caller, reader)


def uninstall_reader(pipeline_id: str) -> None:
    EXTERNAL_SEGMENTS.pop(segment_name(pipeline_id, ""), None)


class _Resolver:
    def __init__(self, gateway: Any, caller: Pass, reader: str) -> None:
        self.gateway = gateway
        self.caller = caller
        self.reader = reader

    def __call__(self, segment: str) -> Any:
        """The array of ``segment`` as a read-only uint8 view of this node's object store."""
        import ray

        call = self.gateway.lend.remote(self.caller, [key_of(segment)], self.reader)
        (ref,) = ray.get(call, timeout=LEND_TIMEOUT_S)
        if ref is None:
            raise LookupError(
                f"array {segment} is not held for {self.reader!r} on this node (its reader "
                "was lost, its pipeline is closing, or it is another reader's)"
            )
        # the view keeps this node's copy mapped; the gateway's reference keeps the object
        # until the release (the reader needs no reference of its own)
        try:
            return ray.get(ref, timeout=GET_TIMEOUT_S)
        except ray.exceptions.RayError as e:  # its owner (the producer) died, say
            # Ray's frames in the traceback hold the exception in a cycle that only the
            # garbage collector breaks, and with it the references in their locals:
            # objects would stay pinned (and Ray's 1-byte marks of lost ones) till then
            e.__traceback__ = None
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            error = f"array {segment} cannot be read: {type(e).__name__}: {why}"
        del ref
        raise LookupError(error)


# ---------------------------------------------------------------------- writing side
ROUTES_TTL_S = 1.0  # how long a producer trusts the routes it last asked its gateway for
HOLD_TIMEOUT_S = 60.0  # a gateway that neither answers nor is known gone


def install_writer(
    pipeline_id: str, worker: str, node_id: str, gateway: Any, secret: str
) -> ObjectWriter:
    """Let ``worker``'s process put its large arrays for readers on other nodes into the
    object store itself (``gateway``: its node's, which knows the routes; ``secret``: its
    node's, for the passes its calls carry). Keyed by the worker's name (``STAGE#i`` for
    a replica): the producer name its ArrayCodec asks
    :data:`~omni_core.dataplane.shm.EXTERNAL_WRITERS` with."""
    writer = ObjectWriter(pipeline_id, worker, node_id, gateway, secret)
    EXTERNAL_WRITERS[worker] = writer
    return writer


class ObjectWriter:
    """A producer's large arrays for readers that are all on other nodes: put into this
    node's object store by the producer itself (one copy, where a slot would cost the
    producer a copy and its gateway another), held by each reader's node's gateway before
    the message leaves (an in-band borrow, so the producer drops its own reference at
    once). An array with a reader on this node, or one not placed, takes a slot as usual.

    Readers are workers (a replicated stage's are the replicas a request is bound to, each
    routed on its own), and so is the producer (``worker``: its route is its life).
    Routes are a hint, asked of this node's gateway at most every :data:`ROUTES_TTL_S`:
    a reader that moved to this node meanwhile gets a slot's handle that its gateway
    forwards as before, and a gateway that no longer has the reader refuses the hold, so
    the array takes a slot and the routes are asked again.

    The producer owns what it put (Ray's ownership): should its process die, the arrays
    it sent that no reader has mapped yet are lost with it, and their requests fail at
    the reader, naming the object."""

    def __init__(
        self, pipeline_id: str, worker: str, node_id: str, gateway: Any, secret: str
    ) -> None:
        self.pipeline_id = pipeline_id
        self.worker = worker
        self.node_id = node_id
        self.gateway = gateway
        self._secret = secret
        self.routes: dict[str, str | None] = {}  # worker -> its node
        self.routes_at = float("-inf")
        self.life = -1  # the version of this worker's route to this node: its life
        self.gateways: dict[str, Any] = {}
        self.puts = 0  # arrays this producer put (for tests and metrics)

    def write(self, flat: Any, readers: dict[str, int]) -> str | None:
        import ray

        if flat.nbytes < OBJECT_THRESHOLD:
            return None
        targets = self._targets(readers)
        if not targets:
            return None
        ref = ray.put(flat)
        segment = segment_name(self.pipeline_id, ref.hex())
        calls = [
            self._gateway(node).hold.remote(
                self._pass(node), inbox_of(r), [ref], self.worker, self.life
            )
            for r, node in targets
        ]
        del ref  # each call pins it until its gateway holds it (or refused it)
        held = self._held(calls, readers, targets)
        if all(held):
            self.puts += 1
            return segment
        self.routes_at = float("-inf")  # a reader moved: ask again next time
        # the array takes a slot: every gateway that holds it, or may yet (it did not
        # answer), lets go, on the node the hold went to
        key = key_of(segment)
        for (reader, node), ok in zip(targets, held, strict=True):
            if ok is not False:
                self._release(node, reader, key)
        return None

    def _held(
        self, calls: list[Any], readers: dict[str, int], targets: list[tuple[str, str]]
    ) -> list[bool | None]:
        """The gateways' answers to the holds (None: none came); all None once a reader
        left the node it was sent to (the node went away, say: its gateway would not
        answer soon) or none came in time."""
        import ray

        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while len(ray.wait(calls, num_returns=len(calls), timeout=ROUTES_TTL_S)[0]) < len(calls):
            self.routes_at = float("-inf")
            if self._targets(readers) != targets or time.monotonic() > deadline:
                log.warning("no answer from the gateways of %s: the array takes a slot", targets)
                return [None] * len(calls)
        held = []
        for call in calls:
            try:
                held.append(bool(ray.get(call)))
            except ray.exceptions.RayError as e:  # that gateway died with its node
                e.__traceback__ = None  # see _Resolver: no frame may keep the calls alive
                log.warning("cannot hand an array over: %s: %s", type(e).__name__, e)
                held.append(False)
        return held

    def cancel(self, segment: str, readers: dict[str, int]) -> None:
        if not segment.startswith(segment_name(self.pipeline_id, "")):
            return
        key = key_of(segment)
        for reader in readers:
            node = self.routes.get(DRIVER if reader == CLIENT else reader)
            if node is not None:
                self._release(node, reader, key)

    def _release(self, node: str, reader: str, key: str) -> None:
        """Tell ``node``'s gateway that ``reader`` is done with ``key`` (fire and forget;
        should it come before the hold, the hold takes nothing: :class:`HeldObjects`)."""
        with contextlib.suppress(ValueError):  # that node's gateway is gone
            self._gateway(node).release.remote(self._pass(node), reader, [key])

    def _targets(self, readers: dict[str, int]) -> list[tuple[str, str]] | None:
        """(reader, its node) for each reader, when every one is on another node."""
        import ray

        if time.monotonic() - self.routes_at > ROUTES_TTL_S:
            call = self.gateway.current_routes.remote(self._pass(self.node_id))
            self.routes, versions = ray.get(call, timeout=HOLD_TIMEOUT_S)
            self.routes_at = time.monotonic()
            if self.routes.get(self.worker) == self.node_id:
                self.life = versions[self.worker]
        if self.life < 0:  # not routed here yet: its gateway forwards slots meanwhile
            return None
        out: list[tuple[str, str]] = []
        for reader, n in readers.items():
            node = self.routes.get(DRIVER if reader == CLIENT else reader)
            if n <= 0:
                continue
            if node is None or node == self.node_id:
                return None
            out.append((reader, node))
        return out

    def _pass(self, node: str) -> Pass:
        return node_pass(self.node_id, self._secret, node)

    def _gateway(self, node: str) -> Any:
        import ray

        gw = self.gateways.get(node)
        if gw is None:
            gw = self.gateways[node] = ray.get_actor(gateway_name(self.pipeline_id, node))
        return gw
