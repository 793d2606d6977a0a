"""Who may speak on a gateway's cross-node channels: ZMQ CURVE, per-pipeline and per-node keys.

The control plane (:class:`~omni_ray.launcher.RayLauncher`) makes two key pairs per node
and pipeline (:meth:`ChannelKeys.new`): a server pair (its channels') and a client pair
(its gateway's, when it sends); it hands each node's gateway its own :class:`ChannelKeys`
and the public keys of the other nodes (:class:`~omni_ray.grants.Peer`), as actor
arguments and calls (Ray carries them: never a command line nor an environment
variable). No node holds another's secret key: one node's keys cannot pose as another's
channels, nor as another node's gateway. Every channel a gateway binds is a CURVE server
with its node's server key; a gateway that sends over another node's channel is a CURVE
client with its own node's client pair and that node's server key. A ZAP handler in each gateway
(:class:`ZapHandler`) admits exactly the client public keys of the pipeline's nodes, and
names the peer's node in the User-Id of each message from it, so the receiver knows which
node sent a frame (and what it may send: see :meth:`omni_ray.frames.FrameGuard.screen`).
A peer without the keys, or with another pipeline's, never gets a message through; its
failed handshakes are counted (:class:`HandshakeWatch`, a monitor on each channel).

The channels enforce the ZAP domain (``ZMQ_ZAP_ENFORCE_DOMAIN``): should the ZAP handler
be gone, no handshake completes (libzmq would otherwise admit any client that knows the
server's public key); should it fail, each gateway thread also closes its channel.

What CURVE gives beyond that: every message is encrypted and authenticated with keys of its
connection alone (ephemeral, made at the handshake), so bytes captured on the wire cannot be
replayed over a new connection (its handshake fails); within a connection each message
carries a nonce that must grow, so a replayed or reordered message ends the connection.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("omni.ray.gateway")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
DOMAIN = b"omni-channel"
# without it libzmq admits any CURVE client that knows the server key while no ZAP handler
# answers (libzmq >= 4.3 has it)
ENFORCE_DOMAIN: int | None = getattr(zmq, "ZAP_ENFORCE_DOMAIN", None)
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def curve_available() -> bool:
    """Whether this libzmq was built with CURVE (libsodium)."""
    return bool(zmq.has("curve"))


@dataclass(frozen=True, repr=False)
class ChannelKeys:
    """One node's CURVE keys (z85): its server pair (its channels'), and its client pair
    (its gateway's, when it sends). ``repr`` shows the client public key only (the server
    public key lets a client attempt the handshake)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def new(cls) -> ChannelKeys:
        if not curve_available():
            raise RuntimeError(
                "this pyzmq's libzmq has no CURVE support (libsodium): cross-node channels "
                "cannot be authenticated"
            )
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def __repr__(self) -> str:
        return f"ChannelKeys(client={self.client_public!r})"

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CURVE server that asks the ZAP handler."""
        sock.curve_server = True
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.zap_domain = DOMAIN
        if ENFORCE_DOMAIN is not None:  # no ZAP handler (it failed): no handshake completes
            sock.setsockopt(ENFORCE_DOMAIN, 1)

    def client(self, sock: zmq.Socket, server_public: bytes) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the channels of the node
        whose server public key is ``server_public``, with this node's client pair."""
        sock.curve_serverkey = server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


class ZapHandler:
    """The ZAP handler of one zmq context: admits CURVE clients with a known node's client
    public key on :data:`DOMAIN`, with that node's id as the User-Id of their messages;
    refuses (and counts) the rest.

    Its thread never dies silently: should it fail, ``failed`` is set, ``on_failure(why)``
    is told and it is logged loudly (the channels enforce the domain, so no handshake
    completes without it; the gateway's threads close their channels too)."""

    def __init__(
        self,
        ctx: zmq.Context,
        peers: dict[str, bytes],
        on_failure: Callable[[str], None],
    ) -> None:
        """``peers``: node id -> that node's client public key (z85)."""
        self.lock = threading.Lock()
        self.allowed: dict[bytes, bytes] = {}  # client public key (raw) -> node id
        self.admit(peers)
        self.on_failure = on_failure
        self.denied = 0
        self.stop = False
        self.failed = False
        self.sock = ctx.socket(zmq.REP)
        self.sock.linger = 0
        self.sock.bind(ZAP_ENDPOINT)  # before any channel binds: none is asked without it
        self.thread = threading.Thread(target=self._run, name="gw-zap", daemon=True)
        self.thread.start()

    def admit(self, peers: dict[str, bytes]) -> None:
        """Admit these nodes' client public keys (z85) from now on."""
        with self.lock:
            for node, public in peers.items():
                self.allowed[z85.decode(public)] = node.encode()

    def admits(self, node: str) -> bool:
        """Whether ``node``'s key is admitted."""
        with self.lock:
            return node.encode() in self.allowed.values()

    def _run(self) -> None:
        try:
            while not self.stop:
                if self.sock.poll(100):
                    self.sock.send_multipart(self.answer(self.sock.recv_multipart()))
        except BaseException as e:
            if not self.stop:
                self.failed = True
                log.critical("the channels' ZAP handler failed; no peer is admitted", exc_info=True)
                self.on_failure(f"ZAP handler: {type(e).__name__}: {e}")
        finally:
            self.sock.close(linger=0)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (RFC 27)."""
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        if domain != DOMAIN:  # not a channel: the context's local (ipc) sockets
            return [version, request_id, b"200", b"OK", b"", b""]
        node = None
        if mechanism == b"CURVE" and len(credentials) == 1:
            with self.lock:
                node = self.allowed.get(credentials[0])
        if node is not None:
            return [version, request_id, b"200", b"OK", node, b""]
        self.denied += 1
        log.warning(
            "channel: refused a %s peer at %s (not a key of this pipeline's nodes)",
            mechanism.decode(errors="replace"),
            address.decode(errors="replace"),
        )
        return [version, request_id, b"400", b"not this pipeline's key", b"", b""]

    def close(self) -> None:
        self.stop = True
        self.thread.join(timeout=2)


class HandshakeWatch:
    """Counts the failed handshakes on one channel (its monitor socket): peers without the
    keys, with another pipeline's, replayed or garbled handshakes."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)

    def count(self) -> int:
        """Failed handshakes since the last call (the monitor's events, drained)."""
        n = 0
        while True:
            try:
                msg = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            if parse_monitor_message(msg)["event"] & HANDSHAKE_FAILED:
                n += 1

    def close(self) -> None:
        self.monitor.close(linger=0)
