"""Large arrays between nodes through Ray's object store, with the life of a slot.

An array of at least :data:`OBJECT_THRESHOLD` bytes that sits in a producer's shared
memory and is bound for another node is put into Ray's object store once, by the gateway
of the producer's node (``ray.put``; its slot goes back at once, as after a copy), and the
message carries a handle whose segment names the object (``ray:<pipeline>:<object id>``).
The object reference itself travels in-band, as an argument of the gateway-to-gateway
call: the receiving gateway borrows it (Ray's reference counting) and *holds* it for the
reader. The reader's process maps the array from its own node's object store (zero-copy:
a read-only view of Ray's shared memory) after asking its node's gateway to *lend* it the
reference (another in-band borrow; ``SegmentReader.buffer`` calls the resolver this
module registers in :data:`omni_core.shm.EXTERNAL_SEGMENTS`).

The reference is held for exactly as long as a shared-memory slot would stay rented: the
reader's :class:`~omni_core.events.Release` for it (sent, like every release, through its
node's gateway toward the producer) is taken out of the stream by that gateway, which then
drops its reference, and Ray frees the object once no process holds one. A reader that
dies (its stage is routed elsewhere or nowhere), a :class:`~omni_core.events.ReaderLost`,
a gateway that closes and a node that goes away (Ray's own borrower and owner failure
handling) drop them too, so nothing stays pinned in the object store.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
from omni_core.events import ReaderLost, Release
from omni_core.serial import decode_control_frame, encode_frame
from omni_core.shm import EXTERNAL_SEGMENTS

log = logging.getLogger("omni.ray.objects")

PREFIX = "ray:"
_TAG = PREFIX.encode()
_READER_LOST = b"reader_lost"  # the tag of a ReaderLost message
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


class HeldObjects:
    """A gateway's references to objects lent to readers on its node, until released."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refs: dict[str, tuple[str, Any]] = {}  # object id (hex) -> (reader, ref)
        self.released = 0

    def hold(self, reader: str, refs: list[Any]) -> None:
        with self.lock:
            for ref in refs:
                self.refs[ref.hex()] = (reader, ref)

    def lend(self, keys: list[str]) -> list[Any]:
        """The references for ``keys`` (None: not held here, or no more)."""
        with self.lock:
            return [self.refs[k][1] if k in self.refs else None for k in keys]

    def release(self, keys: list[str]) -> None:
        with self.lock:
            for k in keys:
                if self.refs.pop(k, None) is not None:
                    self.released += 1

    def forget_reader(self, reader: str) -> int:
        """Drop every reference held for ``reader`` (it died); returns how many."""
        with self.lock:
            gone = [k for k, (r, _) in self.refs.items() if r == reader]
            for k in gone:
                del self.refs[k]
            return len(gone)

    def clear(self) -> None:
        with self.lock:
            self.refs.clear()

    def __len__(self) -> int:
        with self.lock:
            return len(self.refs)


def take_releases(frame: bytes, held: HeldObjects) -> bytes | None:
    """A control frame on its way to a producer, less the releases of objects (they end
    here, at the reader's node: its gateway drops the reference); a
    :class:`~omni_core.events.ReaderLost` also drops the references held for that reader
    (and goes on). None: nothing is left of the frame."""
    if _TAG not in frame and _READER_LOST not in frame:
        return frame
    try:
        msgs = decode_control_frame(frame)
    except msgspec.DecodeError:
        return frame  # not ours to judge: it goes on as it is
    kept: list[Any] = []
    for m in msgs:
        if type(m) is Release and is_object(m.segment):
            held.release([key_of(m.segment)])
            continue
        if type(m) is ReaderLost:
            held.forget_reader(m.reader)
        kept.append(m)
    if len(kept) == len(msgs):
        return frame
    return encode_frame(kept) if kept else None


# ---------------------------------------------------------------------- reading side
def install_reader(pipeline_id: str, gateway: Any) -> None:
    """Let this process read the pipeline's objects: ``gateway`` is its node's gateway
    (an actor handle), which lends the references."""
    EXTERNAL_SEGMENTS[segment_name(pipeline_id, "")] = _Resolver(gateway)


def uninstall_reader(pipeline_id: str) -> None:
    EXTERNAL_SEGMENTS.pop(segment_name(pipeline_id, ""), None)


class _Resolver:
    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway

    def __call__(self, segment: str) -> Any:
        """The array of ``segment`` as a read-only uint8 view of this node's object store."""
        import ray

        (ref,) = ray.get(self.gateway.lend.remote([key_of(segment)]), timeout=LEND_TIMEOUT_S)
        if ref is None:
            raise LookupError(
                f"array {segment} is no longer held on this node (its reader was lost, or "
                "its pipeline is closing)"
            )
        # the view keeps this node's copy mapped; the gateway's reference keeps the object
        # until the release (the reader needs no reference of its own)
        return ray.get(ref, timeout=GET_TIMEOUT_S)
