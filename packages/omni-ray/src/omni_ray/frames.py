"""A gateway's frames that cannot go on as they are.

A frame bound for another node has its shared-memory arrays copied into it (a node cannot
map another's memory), or, from :data:`~omni_ray.objects.OBJECT_THRESHOLD` bytes, put
into Ray's object store (see :mod:`omni_ray.objects`), and their slots released; a frame,
or one message of it, that cannot be handled (it does not decode, its arrays cannot be
read) is dropped: its slots go back to their producers and its requests end with an error
(code ``gateway_error``), so nothing waits for it. The rest of a frame always goes on.

A frame that arrives from another node's gateway, over a channel or by an actor call, is
screened first (:meth:`FrameGuard.screen`): always decoded (however its msgpack is
spelled), a message its sending node may not send, or touching what is not its sender's,
is refused.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq
from omni_core.config import split_worker
from omni_core.dataplane.serial import (
    decode_control_frame,
    decode_data_frame,
    decode_status_frame,
    encode_frame,
    releases,
    salvage_frame,
)
from omni_core.dataplane.shm import SegmentReader
from omni_core.dataplane.transport import RESULTS, STATUS, Addresses, push_socket
from omni_core.events import Error, InlineArray, Release, ShmHandle, Submit

from omni_ray.objects import OBJECT_THRESHOLD, is_object, key_of, segment_name
from omni_ray.routes import owner_of, reader_of

log = logging.getLogger("omni.ray.gateway")

GATEWAY_ERROR = "gateway_error"  # the code of the error a dropped message's request ends with
# (request id or None, stage or "", why) of a message that will not arrive
Lost = tuple[str | None, str, str]


class FrameGuard:
    """One gateway's frame surgery; the forwarding threads share it (each passes its own
    ``outs``: that thread's sockets to producers and the client)."""

    def __init__(
        self,
        node_id: str,
        addr: Addresses,
        zctx: zmq.Context,
        reader: SegmentReader,
        pipeline_id: str = "",
        object_threshold: int | None = OBJECT_THRESHOLD,
        forget_objects: Callable[[str, list[str]], None] | None = None,
        head_node: str = "",
        lives_on: Callable[[str], str | None] | None = None,
    ) -> None:
        """``forget_objects(endpoint, keys)``: the reader of ``endpoint`` will not read
        these objects (their message was dropped): whoever holds them for it lets go.
        ``head_node``: the orchestrator's node (the only sender of its messages).
        ``lives_on(worker)``: the node a worker runs on (None: not placed, or unknown)."""
        self.forget_objects = forget_objects
        self.lives_on = lives_on
        self.node_id = node_id
        self.head_node = head_node
        self.pipeline_id = pipeline_id
        self.object_threshold = object_threshold  # None: arrays always ride in the frame
        self.addr = addr
        self.zctx = zctx
        self.reader = reader
        self.lock = threading.Lock()
        self.dropped = 0  # frames and messages dropped because they could not be handled
        self.puts = 0  # arrays this gateway put into the object store from a slot
        self.refused = 0  # messages over channels that touched what was not their sender's

    def inline_all(
        self, endpoint: str, frames: list[bytes], outs: dict[str, zmq.Socket]
    ) -> tuple[list[bytes], list[Any]]:
        """``frames`` ready for another node, and the references to the objects their
        large arrays went into; a frame that cannot be made so is dropped."""
        out: list[bytes] = []
        refs: list[Any] = []
        for f in frames:
            try:
                f = self.inline(f, endpoint, outs, refs)
            except zmq.ZMQError:
                raise
            except Exception as e:
                log.exception(
                    "gateway %s: %s: cannot read a frame's arrays; frame dropped",
                    self.node_id[:8],
                    endpoint,
                )
                self.drop(endpoint, f, outs, f"{type(e).__name__}: {e}")
                continue
            if f is not None:
                out.append(f)
        return out, refs

    def screen(
        self, endpoint: str, frame: bytes, outs: dict[str, zmq.Socket], sender: str | None
    ) -> bytes | None:
        """What of ``frame``, which came over ``endpoint``'s channel from ``sender`` (the
        node whose key its connection authenticated, None: unknown), may go on (None:
        nothing). Never raises but for a broken socket.

        The frame is always decoded: msgpack spells a string in more than one way, and
        the receiver decodes any of them, so no byte pattern can tell what a frame holds.
        What the orchestrator alone sends (a ``Submit``; on a control channel anything but
        a ``Release``) is taken only from the head node. Another node never holds a slot of
        this node's segments (what crosses nodes is copied or put into the object store,
        and its slot released there), nor is it lent one: a ``Release`` or a handle to a
        segment here is forged. Such a message is refused (counted, logged); a data
        message's request fails. An object handle must name this pipeline's objects (its
        reader is lent only what is held for it). A status message (to the orchestrator)
        may speak only of a worker its sender runs, or of one not placed yet (its Ready
        may come before its route)."""
        try:
            if endpoint.endswith(".ctl"):
                return self._screen_control(endpoint, frame, sender)
            if endpoint == STATUS:
                return self._screen_status(endpoint, frame, sender)
            msgs, lost = self.decode(endpoint, frame)
            if lost:  # undecodable messages (logged)
                with self.lock:
                    self.dropped += len(lost)
            ours = segment_name(self.pipeline_id, "")
            kept: list[Any] = []
            for m in msgs:
                bad = [
                    h.segment
                    for h in _handles(m).values()
                    if isinstance(h, ShmHandle) and not h.segment.startswith(ours)
                ]
                if bad:
                    lost.append(_lost(m, f"refused: it names segment {bad[0][:80]!r}"))
                    self._refuse(endpoint, f"a handle to segment {bad[0][:80]!r}", sender)
                elif type(m) is Submit and not self._from_head(sender):
                    lost.append(_lost(m, "refused: a submit not from the orchestrator's node"))
                    self._refuse(endpoint, f"a submit of request {m.request_id!r}", sender)
                else:
                    kept.append(m)
            if len(kept) == len(msgs) and not lost:
                return frame
            self.fail_requests(lost, endpoint, outs)  # (no release: none was theirs)
            return encode_frame(kept) if kept else None
        except zmq.ZMQError:
            raise
        except Exception as e:
            what = f"a frame that cannot be screened ({type(e).__name__}: {e})"
            self._refuse(endpoint, what, sender)
            return None

    def _from_head(self, sender: str | None) -> bool:
        return sender is not None and sender == self.head_node

    def _screen_control(self, endpoint: str, frame: bytes, sender: str | None) -> bytes | None:
        """A control frame from another node, re-encoded: a ``Release`` is refused from
        any node, the orchestrator's messages from any node but the head."""
        try:
            msgs = decode_control_frame(frame)
        except msgspec.DecodeError:
            msgs, bad = salvage_frame(frame, "control")
            with self.lock:
                self.dropped += len(bad)
            for b in bad:
                log.error(
                    "gateway %s: %s: an undecodable control message from node %s was dropped: %s",
                    self.node_id[:8],
                    endpoint,
                    (sender or "?")[:8],
                    b.error,
                )
        kept: list[Any] = []
        for m in msgs:
            if type(m) is Release:
                what = f"a release of {m.segment[:80]!r} for {m.reader!r}"
                self._refuse(endpoint, what, sender)
            elif not self._from_head(sender):
                self._refuse(endpoint, f"a {type(m).__name__} (the orchestrator's)", sender)
            else:
                kept.append(m)
        # re-encoded: what comes after (objects.take_releases) sees the usual spelling
        return encode_frame(kept) if kept else None

    def _screen_status(self, endpoint: str, frame: bytes, sender: str | None) -> bytes | None:
        """A status frame from another node, less what speaks of a worker that runs
        elsewhere (re-encoded only when something was refused)."""
        try:
            msgs = decode_status_frame(frame)
        except msgspec.DecodeError:
            msgs, bad = salvage_frame(frame, "status")
            with self.lock:
                self.dropped += len(bad)
        else:
            bad = []
        kept: list[Any] = []
        for m in msgs:
            where = self.lives_on(m.stage) if self.lives_on is not None else None
            if where is not None and where != sender:
                what = f"a {type(m).__name__} of {m.stage[:40]!r} (it runs on node {where[:12]})"
                self._refuse(endpoint, what, sender)
            else:
                kept.append(m)
        if len(kept) == len(msgs) and not bad:
            return frame
        return encode_frame(kept) if kept else None

    def _refuse(self, endpoint: str, what: str, sender: str | None) -> None:
        with self.lock:
            self.refused += 1
        log.warning(
            "gateway %s: %s: refused %s from node %s (not its sender's to send)",
            self.node_id[:8],
            endpoint,
            what,
            (sender or "unknown")[:12],
        )

    def out(self, outs: dict[str, zmq.Socket], endpoint: str) -> zmq.Socket:
        """This thread's socket to ``endpoint`` on this node (a producer's ``.ctl``, or
        the client's results: on the head node the orchestrator's, elsewhere this
        gateway's, which forwards them)."""
        sock = outs.get(endpoint)
        if sock is None:
            sock = outs[endpoint] = push_socket(self.zctx, self.addr.endpoint(endpoint), 100_000)
        return sock

    def release(
        self, handles: list[ShmHandle], reader: str, outs: dict[str, zmq.Socket], endpoint: str
    ) -> None:
        """``reader`` (of ``endpoint``) will not read ``handles``: slots go back to their
        producers, objects their producers put are let go by whoever holds them."""
        slots = [h for h in handles if _in_slot(h)]
        for producer, rel in releases(slots, reader):
            self.out(outs, f"{producer}.ctl").send(encode_frame([rel]))
        keys = [key_of(h.segment) for h in handles if not _in_slot(h)]
        if keys and self.forget_objects is not None:
            self.forget_objects(endpoint, keys)

    def fail_requests(self, lost: list[Lost], endpoint: str, outs: dict[str, zmq.Socket]) -> None:
        """End the requests of messages that will not arrive, so none waits for them."""
        errors: dict[str, Error] = {}
        for rid, stage, why in lost:
            if rid is None or rid in errors:
                continue  # a message that names no request: only the log tells of it
            stage = stage or split_worker(owner_of(endpoint))[0]  # a replica's: its stage
            errors[rid] = Error(
                request_id=rid,
                stage=stage,
                message=f"gateway on node {self.node_id[:12]}: a message of stage {stage!r} "
                f"to {endpoint} was lost: {why}",
                code=GATEWAY_ERROR,
            )
        if errors:
            self.out(outs, RESULTS).send(encode_frame(list(errors.values())))

    def drop(self, endpoint: str, frame: bytes, outs: dict[str, zmq.Socket], why: str) -> None:
        """Give up on ``frame``: release the slots it holds and fail its requests, as far
        as it can be decoded. Never raises (it runs on error paths)."""
        with self.lock:
            self.dropped += 1
        reader = reader_of(endpoint)
        if reader is None:  # control or status messages: nothing to release, no request
            log.error("gateway %s: %s: a frame was dropped: %s", self.node_id[:8], endpoint, why)
            return
        try:
            msgs, lost = self.decode(endpoint, frame)
            shm = [h for m in msgs for h in _handles(m).values() if isinstance(h, ShmHandle)]
            self.release(shm, reader, outs, endpoint)
            lost += [_lost(m, why) for m in msgs if not _ours(m)]
            self.fail_requests(lost, endpoint, outs)
        except Exception:
            log.exception(
                "gateway %s: %s: cannot clean up after a dropped frame", self.node_id[:8], endpoint
            )

    def decode(self, endpoint: str, frame: bytes) -> tuple[list[Any], list[Lost]]:
        """The messages of a data or results frame, and those that do not decode (what can
        be told of them): one bad message costs only its own request."""
        try:
            return decode_data_frame(frame), []
        except msgspec.DecodeError:
            msgs, bad = salvage_frame(frame, "data")
        for b in bad:
            log.error(
                "gateway %s: %s: an undecodable message of request %s was dropped: %s",
                self.node_id[:8],
                endpoint,
                b.request_id,
                b.error,
                extra={"request_id": b.request_id},
            )
        return msgs, [(b.request_id, b.stage or "", f"undecodable message: {b.error}") for b in bad]

    def inline(
        self,
        frame: bytes,
        endpoint: str,
        outs: dict[str, zmq.Socket],
        refs: list[Any] | None = None,
    ) -> bytes | None:
        """Copy the shared-memory arrays of ``frame`` into it, or put the large ones into
        the object store (their references appended to ``refs``); release their slots.

        A message that does not decode, or whose arrays cannot be read, is left out: its
        slots are released and its request fails; the rest of the frame goes on (None:
        nothing is left of it)."""
        reader = reader_of(endpoint)
        if reader is None:
            return frame
        msgs, lost = self.decode(endpoint, frame)
        freed: list[ShmHandle] = []
        kept: list[Any] = []
        for m in msgs:
            handles = _handles(m)
            if not handles:
                kept.append(m)
                continue
            shm = [h for h in handles.values() if _in_slot(h)]
            freed.extend(shm)  # read now, or never: the slots go back either way
            objects = [h for h in handles.values() if isinstance(h, ShmHandle) and not _in_slot(h)]
            try:
                mine: list[Any] | None = [] if refs is not None else None
                copied = {key: self.copy(h, mine) for key, h in handles.items()}
            except Exception as e:
                log.exception(
                    "gateway %s: %s: cannot read the arrays of a message of request %s; "
                    "it is dropped and its request fails",
                    self.node_id[:8],
                    endpoint,
                    m.request_id,
                    extra={"request_id": m.request_id},
                )
                lost.append(_lost(m, f"its arrays cannot be read: {type(e).__name__}: {e}"))
                freed.extend(objects)  # its producer's objects are not read either
                continue
            handles.update(copied)
            kept.append(m)
            if refs is not None and mine:
                refs.extend(mine)
        if not lost and not freed:
            return frame
        out = encode_frame(kept) if kept else None  # before any release: this may raise
        self.release(freed, reader, outs, endpoint)
        if lost:
            with self.lock:
                self.dropped += len(lost)
            self.fail_requests(lost, endpoint, outs)
        return out

    def copy(self, h: Any, refs: list[Any] | None = None) -> Any:
        """An array handle as an :class:`InlineArray` (a copy of its slot's bytes), or,
        from ``object_threshold`` bytes (when ``refs`` is given), as a handle of an object
        in Ray's object store (its reference appended to ``refs``)."""
        if not _in_slot(h):
            return h  # inline already, or in the object store already (its producer put it)
        buf = self.reader.buffer(h.segment)
        if h.offset + h.nbytes > len(buf):
            raise ValueError(
                f"handle of {h.nbytes} bytes at offset {h.offset} lies beyond segment "
                f"{h.segment} ({len(buf)} bytes)"
            )
        limit = self.object_threshold
        if refs is not None and limit is not None and h.nbytes >= limit:
            import ray

            view = np.frombuffer(buf, np.uint8, count=h.nbytes, offset=h.offset)
            ref = ray.put(view)  # one copy, into this node's object store
            with self.lock:
                self.puts += 1
            refs.append(ref)
            name = segment_name(self.pipeline_id, ref.hex())
            return ShmHandle(name, 0, h.nbytes, h.dtype, h.shape, h.producer, 0, h.torch)
        return InlineArray(buf[h.offset : h.offset + h.nbytes], h.dtype, h.shape, h.torch)


def _in_slot(h: Any) -> bool:
    return isinstance(h, ShmHandle) and not is_object(h.segment)


def _handles(m: Any) -> dict[str, Any]:
    return getattr(m, "device_handles", None) or {}


def _lost(m: Any, why: str) -> Lost:
    return getattr(m, "request_id", None), getattr(m, "stage", "") or "", why


def _ours(m: Any) -> bool:
    """An error this gateway made (one lost on its way is not answered with another)."""
    return type(m) is Error and m.code == GATEWAY_ERROR
