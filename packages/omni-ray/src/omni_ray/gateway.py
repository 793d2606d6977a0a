"""The node gateway: one Ray actor per (pipeline, node), the node's end of every path.

Every process of the pipeline on a node (stage workers, and the orchestrator on the head
node) sends to an endpoint (``stage.data``, ``stage.ctl``, ``orchestrator.status``,
``client.results``) by connecting to that endpoint's ipc socket in the node's socket
directory, exactly as on the local backend. The gateway binds those sockets and forwards
each frame, in order, to where the endpoint lives now:

* a stage on this node: into the stage's own socket (its ``bind_dir``); the frame is
  passed as is, so arrays stay in this node's shared memory (handles, no copy);
* anywhere else: a Ray actor call on that node's gateway (Ray carries the frame, through
  its object store when large). Arrays that sit in this node's shared memory are first
  copied into the frame (a node cannot map another's memory) and their slots released.

Senders never learn where a stage runs, so a stage restarted on another node needs only a
route change. Forwarding is stop-and-wait per (gateway, endpoint) with frames batched, so
order per sender is kept and a full consumer pushes back through the sockets to its
producers. The gateway also creates and unlinks the shared-memory segments of the stages
on its node: they outlive a crashed worker, as with the local orchestrator.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from typing import Any

import numpy as np
import zmq
from omni_core.events import InlineArray, ShmHandle
from omni_core.host import CLIENT
from omni_core.serial import decode_data_frame, encode_frame, releases
from omni_core.shm import SegmentOwner, SegmentReader
from omni_core.transport import (
    RESULTS,
    STATUS,
    Addresses,
    make_socket_dir,
    pull_socket,
    push_socket,
)

log = logging.getLogger("omni.ray")

DRIVER = "@driver"  # the route owner of the orchestrator's endpoints
MAX_BATCH_FRAMES = 64  # frames forwarded in one actor call
MAX_BATCH_BYTES = 64 << 20  # a call's frames sit in Ray's object store at once
_SHM_TAG = b"\xa3shm"  # msgpack of the string "shm", the tag of an array-like ShmHandle
HWM = 1000
_ZERO_COPY = 1 << 20


def gateway_name(pipeline_id: str, node_id: str) -> str:
    return f"omni-gw-{pipeline_id}-{node_id}"


def owner_of(endpoint: str) -> str:
    """The route key of an endpoint: its stage, or DRIVER for the orchestrator's."""
    if endpoint in (STATUS, RESULTS):
        return DRIVER
    return endpoint.rsplit(".", 1)[0]


def reader_of(endpoint: str) -> str | None:
    """Who reads the arrays of frames sent to ``endpoint`` (None: frames carry none)."""
    if endpoint == RESULTS:
        return CLIENT
    if endpoint.endswith(".data"):
        return endpoint.rsplit(".", 1)[0]
    return None


