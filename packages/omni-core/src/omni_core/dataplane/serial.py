"""All (de)serialization: message frames (msgpack via msgspec) and arrays <-> handles.

A frame on any socket is a msgpack list of messages, so a sender can coalesce what piled
up while the socket was busy into one write. Arrays travel as handles: small ones inline,
large ones written once into a shared-memory slot (see :mod:`omni_core.dataplane.shm`).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import msgspec
import numpy as np

from omni_core.dataplane.shm import EXTERNAL_WRITERS, Arena, SegmentReader
from omni_core.events import (
    AnyEvent,
    Handle,
    InlineArray,
    Release,
    Segment,
    SegmentRun,
    ShmHandle,
    Submit,
    ToOrchestrator,
    ToWorker,
)

DEFAULT_SHM_THRESHOLD = 64 * 1024
BYTES_DTYPE = "bytes"

_encoder = msgspec.msgpack.Encoder()
_data_decoder = msgspec.msgpack.Decoder(list[AnyEvent | SegmentRun | Submit])
_event_decoder = msgspec.msgpack.Decoder(list[AnyEvent | SegmentRun])
_control_decoder = msgspec.msgpack.Decoder(list[ToWorker])
_status_decoder = msgspec.msgpack.Decoder(list[ToOrchestrator])
# one message at a time, for a frame that does not decode as a whole
_raw_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_message_decoders = {
    "data": msgspec.msgpack.Decoder(AnyEvent | SegmentRun | Submit),
    "event": msgspec.msgpack.Decoder(AnyEvent | SegmentRun),
    "control": msgspec.msgpack.Decoder(ToWorker),
    "status": msgspec.msgpack.Decoder(ToOrchestrator),
}


class BadMessage(NamedTuple):
    """A message of a frame that does not decode: what can be told of it, and why."""

    request_id: str | None
    stage: str | None
    error: str


def encode_frame(messages: list[Any]) -> bytes:
    return _encoder.encode(messages)


def check_request(request: dict[str, Any], request_id: str) -> None:
    """Raise TypeError, naming the request, if ``request`` cannot go on the wire."""
    try:
        encode_frame([request])
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"request {request_id}: cannot be serialized: {e}") from None


def encode_events_into(messages: list[Any], buffer: bytearray) -> None:
    """A frame of data-plane messages into ``buffer`` (resized to the frame), runs of
    array-free segments packed in columns."""
    _encoder.encode_into(pack_runs(messages), buffer)


def pack_runs(messages: list[Any]) -> list[Any]:
    """``messages`` with each run of consecutive array-free segments of one request and
    stage (strictly one sequence number apart, none but the last ending its stream) as
    one :class:`SegmentRun`."""
    out: list[Any] = []
    n = len(messages)
    i = 0
    while i < n:
        m = messages[i]
        i += 1
        if type(m) is not Segment or m.device_handles or m.is_last:
            out.append(m)
            continue
        start, rid, stage, seq = i - 1, m.request_id, m.stage, m.sequence
        while i < n:
            x = messages[i]
            seq += 1
            if (
                type(x) is not Segment
                or x.sequence != seq
                or x.request_id != rid
                or x.stage != stage
                or x.device_handles
            ):
                break
            i += 1
            if x.is_last:
                break
        if i - start == 1:
            out.append(m)
        else:
            out.append(SegmentRun.of(messages[start:i], stage, m.sequence, m.request, m.routes))
    return out


def salvage_frame(frame: Any, kind: str) -> tuple[list[Any], list[BadMessage]]:
    """A frame that failed to decode as a whole (``kind``: data | event | control |
    status), decoded message by message: the good messages in order, runs expanded for
    ``event``, and the bad ones, so one bad message costs only its own request."""
    decoder = _message_decoders[kind]
    try:
        raws = _raw_list_decoder.decode(frame)
    except msgspec.DecodeError as e:  # not even a list of messages
        return [], [BadMessage(None, None, f"undecodable frame: {e}")]
    good: list[Any] = []
    bad: list[BadMessage] = []
    for raw in raws:
        try:
            msg = decoder.decode(raw)
        except msgspec.DecodeError as e:
            bad.append(_bad_message(raw, e))
            continue
        if kind == "event" and type(msg) is SegmentRun:
            good.extend(msg.segments())
        else:
            good.append(msg)
    return good, bad


def _bad_message(raw: msgspec.Raw, error: Exception) -> BadMessage:
    try:
        fields = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        fields = None
    if not isinstance(fields, dict):
        return BadMessage(None, None, str(error))
    rid, stage = fields.get("request_id"), fields.get("stage")
    return BadMessage(
        rid if isinstance(rid, str) else None, stage if isinstance(stage, str) else None, str(error)
    )


def decode_data_frame(frame: Any) -> list[AnyEvent | SegmentRun | Submit]:
    """A stage's inbound frame; runs stay packed (the worker takes them as they are)."""
    return _data_decoder.decode(frame)


def decode_event_frame(frame: Any) -> list[AnyEvent]:
    """A frame of events, runs expanded into their segments."""
    msgs = _event_decoder.decode(frame)
    if not any(type(m) is SegmentRun for m in msgs):
        return msgs
    out: list[AnyEvent] = []
    for m in msgs:
        if type(m) is SegmentRun:
            out.extend(m.segments())
        else:
            out.append(m)
    return out


def decode_control_frame(frame: Any) -> list[ToWorker]:
    return _control_decoder.decode(frame)


def decode_status_frame(frame: Any) -> list[ToOrchestrator]:
    return _status_decoder.decode(frame)


