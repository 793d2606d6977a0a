"""Who calls a gateway: capabilities handed out at launch, checked on every call.

Ray names no caller: an actor method learns nothing of who called it
(``ray.get_runtime_context()`` describes the callee), and any process of the cluster may
look a named actor up and call it. So each call that changes something, or hands out
what is not the caller's, carries a *pass*: ``(caller, token)``, the token an HMAC-SHA256
the called gateway checks with :func:`hmac.compare_digest` (:class:`CallerCheck`).

* The launcher (the control plane, on the head) holds the pipeline's master secret alone
  (:class:`Grants`); from it come every token. Its own calls (``set_routes``, ``admit``,
  ``unlink_segment``, ``close``) carry ``(CONTROL, control_N)``, a token of node ``N``'s
  gateway alone: no other node learns it.
* Each node ``N`` gets its own secret ``secret_N`` (its gateway's constructor argument).
  A call from node ``N`` to node ``M``'s gateway carries ``(N, HMAC(secret_N, M))``; the
  launcher gives ``M`` that token for each node (:class:`Peer`), so ``M`` can check calls
  from ``N`` but never make one as ``N`` to a third node. ``N``'s workers (stage actors on
  its node) read ``secret_N`` from a file in the gateway's private socket directory
  (:data:`SECRET_FILE`, 0600 in a 0700 directory): being able to read it is being on the
  node as the pipeline's user, the trust a worker's ipc sockets already rest on.

What a refused call gets is a :class:`PermissionError` (counted in the gateway's
``info()["calls_refused"]``, logged).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from typing import Any

CONTROL = "@control"  # the caller name of the launcher's calls
SECRET_FILE = ".node-secret"  # in the gateway's socket directory: its node's secret
Pass = tuple[str, str]  # (the calling node, or CONTROL; its token for the called gateway)


def token(secret: str, *parts: str) -> str:
    """HMAC-SHA256 of ``parts`` under ``secret`` (hex), as hex."""
    msg = "\0".join(parts).encode()
    return hmac.new(bytes.fromhex(secret), msg, hashlib.sha256).hexdigest()


def node_pass(node: str, secret: str, target: str) -> Pass:
    """What node ``node`` (holding ``secret``) shows ``target``'s gateway."""
    return node, token(secret, "call", target)


@dataclass(frozen=True, repr=False)
class NodeGrant:
    """What one node's gateway is given at launch: its node's secret, and the token the
    launcher's calls to it carry. ``repr`` shows neither."""

    node: str
    secret: str
    control: str

    def __repr__(self) -> str:
        return f"NodeGrant(node={self.node!r})"


@dataclass(frozen=True, repr=False)
class Peer:
    """What a gateway knows of another node: the token that node's calls here carry, and
    the public halves of its channel keys (None without channels)."""

    token: str
    client_public: bytes | None = None
    server_public: bytes | None = None

    def __repr__(self) -> str:
        return f"Peer(client={self.client_public!r})"


class Grants:
    """The launcher's: the pipeline's master secret, and every grant and pass from it."""

    def __init__(self) -> None:
        self._master = secrets.token_hex(32)

    def __repr__(self) -> str:
        return "Grants(...)"

    def grant(self, node: str) -> NodeGrant:
        """Node ``node``'s gateway's grant."""
        return NodeGrant(node, self._secret(node), token(self._master, "control", node))

    def control(self, node: str) -> Pass:
        """The launcher's pass for node ``node``'s gateway."""
        return CONTROL, token(self._master, "control", node)

    def peer(self, caller: str, target: str, keys: Any = None) -> Peer:
        """What ``target``'s gateway is told of node ``caller`` (``keys``: its
        :class:`~omni_ray.channel_auth.ChannelKeys`, if it has channels)."""
        tok = node_pass(caller, self._secret(caller), target)[1]
        if keys is None:
            return Peer(tok)
        return Peer(tok, keys.client_public, keys.server_public)

    def node_pass(self, caller: str, target: str) -> Pass:
        """The pass of a process on node ``caller`` for ``target``'s gateway."""
        return node_pass(caller, self._secret(caller), target)

    def _secret(self, node: str) -> str:
        return token(self._master, "node", node)


class CallerCheck:
    """One gateway's check of its callers' passes (see the module)."""

    def __init__(self, grant: NodeGrant, peers: dict[str, Peer] | None = None) -> None:
        self.node = grant.node
        self._control = grant.control
        self._local = node_pass(grant.node, grant.secret, grant.node)[1]
        self._tokens: dict[str, str] = {}  # node -> the token of its calls here
        self.admit(peers or {})

    def admit(self, peers: dict[str, Peer]) -> None:
        for node, peer in peers.items():
            if node != self.node:  # this node's own calls: from its secret, never replaced
                self._tokens[node] = peer.token

    def caller(self, who: Any) -> str | None:
        """The caller ``who`` proves to be (a node id, or :data:`CONTROL`); None: a pass
        that is not one (malformed, unknown, or a wrong token)."""
        if not (isinstance(who, tuple | list) and len(who) == 2):
            return None
        name, tok = who
        if not isinstance(name, str) or not isinstance(tok, str):
            return None
        if name == CONTROL:
            expected: str | None = self._control
        elif name == self.node:
            expected = self._local
        else:
            expected = self._tokens.get(name)
        if expected is None or not hmac.compare_digest(tok.encode(), expected.encode()):
            return None
        return name


def write_secret(directory: str, secret: str) -> str:
    """Write ``secret`` to :data:`SECRET_FILE` in ``directory`` (0600, never over an
    existing file); its path."""
    path = os.path.join(directory, SECRET_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return path


def read_secret(directory: str) -> str:
    """The node's secret its gateway wrote in ``directory`` (its socket directory)."""
    fd = os.open(os.path.join(directory, SECRET_FILE), os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        return f.read().strip()
