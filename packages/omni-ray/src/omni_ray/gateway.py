"""The node gateway: one Ray actor per (pipeline, node), the node's end of every path.

Every process of the pipeline on a node (stage workers, and the orchestrator on the head
node) sends to an endpoint (``WORKER.data``, ``WORKER.ctl``, ``orchestrator.status``,
``client.results``) by connecting to that endpoint's ipc socket in the node's socket
directory, exactly as on the local backend. A worker is a stage's, or one replica's of a
stage with ``replicas`` (``STAGE#i``): each replica has endpoints and a route of its own,
so replicas of one stage may live on different nodes. The gateway binds those sockets
(of every worker a stage may have, up to its ``max`` replicas) and forwards each frame,
in order, to where the endpoint lives now:

* a worker on this node: into the worker's own socket (its ``bind_dir``); the frame is
  passed as is, so arrays stay in this node's shared memory (handles, no copy);
* anywhere else: over that node's gateway's *channel* for the endpoint, a zmq TCP socket
  it binds on its node's IP next to the endpoint's ipc socket (so what arrives there is
  forwarded by the same thread, in order): frames go as their senders batched them, many
  events per write, no Ray call per frame; one connection per (node pair, endpoint), so
  a full consumer stalls only its own senders. The orchestrator's endpoints (it binds
  them itself), and every endpoint without channels (``channel_ip=None``), take a Ray
  actor call on that node's gateway instead (Ray carries the frames, through its object
  store when large; stop-and-wait per endpoint, frames batched). Arrays that sit in this
  node's shared memory are first copied into the frame (a node cannot map another's
  memory) and their slots released; large ones are put into Ray's object store instead,
  the frame carries their handles and a Ray call (before the frame) their references,
  which the receiving gateway holds for the reader until its release comes back (see
  :mod:`omni_ray.objects`).

Senders never learn where a worker runs, so a worker restarted on another node needs only
a route change. Order per sender is kept, and a full consumer pushes back through the
sockets (and channels) to its producers. The gateway also creates and unlinks the
shared-memory segments of the workers on its node: they outlive a crashed worker, as with
the local orchestrator.

Channels are authenticated and encrypted (ZMQ CURVE with the pipeline's server key and a
client key per node, see :mod:`omni_ray.channel_auth`): a peer without them never gets a
message through, and its failed handshakes are counted (``info()["auth_failures"]``); each
frame that gets through names its sending node. What an admitted peer (another node's
gateway of this pipeline) sends is still checked (:meth:`FrameGuard.screen`): the
orchestrator's messages (a ``Submit``, and every control message but a ``Release``) are
taken from the head node alone; another node never holds nor is lent a slot of this node's
segments, so a slot handle or a ``Release`` arriving over a channel is refused
(``info()["refused"]``), and a data message holding one fails its request; an object
handle must name this pipeline's objects, and a reader is lent only what is held for it
(:meth:`HeldObjects.lend`).

Ray names no caller, so every actor method that changes something, or hands out what is
not its caller's, takes a *pass* first (:mod:`omni_ray.grants`), checked before anything
else: the launcher's alone may set routes, admit peers, unlink segments and close the
gateway; a node's may deliver frames, hold objects for a reader here and release its own
holds; only this node's (its workers, which read its secret in the socket directory) may
be lent objects, create segments and read the routes. A refused call raises
:class:`PermissionError` (``info()["calls_refused"]``). What a delivered frame carries is
screened as on a channel, with the node its pass proved as its sender (frames to the
head's results and status endpoints always come this way): the orchestrator's messages
from the head alone, no slot handle nor ``Release`` from another node, and a status
message only about a worker its sender runs (or one not placed yet). A node releases only
what it held (:class:`HeldObjects`). ``info`` and ``failure`` are open (read-only).

A forwarding thread never dies silently. A frame or message it cannot handle (one that
does not decode, an array whose slot cannot be read, a delivery that fails unexpectedly)
is logged (an unexpected exception with its traceback) and dropped: the shared-memory
slots it holds go back to their producers, its requests end with an error (code
``gateway_error``), and the other messages of its frame and the frames after it still go
through. Only a broken socket ends a thread: that is
logged loudly and reported by :meth:`NodeGateway.failure` (and ``info()``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import zmq
from omni_core.dataplane.shm import SegmentOwner, SegmentReader
from omni_core.dataplane.transport import (
    RESULTS,
    STATUS,
    Addresses,
    make_socket_dir,
    pull_socket,
    push_socket,
    remove_socket_dir,
)
from omni_core.worker.host import CLIENT

from omni_ray.channel_auth import ChannelKeys, HandshakeWatch, ZapHandler
from omni_ray.frames import GATEWAY_ERROR, FrameGuard
from omni_ray.grants import (
    CONTROL,
    CallerCheck,
    Grants,
    NodeGrant,
    Pass,
    Peer,
    node_pass,
    write_secret,
)
from omni_ray.objects import HeldObjects, take_releases
from omni_ray.routes import DRIVER, gateway_name, owner_of, reader_of

try:  # where other nodes' gateways reach this one's channels
    from ray.util import get_node_ip_address
except ImportError:  # pragma: no cover - ray is a dependency
    get_node_ip_address = None

log = logging.getLogger("omni.ray.gateway")

MAX_BATCH_FRAMES = 64  # frames forwarded in one actor call
MAX_BATCH_BYTES = 64 << 20  # a call's frames sit in Ray's object store at once
HWM = 1000
_ZERO_COPY = 1 << 20
RETRY_S = 0.02  # between tries of a delivery (a route being set, a gateway restarting)
RETRY_MS = int(RETRY_S * 1000)
ERROR_PAUSE_S = 0.1  # after an unexpected error, so a recurring one cannot spin a core
LOCAL, NODES = "@local", "@nodes"  # who may call a method: this node's, any node's pass
LOGGED_REFUSALS = 20  # refused calls each logged; then one in a thousand

__all__ = ["GATEWAY_ERROR", "NodeGateway", "gateway_name"]


class NodeGateway:
    """Run as a Ray actor (threaded), pinned to its node. See the module docstring."""

    def __init__(
        self,
        pipeline_id: str,
        node_id: str,
        head_node: str,
        workers: list[str],
        channel_ip: str | None = "auto",
        keys: ChannelKeys | None = None,
        peers: dict[str, Peer] | None = None,
        grant: NodeGrant | None = None,
    ) -> None:
        """``workers``: every worker name of the pipeline (stages, and ``STAGE#i`` for each
        replica a stage may have). ``channel_ip``: the address this node's channels bind
        (``"auto"``: the node's IP as Ray knows it; None: no channels, every frame goes by
        Ray actor calls). ``keys``: this node's channel keys (None: keys of its own).
        ``peers``: what this gateway knows of each other node that may call it (more come
        by :meth:`admit`). ``grant``: its node's secret and the launcher's token (None: a
        grant of its own, whose control pass nobody holds)."""
        if channel_ip == "auto":
            channel_ip = get_node_ip_address() if get_node_ip_address else None
        self.channel_ip = channel_ip
        self.keys = keys or (ChannelKeys.new() if channel_ip is not None else None)
        self.auth_failures = 0  # failed handshakes on this node's channels
        self.channels: dict[str, str] = {}  # endpoint -> its channel's TCP address
        self.peers: dict[str, dict[str, str]] = {}  # other node -> its channels
        self._tls = threading.local()  # a forwarding thread's sockets to other channels
        self.channel_frames = 0  # frames sent over channels
        self.pipeline_id = pipeline_id
        self.node_id = node_id
        self.grant = grant or Grants().grant(node_id)
        self.callers = CallerCheck(self.grant, peers)
        self.calls_refused = 0  # actor calls refused: a wrong pass, or what is not theirs
        self.server_keys: dict[str, bytes] = {}  # other node -> its channels' server key
        self._call_outs = threading.local()  # a Ray call thread's sockets (deliver)
        self.socket_dir = make_socket_dir()
        self.bind_dir = os.path.join(self.socket_dir, "in")
        os.mkdir(self.bind_dir, 0o700)
        write_secret(self.socket_dir, self.grant.secret)  # for this node's workers
        self.addr = Addresses(self.socket_dir)  # what senders on this node connect to
        self.inner = Addresses(self.bind_dir)  # what workers on this node bind
        self.segments = SegmentOwner(token=pipeline_id)
        self.reader = SegmentReader()
        self.zctx = zmq.Context()
        self.lock = threading.Lock()
        self.failures: dict[str, str] = {}  # endpoint -> why its thread stopped for good
        self.zap = None
        if self.keys is not None:  # before any channel binds: each handshake asks it
            self.zap = ZapHandler(self.zctx, {}, self._zap_failed)
        self._admit(peers or {})
        self.routes: dict[str, str | None] = dict.fromkeys(workers)  # worker -> its node
        self.routes[DRIVER] = head_node
        self.versions: dict[str, int] = {}  # route updates may arrive out of order
        self.gateways: dict[str, Any] = {}
        self.local: dict[str, tuple[threading.Lock, zmq.Socket]] = {}  # delivery sockets
        self.stop = False
        self.frames = FrameGuard(
            node_id,
            self.addr,
            self.zctx,
            self.reader,
            pipeline_id,
            forget_objects=self._forget,
            head_node=head_node,
            lives_on=self._lives_on,
        )
        self.held = HeldObjects()  # objects lent to readers on this node, until released
        names = Addresses.names(workers)
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
        with self.lock:
            failures = dict(self.failures)
        with self.frames.lock:
            dropped, puts, refused = self.frames.dropped, self.frames.puts, self.frames.refused
        return {
            "socket_dir": self.socket_dir,
            "bind_dir": self.bind_dir,
            "failures": failures,
            "dropped": dropped,
            "auth_failures": self.auth_failures,  # handshakes refused on the channels
            "refused": refused,  # messages from other nodes that touched what is not theirs
            "calls_refused": self.calls_refused,  # actor calls: a wrong pass, or not theirs
            "objects_held": len(self.held),
            "objects_held_for": self.held.by_reader(),
            "objects_put": puts,  # from slots (producers put theirs themselves)
            "channel_frames": self.channel_frames,
            "objects_released": self.held.released,
        }

    def failure(self) -> dict[str, str] | None:
        """None while every forwarding thread runs; else ``{"part", "error"}``: which
        endpoints this node no longer forwards, and why (a thread that cannot go on)."""
        with self.lock:
            failures = dict(self.failures)
        if not self.stop:
            for t in self.threads:
                name = t.name.removeprefix("gw-")
                if not t.is_alive() and name not in failures:
                    failures[name] = "its forwarding thread ended"
        if not failures:
            return None
        return {
            "part": f"gateway on node {self.node_id}: " + ", ".join(sorted(failures)),
            "error": "; ".join(f"{ep}: {why}" for ep, why in sorted(failures.items())),
        }

    # ------------------------------------------------------------------ who calls
    def _caller(self, method: str, who: Any, *allowed: str) -> str:
        """The caller ``who`` proves to be, if it is one of ``allowed`` (:data:`CONTROL`,
        :data:`LOCAL`: this node's, :data:`NODES`: any node's); else the call is
        refused (counted, logged): :class:`PermissionError`."""
        caller = self.callers.caller(who)
        ok = caller is not None and (
            (CONTROL in allowed and caller == CONTROL)
            or (LOCAL in allowed and caller == self.node_id)
            or (NODES in allowed and caller != CONTROL)
        )
        if not ok:
            claimed = who[0] if isinstance(who, tuple | list) and who else type(who).__name__
            self._refuse_call(method, f"a pass of {str(claimed)[:40]!r} not good for it")
        return caller  # type: ignore[return-value]

    def _refuse_call(self, method: str, why: str) -> None:
        with self.lock:
            self.calls_refused += 1
            n = self.calls_refused
        if n <= LOGGED_REFUSALS or n % 1000 == 0:  # a flood of them cannot flood the log
            log.warning(
                "gateway %s: refused a call of %s: %s (%d refused so far)",
                self.node_id[:8],
                method,
                why,
                n,
            )
        raise PermissionError(f"gateway on node {self.node_id[:12]}: {method} refused: {why}")

    def _pass(self, node: str) -> Pass:
        """This node's pass for ``node``'s gateway."""
        return node_pass(self.node_id, self.grant.secret, node)

    def _admit(self, peers: dict[str, Peer]) -> None:
        self.callers.admit(peers)
        with self.lock:
            for node, peer in peers.items():
                if peer.server_public is not None:
                    self.server_keys[node] = peer.server_public
        if self.zap is not None:
            self.zap.admit({n: p.client_public for n, p in peers.items() if p.client_public})

    def _lives_on(self, worker: str) -> str | None:
        """The node ``worker`` runs on (None: unknown, or not placed)."""
        with self.lock:
            return self.routes.get(worker)

    def channel_addresses(self, who: Pass, timeout_s: float = 10.0) -> dict[str, str]:
        """Where other nodes' gateways send this node's endpoints' frames (TCP), once
        every forwarding thread has bound its channel; for a node's pass, once that
        node's key is admitted too (a refused handshake is not retried), else none
        (its gateway sends by actor calls)."""
        caller = self._caller("channel_addresses", who, NODES, CONTROL)
        for_node = "" if caller == CONTROL else caller
        end = time.monotonic() + timeout_s
        while self.channel_ip is not None and time.monotonic() < end:
            with self.lock:
                bound = len(self.channels) + len(self.failures) >= len(self.threads)
            if bound and (not for_node or (self.zap is not None and self.zap.admits(for_node))):
                break
            time.sleep(0.01)
        if for_node and (self.zap is None or not self.zap.admits(for_node)):
            log.warning(
                "gateway %s: node %s's channel key is not known here: it sends by actor calls",
                self.node_id[:8],
                for_node[:8],
            )
            return {}
        with self.lock:
            return dict(self.channels)

    def admit(self, who: Pass, peers: dict[str, Peer]) -> None:
        """Admit these nodes' calls and their gateways on the channels (the launcher's)."""
        self._caller("admit", who, CONTROL)
        self._admit(peers)

    def set_routes(self, who: Pass, routes: dict[str, tuple[str | None, int]]) -> None:
        """``{worker: (node or None while it is not placed, version)}``; newer wins (the
        launcher's alone)."""
        self._caller("set_routes", who, CONTROL)
        with self.lock:  # with the routes: a hold checks the route under the same lock
            for worker, (node, version) in routes.items():
                if worker == DRIVER or worker not in self.routes:
                    continue  # the orchestrator's node is fixed; no such worker
                if version > self.versions.get(worker, -1):
                    if self.routes.get(worker) == self.node_id:
                        # its life here ended (or it moved): what that life was lent,
                        # or was to be, it will not release
                        self.held.forget_reader(worker)
                    if self.routes.get(worker) is not None:  # a life ended (anywhere)
                        self.held.forget_producer(worker)
                    self.routes[worker] = node
                    self.versions[worker] = version

    def current_routes(self, who: Pass) -> tuple[dict[str, str | None], dict[str, int]]:
        """Where each worker lives now (``DRIVER``: the orchestrator's node), and the
        version of each worker's route (one per life and move); for this node's workers."""
        self._caller("current_routes", who, LOCAL)
        with self.lock:
            return dict(self.routes), dict(self.versions)

    def create_segment(self, who: Pass, worker: str, size: int) -> str:
        """A shared-memory segment for ``worker`` (a worker of the pipeline, on this
        node: its own process asks)."""
        self._caller("create_segment", who, LOCAL)
        if not isinstance(worker, str) or worker == DRIVER or worker not in self.routes:
            self._refuse_call("create_segment", f"{str(worker)[:40]!r} is no worker of it")
        if type(size) is not int or size <= 0:
            self._refuse_call("create_segment", f"a size of {str(size)[:20]}")
        return self.segments.create(worker, size)

    def unlink_segment(self, who: Pass, name: str) -> None:
        """Unlink a worker's segment (the launcher's: the worker's life ended)."""
        self._caller("unlink_segment", who, CONTROL)
        self.reader.forget(name)
        self.segments.unlink(name)

    def _zap_failed(self, why: str) -> None:
        with self.lock:
            self.failures["channel authentication"] = why

    def close(self, who: Pass) -> None:
        """Stop forwarding, unlink this node's segments, remove the socket directory (the
        launcher's alone)."""
        self._caller("close", who, CONTROL)
        self.stop = True
        for t in self.threads:
            t.join(timeout=2)
        if self.zap is not None:
            self.zap.close()
        self.held.clear()
        self.segments.unlink_all()
        self.zctx.destroy(linger=0)
        remove_socket_dir(self.socket_dir)

    # ------------------------------------------------------------------ data path
    def deliver(
        self, who: Pass, endpoint: str, frames: list[Any], refs: list[Any] | None = None
    ) -> bool:
        """Frames from another node's gateway for ``endpoint``, with the references to the
        objects their large arrays are in (held here until the reader releases them);
        False: it is not here (any more), the sender asks for the route again. Each
        frame is screened as one from a channel, its sender the node ``who`` proves."""
        sender = self._caller("deliver", who, NODES)
        self._endpoint("deliver", endpoint)
        if refs:
            if not self._hold(sender, endpoint, refs):  # (it checks the route)
                return False
        elif self._route(endpoint) != self.node_id:
            return False
        outs = self._call_outs.__dict__.setdefault("outs", {})
        lock, sock = self._local_socket(endpoint)
        with lock:
            for f in frames:
                f = self.frames.screen(endpoint, f, outs, sender)
                if f is not None and not self._send(sock, f):
                    return False
        return True

    def _endpoint(self, method: str, endpoint: Any) -> None:
        """Refuse a call naming an endpoint this gateway does not forward."""
        ok = isinstance(endpoint, str) and (
            endpoint in (STATUS, RESULTS)  # the orchestrator's
            or (
                owner_of(endpoint) != DRIVER
                and owner_of(endpoint) in self.routes
                and endpoint.endswith((".data", ".ctl"))
            )
        )
        if not ok:
            self._refuse_call(method, f"no endpoint {str(endpoint)[:60]!r} here")

    def hold(
        self, who: Pass, endpoint: str, refs: list[Any], producer: str = "", life: int = -1
    ) -> bool:
        """Hold ``refs`` for the reader of ``endpoint`` (their frames follow), as the
        caller's node's (only it may release them); False: the reader is not here (any
        more), or ``producer`` (the worker that put them, if not a gateway) is known here
        to have ended the life (its route's version) it sent them in: they died with it,
        and this call may have come late."""
        holder = self._caller("hold", who, NODES)
        self._endpoint("hold", endpoint)
        if reader_of(endpoint) is None:
            self._refuse_call("hold", f"{endpoint[:60]!r} has no reader of arrays")
        return self._hold(holder, endpoint, refs, producer, life)

    def _hold(
        self, holder: str, endpoint: str, refs: list[Any], producer: str = "", life: int = -1
    ) -> bool:
        with self.lock:
            if self.routes.get(owner_of(endpoint)) != self.node_id:
                return False
            if producer and self.versions.get(producer, -1) > life:
                return False
            refused = self.held.hold(reader_of(endpoint) or "", refs, producer, holder)
        if refused:  # objects another node holds here: not this caller's to hold again
            self._refuse_call("hold", f"{refused} object(s) another node holds here")
        return True

    def release(self, who: Pass, reader: str, keys: list[str]) -> None:
        """``reader`` will not read these objects (their message was dropped on its way):
        the caller's node lets go of what it held here, and only that."""
        holder = self._caller("release", who, NODES)
        refused = self.held.release(reader, keys, holder)
        if refused:
            self._refuse_call("release", f"{refused} object(s) another node holds here")

    def _forget(self, endpoint: str, keys: list[str]) -> None:
        """The reader of ``endpoint`` will not read these objects: its gateway lets go."""
        reader, node = reader_of(endpoint) or "", self._route(endpoint)
        if node == self.node_id:
            self.held.release(reader, keys)
        elif node is not None:  # (None: its life ended, and what it held went with it)
            with contextlib.suppress(ValueError):  # that node's gateway is gone
                self._gateway(node).release.remote(self._pass(node), reader, keys)

    def lend(self, who: Pass, keys: list[str], reader: str) -> list[Any]:
        """``reader`` on this node asks for the references of objects it was sent (in
        a list: each is passed in-band, so the reader borrows it); None: not held here
        for it. Only for this node's processes, and a reader that lives here."""
        self._caller("lend", who, LOCAL)
        here = self._lives_on(DRIVER if reader == CLIENT else reader) == self.node_id
        if not isinstance(reader, str) or not here:
            self._refuse_call("lend", f"reader {str(reader)[:40]!r} does not live here")
        return self.held.lend(keys, reader)

    def _gateway(self, node: str) -> Any:
        import ray

        with self.lock:
            gw = self.gateways.get(node)
        if gw is None:
            gw = ray.get_actor(gateway_name(self.pipeline_id, node))
            with self.lock:
                self.gateways[node] = gw
        return gw

    def _channel(self, node: str, gw: Any, endpoint: str) -> str | None:
        """``node``'s channel for ``endpoint`` (None: frames for it go by actor calls)."""
        if owner_of(endpoint) == DRIVER or self.channel_ip is None:
            return None  # the orchestrator binds its own endpoints: no channel there
        with self.lock:
            if node not in self.server_keys:
                return None  # its channels' key is not known here: actor calls
            peer = self.peers.get(node)
        if peer is None:
            import ray

            peer = ray.get(gw.channel_addresses.remote(self._pass(node)), timeout=60)
            with self.lock:
                self.peers[node] = peer
        return peer.get(endpoint)

    def _send_channel(self, node: str, endpoint: str, address: str, frames: list[bytes]) -> bool:
        """Send ``frames`` over a channel, in order, each leaving the list once sent; a
        full channel waits (backpressure). False: the endpoint's route left ``node``
        while waiting (what the channel still queued was for a life that ended: dropped
        with it) or the gateway stops."""
        socks = self._tls.__dict__.setdefault("socks", {})
        sock = socks.get(address)
        if sock is None:
            keys = self.keys
            assert keys is not None  # (channels exist only with keys)
            server = self.server_keys[node]  # (a channel is asked for only once admitted)
            sock = socks[address] = push_socket(
                self.zctx, address, HWM, lambda s: keys.client(s, server)
            )
        while frames:
            frame = frames[0]
            while True:
                if self.stop:
                    return False
                try:
                    sock.send(frame, zmq.NOBLOCK, copy=len(frame) < _ZERO_COPY)
                    break
                except zmq.Again:
                    if self._route(endpoint) != node:
                        del socks[address]
                        sock.close(linger=0)
                        return False
                    sock.poll(100, zmq.POLLOUT)
            del frames[0]
            self.channel_frames += 1
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
        """One thread per endpoint: take what senders on this node wrote, pass it on.

        What goes wrong with one frame is that frame's problem (see :meth:`_drop`); only
        a broken socket ends the thread, loudly (see :meth:`failure`)."""
        socks: list[zmq.Socket] = []
        outs: dict[str, zmq.Socket] = {}  # releases to producers, errors to the client
        control = endpoint.endswith(".ctl")  # the releases of lent objects end here
        watch: HandshakeWatch | None = None
        try:
            pull = pull_socket(self.zctx, self.addr.endpoint(endpoint), HWM)
            socks.append(pull)
            poller = zmq.Poller()
            poller.register(pull, zmq.POLLIN)
            chan = None
            if self.channel_ip is not None:  # frames from other nodes' gateways (CURVE)
                assert self.keys is not None
                chan = pull_socket(self.zctx, f"tcp://{self.channel_ip}:*", HWM, self.keys.serve)
                socks.append(chan)
                watch = HandshakeWatch(chan)
                poller.register(chan, zmq.POLLIN)
                poller.register(watch.monitor, zmq.POLLIN)
                with self.lock:
                    self.channels[endpoint] = chan.getsockopt_string(zmq.LAST_ENDPOINT)
            local = push_socket(self.zctx, self.inner.endpoint(endpoint), HWM)
            socks.append(local)
            # frames taken in but not passed on: their worker is (re)starting, not placed
            waiting: list[bytes] = []
            while not self.stop:
                # control frames are small (releases, cancels): they are always taken in,
                # so that a release of an object is not held up behind a full batch
                room = control or len(waiting) < MAX_BATCH_FRAMES
                if not room:  # (the sockets are not read: their senders wait)
                    time.sleep(RETRY_S)
                ready = dict(poller.poll(RETRY_MS if waiting else 100)) if room else {}
                if watch is not None and watch.monitor in ready:
                    failed = watch.count()
                    with self.lock:
                        self.auth_failures += failed
                if chan is not None and self.zap is not None and self.zap.failed:
                    # no peer can be authenticated any more: no channel stays open
                    poller.unregister(chan)
                    chan.close(linger=0)
                    chan = None
                    log.critical(
                        "gateway %s: %s: channel closed (the ZAP handler failed)",
                        self.node_id[:8],
                        endpoint,
                    )
                pending = _take(pull) if pull in ready else []
                incoming = _take_channel(chan) if chan is not None and chan in ready else []
                if not pending and not incoming and not waiting:
                    continue
                try:
                    for f, sender in incoming:  # from another node: what it may not send
                        f = self.frames.screen(endpoint, f, outs, sender)  # is refused
                        if f is not None:
                            pending.append(f)
                    if control:  # at once, even while earlier frames wait for a place
                        pending = [f for f in (take_releases(f, self.held) for f in pending) if f]
                    waiting.extend(pending)
                    self._pass_on(endpoint, waiting, local, outs)
                except zmq.ZMQError:
                    raise  # a socket of this thread is broken: it cannot go on
                except Exception as e:
                    log.exception(
                        "gateway %s: %s: unexpected error forwarding %d frame(s); dropped",
                        self.node_id[:8],
                        endpoint,
                        len(waiting),
                    )
                    for f in waiting:  # the frames not passed on yet
                        self.frames.drop(endpoint, f, outs, f"{type(e).__name__}: {e}")
                    waiting.clear()
                    time.sleep(ERROR_PAUSE_S)
        except BaseException as e:
            if not self.stop:
                log.critical(
                    "gateway %s: forwarding of %s stopped for good: frames sent to it on "
                    "this node are no longer delivered",
                    self.node_id[:8],
                    endpoint,
                    exc_info=True,
                )
                with self.lock:  # after the log: whoever sees the failure finds the log
                    self.failures[endpoint] = f"{type(e).__name__}: {e}"
        finally:
            if watch is not None:
                watch.close()
            channels = getattr(self._tls, "socks", {})
            for s in (*socks, *outs.values(), *channels.values()):
                with contextlib.suppress(Exception):
                    s.close(linger=0)

    def _pass_on(
        self, endpoint: str, pending: list[bytes], local: zmq.Socket, outs: dict[str, zmq.Socket]
    ) -> None:
        """Forward ``pending`` in order; each frame leaves the list once it is passed on
        (or dropped), so the caller knows what is left should this raise. Returns with
        frames left while their worker is not placed (it is restarting): the caller takes
        in what comes meanwhile (a reader's release of an object ends at this gateway, and
        must not wait for the producer's new life) and calls again."""
        inlined = False
        refs: list[Any] = []
        while pending and not self.stop:
            target = self._route(endpoint)
            if target == self.node_id and owner_of(endpoint) != DRIVER:
                while pending:
                    if not self._send(local, pending[0]):
                        return  # the gateway is closing
                    del pending[0]
                return
            if target is None:  # the worker is (re)starting: wait for its place
                if not inlined:
                    return
                # what these frames carry was for its earlier life (whose requests
                # failed with it): their objects are not kept waiting in the store
                refs.clear()
                time.sleep(RETRY_S)
                continue
            if not inlined:
                pending[:], refs = self.frames.inline_all(endpoint, pending, outs)
                inlined = True
                if not pending:
                    return
            if self._deliver_remote(target, endpoint, pending, refs):
                pending.clear()
                return
            time.sleep(RETRY_S)

    def _deliver_remote(
        self, node: str, endpoint: str, frames: list[bytes], refs: list[Any] | None = None
    ) -> bool:
        """Pass ``frames`` to ``node``'s gateway: over its channel for ``endpoint`` (frames
        leave the list as they are sent, so on False only the unsent are left), else by an
        actor call. ``refs`` go in a list: nested, so the receiving gateway borrows them
        (in-band), and this one, their owner, may drop its own once the call returned."""
        import ray

        try:
            gw = self._gateway(node)
            channel = self._channel(node, gw, endpoint)
            if channel is not None:
                if refs and not ray.get(gw.hold.remote(self._pass(node), endpoint, refs)):
                    return False  # not there any more: ask the route again
                return self._send_channel(node, endpoint, channel, frames)
            # large frames as numpy arrays: Ray moves those without pickling copies, and
            # the receiver hands the object store's view straight to zmq
            wire = [np.frombuffer(f, np.uint8) if len(f) >= _ZERO_COPY else f for f in frames]
            return bool(ray.get(gw.deliver.remote(self._pass(node), endpoint, wire, refs or [])))
        except (ValueError, ray.exceptions.RayError) as e:  # no such gateway, or it died
            with self.lock:
                self.gateways.pop(node, None)
                self.peers.pop(node, None)
            log.warning(
                "gateway %s: cannot deliver %s to node %s: %s",
                self.node_id[:8],
                endpoint,
                node[:8],
                e,
            )
            return False


def _take_channel(sock: zmq.Socket) -> list[tuple[bytes, str | None]]:
    """Like :func:`_take`, from a channel: each frame with its sending node (the User-Id
    the ZAP handler gave its connection)."""
    out: list[tuple[bytes, str | None]] = []
    size = 0
    while len(out) < MAX_BATCH_FRAMES and size < MAX_BATCH_BYTES:
        try:
            msg = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
        try:
            sender: str | None = msg.get("User-Id")
        except zmq.ZMQError:  # no such property: not authenticated
            sender = None
        out.append((msg.bytes, sender or None))
        size += len(out[-1][0])
    return out


def _take(sock: zmq.Socket) -> list[bytes]:
    """What ``sock`` holds now, up to a batch (:data:`MAX_BATCH_FRAMES`, about
    :data:`MAX_BATCH_BYTES`)."""
    out: list[bytes] = []
    size = 0
    while len(out) < MAX_BATCH_FRAMES and size < MAX_BATCH_BYTES:
        try:
            out.append(sock.recv(zmq.NOBLOCK, copy=True))
        except zmq.Again:
            break
        size += len(out[-1])
    return out