def encode_json(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def decode_json(data: bytes, type_: type) -> Any:
    return msgspec.json.decode(data, type=type_)


# --------------------------------------------------------------------------- arrays


def _is_torch(value: Any) -> bool:
    mod = type(value).__module__
    return mod.startswith("torch") and "torch" in sys.modules


def array_to_flat(value: Any) -> tuple[np.ndarray, str, tuple[int, ...], bool]:
    """(flat uint8 view, dtype string, shape, is_torch) of an array-like payload."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        flat = np.frombuffer(value, dtype=np.uint8)
        return flat, BYTES_DTYPE, (flat.size,), False
    if _is_torch(value):
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()  # cross-device goes through host memory
        t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        flat = t.reshape(-1).view(torch.uint8).numpy()
        return flat, dtype, tuple(t.shape), True
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        if arr.dtype.hasobject:
            raise TypeError("arrays of Python objects cannot go through the data plane")
        return arr.reshape(-1).view(np.uint8), arr.dtype.str, tuple(arr.shape), False
    raise TypeError(
        f"cannot send {type(value).__name__} as an array; use a numpy array, "
        "a CPU torch tensor or bytes (plain values go in the payload)"
    )


def array_from_flat(
    raw: np.ndarray, dtype: str, shape: tuple[int, ...], torch_: bool, owned: bool
) -> Any:
    """Rebuild an array over ``raw`` (a flat uint8 array) without copying, except that a
    torch tensor is never made over memory it may not write (torch has no read-only
    tensors: ``torch.from_numpy`` of a read-only array warns, and writes would reach it).

    A bytes payload comes back as ``bytes`` when ``raw`` is an owned copy, else as a
    read-only uint8 view of the slot.
    """
    if dtype == BYTES_DTYPE:
        return raw.tobytes() if owned else raw
    if torch_:
        import torch

        if not raw.flags.writeable:
            raw = raw.copy()
        return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
    return raw.view(np.dtype(dtype)).reshape(shape)


def array_nbytes(value: Any) -> int:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if _is_torch(value):
        return value.numel() * value.element_size()
    return int(value.nbytes)


class ArrayCodec:
    """Packs a stage's arrays into handles and resolves received handles into arrays.

    ``arena`` is the producer's own slot pool (``None``: everything rides inline, as in the
    in-process runner); ``reader`` maps other producers' segments.
    """

    def __init__(
        self,
        producer: str,
        arena: Arena | None = None,
        reader: SegmentReader | None = None,
        threshold: int = DEFAULT_SHM_THRESHOLD,
        rent_timeout: float | None = 30.0,
    ) -> None:
        self.producer = producer
        self.arena = arena
        self.reader = reader or SegmentReader()
        self.threshold = threshold
        self.rent_timeout = rent_timeout

    def pack(self, arrays: dict[str, Any], readers: dict[str, int]) -> dict[str, Handle]:
        """Write each array once; a shared-memory slot is read by every reader in ``readers``."""
        handles: dict[str, Handle] = {}
        rented: list[tuple[int, int]] = []
        written: list[str] = []  # segments of an external writer
        writer = EXTERNAL_WRITERS.get(self.producer)
        try:
            for key, value in arrays.items():
                flat, dtype, shape, torch_ = array_to_flat(value)
                n = flat.size
                if self.arena is None or n < self.threshold:
                    handles[key] = InlineArray(flat.tobytes(), dtype, shape, torch_)
                    continue
                segment = writer.write(flat, readers) if writer is not None else None
                if segment is not None:
                    written.append(segment)
                    handles[key] = ShmHandle(segment, 0, n, dtype, shape, self.producer, 0, torch_)
                    continue
                off, rental = self.arena.rent(n, readers, self.rent_timeout)
                rented.append((off, rental))
                np.frombuffer(self.arena.buf, dtype=np.uint8, count=n, offset=off)[:] = flat
                handles[key] = ShmHandle(
                    self.arena.name, off, n, dtype, shape, self.producer, rental, torch_
                )
        except BaseException:
            for slot in rented:  # the message will not be sent: its slots go back
                self.arena.cancel(slot)  # type: ignore[union-attr]
            for segment in written:
                writer.cancel(segment, readers)  # type: ignore[union-attr]
            raise
        return handles

    def unpack(
        self, handles: dict[str, Handle], copy: bool = False
    ) -> tuple[dict[str, Any], list[ShmHandle]]:
        """Arrays for ``handles`` plus the shared-memory handles the caller must release."""
        arrays: dict[str, Any] = {}
        shm: list[ShmHandle] = []
        for key, h in handles.items():
            if isinstance(h, InlineArray):
                raw = np.frombuffer(h.data, dtype=np.uint8)
                if copy or h.torch:
                    raw = raw.copy()
            else:
                # the reader maps the segment read-only: a view that cannot be made writeable;
                # the handle came off a socket: its segment and span are checked first
                buf = self.reader.checked(h.segment, h.offset, h.nbytes, h.producer)
                raw = np.frombuffer(buf, dtype=np.uint8, count=h.nbytes, offset=h.offset)
                if copy or h.torch:  # a tensor is a copy: torch has no read-only tensors
                    raw = raw.copy()
                elif raw.flags.writeable:  # fan-out peers share the slot
                    raw.flags.writeable = False
                shm.append(h)
            arrays[key] = array_from_flat(raw, h.dtype, h.shape, h.torch, copy)
        return arrays, shm


def releases(handles: list[ShmHandle], reader: str) -> list[tuple[str, Release]]:
    """One :class:`Release` per producer segment for the slots ``reader`` is done with."""
    by_segment: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for h in handles:
        by_segment.setdefault((h.producer, h.segment), []).append((h.offset, h.rental))
    return [
        (producer, Release(slots=slots, segment=segment, reader=reader))
        for (producer, segment), slots in by_segment.items()
    ]