class NodeGateway:
    """Run as a Ray actor (threaded), pinned to its node. See the module docstring."""

    def __init__(self, pipeline_id: str, node_id: str, head_node: str, stages: list[str]) -> None:
        self.pipeline_id = pipeline_id
        self.node_id = node_id
        self.socket_dir = make_socket_dir()
        self.bind_dir = os.path.join(self.socket_dir, "in")
        os.mkdir(self.bind_dir, 0o700)
        self.addr = Addresses(self.socket_dir)  # what senders on this node connect to
        self.inner = Addresses(self.bind_dir)  # what stages on this node bind
        self.segments = SegmentOwner(token=pipeline_id)
        self.reader = SegmentReader()
        self.zctx = zmq.Context()
        self.lock = threading.Lock()
        self.routes: dict[str, str | None] = dict.fromkeys(stages)
        self.routes[DRIVER] = head_node
        self.versions: dict[str, int] = {}  # route updates may arrive out of order
        self.gateways: dict[str, Any] = {}
        self.local: dict[str, tuple[threading.Lock, zmq.Socket]] = {}  # delivery sockets
        self.stop = False
        names = Addresses.names(stages)
        if node_id == head_node:  # the orchestrator binds its own endpoints here
            names = [n for n in names if owner_of(n) != DRIVER]
        self.threads = [
            threading.Thread(target=self._forward, args=(n,), daemon=True, name=f"gw-{n}")
            for n in names
        ]
        for t in self.threads:
            t.start()

    # ------------------------------------------------------------------ control (driver)
    def info(self) -> dict[str, Any]:
        return {"socket_dir": self.socket_dir, "bind_dir": self.bind_dir}

    def set_routes(self, routes: dict[str, tuple[str | None, int]]) -> None:
        """``{stage: (node or None while it is not placed, version)}``; newer wins."""
        with self.lock:
            for stage, (node, version) in routes.items():
                if version > self.versions.get(stage, -1):
                    self.routes[stage] = node
                    self.versions[stage] = version

    def create_segment(self, stage: str, size: int) -> str:
        return self.segments.create(stage, size)

    def unlink_segment(self, name: str) -> None:
        self.reader.forget(name)
        self.segments.unlink(name)

    def close(self) -> None:
        """Stop forwarding, unlink this node's segments, remove the socket directory."""
        self.stop = True
        for t in self.threads:
            t.join(timeout=2)
        self.segments.unlink_all()
        self.zctx.destroy(linger=0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    # ------------------------------------------------------------------ data path
    def deliver(self, endpoint: str, frames: list[Any]) -> bool:
        """Frames from another node's gateway for ``endpoint``; False: it is not here (any
        more), the sender asks for the route again."""
        if self._route(endpoint) != self.node_id:
            return False
        lock, sock = self._local_socket(endpoint)
        with lock:
            for f in frames:
                if not self._send(sock, f):
                    return False
        return True

    def _route(self, endpoint: str) -> str | None:
        with self.lock:
            return self.routes.get(owner_of(endpoint))

    def _local_socket(self, endpoint: str) -> tuple[threading.Lock, zmq.Socket]:
        with self.lock:
            entry = self.local.get(endpoint)
            if entry is None:
                inner = self.addr if owner_of(endpoint) == DRIVER else self.inner
                sock = push_socket(self.zctx, inner.endpoint(endpoint), HWM)
                entry = self.local[endpoint] = (threading.Lock(), sock)
            return entry

    def _send(self, sock: zmq.Socket, frame: bytes) -> bool:
        """Blocking send that gives up when the gateway stops (backpressure: the consumer's
        socket is full, so this thread, and the senders behind it, wait)."""
        while not self.stop:
            try:
                sock.send(frame, zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                sock.poll(100, zmq.POLLOUT)
        return False

    def _forward(self, endpoint: str) -> None:
        """One thread per endpoint: take what senders on this node wrote, pass it on."""
        pull = pull_socket(self.zctx, self.addr.endpoint(endpoint), HWM)
        local = push_socket(self.zctx, self.inner.endpoint(endpoint), HWM)
        ctl: dict[str, zmq.Socket] = {}  # releases of inlined slots to their producers
        try:
            while not self.stop:
                if not pull.poll(100):
                    continue
                frames = [pull.recv(copy=True)]
                size = len(frames[0])
                while len(frames) < MAX_BATCH_FRAMES and size < MAX_BATCH_BYTES:
                    try:
                        frames.append(pull.recv(zmq.NOBLOCK, copy=True))
                    except zmq.Again:
                        break
                    size += len(frames[-1])
                inlined = False
                while not self.stop:
                    target = self._route(endpoint)
                    if target == self.node_id and owner_of(endpoint) != DRIVER:
                        for f in frames:
                            self._send(local, f)
                        break
                    if target is None:  # the stage is (re)starting: wait for its place
                        time.sleep(0.02)
                        continue
                    if not inlined:
                        frames = [self._inline(f, endpoint, ctl) for f in frames]
                        inlined = True
                    if self._deliver_remote(target, endpoint, frames):
                        break
                    time.sleep(0.02)
        finally:
            for s in (pull, local, *ctl.values()):
                s.close(linger=0)

    def _deliver_remote(self, node: str, endpoint: str, frames: list[bytes]) -> bool:
        import ray

        gw = self.gateways.get(node)
        try:
            if gw is None:
                gw = self.gateways[node] = ray.get_actor(gateway_name(self.pipeline_id, node))
            # large frames as numpy arrays: Ray moves those without pickling copies, and
            # the receiver hands the object store's view straight to zmq
            wire = [np.frombuffer(f, np.uint8) if len(f) >= _ZERO_COPY else f for f in frames]
            return bool(ray.get(gw.deliver.remote(endpoint, wire)))
        except (ValueError, ray.exceptions.RayError) as e:  # no such gateway, or it died
            self.gateways.pop(node, None)
            log.warning(
                "gateway %s: cannot deliver %s to node %s: %s",
                self.node_id[:8],
                endpoint,
                node[:8],
                e,
            )
            return False

    def _inline(self, frame: bytes, endpoint: str, ctl: dict[str, zmq.Socket]) -> bytes:
        """Copy the shared-memory arrays of ``frame`` into it; release their slots."""
        reader = reader_of(endpoint)
        if reader is None or _SHM_TAG not in frame:
            return frame
        msgs = decode_data_frame(frame)
        freed: list[ShmHandle] = []
        for m in msgs:
            handles = getattr(m, "device_handles", None)
            if not handles:
                continue
            for key, h in handles.items():
                if isinstance(h, ShmHandle):
                    buf = self.reader.buffer(h.segment)
                    data = buf[h.offset : h.offset + h.nbytes]  # a copy (mmap slice)
                    handles[key] = InlineArray(data, h.dtype, h.shape, h.torch)
                    freed.append(h)
        if not freed:
            return frame
        for producer, rel in releases(freed, reader):
            sock = ctl.get(producer)
            if sock is None:
                sock = ctl[producer] = push_socket(self.zctx, self.addr.control(producer), 100_000)
            sock.send(encode_frame([rel]))
        return encode_frame(msgs)
