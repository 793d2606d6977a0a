"""Who may speak on a gateway's cross-node channels: ZMQ CURVE with per-pipeline keys.

The control plane (:class:`~omni_ray.launcher.RayLauncher`) makes one :class:`ChannelKeys`
per pipeline and hands it to each node's gateway as an actor constructor argument (Ray
carries it: never a command line nor an environment variable). Every channel a gateway
binds is a CURVE server with the pipeline's server key; a gateway that sends over another
node's channel is a CURVE client with the pipeline's client key pair. A ZAP handler in each
gateway (:class:`ZapHandler`) admits exactly the pipeline's client public key: a peer
without the keys, or with another pipeline's, never gets a message through; its failed
handshake is counted (:class:`HandshakeWatch`, a monitor on each channel).

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
USER_ID = b"omni-gateway"  # the User-Id of a message from an admitted peer
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
    """One pipeline's CURVE keys (z85): the channels' server pair, the gateways' client
    pair. ``repr`` shows the public keys only."""

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
        return f"ChannelKeys(server={self.server_public!r}, client={self.client_public!r})"

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CURVE server that asks the ZAP handler."""
        sock.curve_server = True
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.zap_domain = DOMAIN

    def client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the pipeline's channels."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


class ZapHandler:
    """The ZAP handler of one zmq context: admits CURVE clients with the pipeline's client
    public key on :data:`DOMAIN`, refuses (and counts) the rest.

    Its thread never dies silently: should it fail, ``on_failure(why)`` is told (no handshake
    completes without it, so the channels stop taking frames) and it is logged loudly."""

    def __init__(
        self, ctx: zmq.Context, keys: ChannelKeys, on_failure: Callable[[str], None]
    ) -> None:
        self.allowed = z85.decode(keys.client_public)
        self.on_failure = on_failure
        self.denied = 0
        self.stop = False
        self.sock = ctx.socket(zmq.REP)
        self.sock.linger = 0
        self.sock.bind(ZAP_ENDPOINT)  # before any channel binds: none is asked without it
        self.thread = threading.Thread(target=self._run, name="gw-zap", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop:
                if self.sock.poll(100):
                    self.sock.send_multipart(self.answer(self.sock.recv_multipart()))
        except BaseException as e:
            if not self.stop:
                log.critical("the channels' ZAP handler failed; no peer is admitted", exc_info=True)
                self.on_failure(f"ZAP handler: {type(e).__name__}: {e}")
        finally:
            self.sock.close(linger=0)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (RFC 27)."""
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        if domain != DOMAIN:  # not a channel: the context's local (ipc) sockets
            return [version, request_id, b"200", b"OK", b"", b""]
        ok = mechanism == b"CURVE" and len(credentials) == 1 and credentials[0] == self.allowed
        if ok:
            return [version, request_id, b"200", b"OK", USER_ID, b""]
        self.denied += 1
        log.warning(
            "channel: refused a %s peer at %s (not this pipeline's key)",
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
