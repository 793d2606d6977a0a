"""Hostile input for tests and ``omni bench attack``/``chaos``: files planted in
``/dev/shm`` under names a reader would accept, the segment references an attacker would
put in a message, a squatter who takes the next segment name, raw frames pushed into a
socket, a relay that records a TCP session (to replay it), frames spelled the long way."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

import msgspec
import zmq
from omni_core.dataplane import shm as shm_module
from omni_core.dataplane.shm import SHM_DIR

NOBODY = 65534  # another user's uid (only root can give a file to it)


class PlantedSegments:
    """Files planted in ``/dev/shm`` under names of ``prefix`` (an owner's,
    :func:`omni_core.dataplane.shm.owner_prefix`) and ``label``; :meth:`remove` deletes them."""

    def __init__(self, prefix: str, label: str) -> None:
        self.prefix, self.label = prefix, label
        self.paths: list[str] = []
        self.serial = 900

    def name(self) -> str:
        """A fresh name of the runtime's form (nothing planted under it)."""
        self.serial += 1
        return f"{self.prefix}{self.label}-{self.serial}-{os.urandom(8).hex()}"

    def _path(self, name: str) -> str:
        path = os.path.join(SHM_DIR, name)
        self.paths.append(path)
        return path

    def symlink(self, target: str = "/etc/passwd") -> str:
        name = self.name()
        os.symlink(target, self._path(name))
        return name

    def fifo(self) -> str:
        name = self.name()
        os.mkfifo(self._path(name), 0o600)
        return name

    def file(self, mode: int = 0o600, uid: int | None = None) -> str:
        name = self.name()
        path = self._path(name)
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        os.chmod(path, mode)
        if uid is not None:
            os.chown(path, uid, uid)
        return name

    def remove(self) -> None:
        for p in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def hostile_segment_names(planted: PlantedSegments) -> dict[str, str]:
    """Case -> a segment name a hostile message may carry, each one a reader must refuse:
    paths, names not of the runtime's form, a link, a FIFO, a file that is not private,
    a name with no file, and (as root) another user's file."""
    prefix, label = planted.prefix, planted.label
    cases = {
        "absolute": "/etc/passwd",
        "dotdot": "../../etc/passwd",
        "slash": f"{prefix}{label}/../../../etc/passwd-0-{'0' * 16}",
        "not_ours": "omni-config",
        "symlink": planted.symlink(),
        "fifo": planted.fifo(),
        "wrong_mode": planted.file(mode=0o644),
        "missing": planted.name(),
    }
    if os.geteuid() == 0:  # only root can make another user's file
        cases["other_user"] = planted.file(uid=NOBODY)
    return cases


@contextlib.contextmanager
def squatted_segment_names(label: str, times: int = 1) -> Iterator[list[str]]:
    """The next ``times`` segments made for worker ``label`` in this process find their
    name taken: a file (another user's, as root) appears under it just before. Yields the
    squatted paths; at the end they are removed and segment creation is as it was."""
    real = shm_module.create_locked
    paths: list[str] = []

    def create_locked(path: str, mode: int = 0o600) -> int | None:
        if f"-{label}-" in os.path.basename(path) and len(paths) < times:
            with open(path, "wb") as f:
                f.write(b"squatted")
            if os.geteuid() == 0:
                os.chown(path, NOBODY, NOBODY)
            paths.append(path)
        return real(path, mode)

    shm_module.create_locked = create_locked
    try:
        yield paths
    finally:
        shm_module.create_locked = real
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def push_frames(address: str, *frames: bytes) -> None:
    """Push raw ``frames`` into a worker's or the orchestrator's PULL socket, as any
    process of the pipeline's user could."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(address)
    for f in frames:
        sock.send(f)
    sock.close(linger=1000)


class Relay:
    """A TCP relay to ``target`` (``tcp://HOST:PORT``) that records what its one client
    sends (``sent``); ``upstream``: its connection to the target, once the client came."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.sent: list[bytes] = []
        self.upstream: socket.socket | None = None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._run, name="relay", daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed before a client came
            conn, _ = self.listener.accept()
            self.upstream = up = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(up, conn, None), daemon=True).start()
            self._pump(conn, up, self.sent)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, log: list[bytes] | None) -> None:
        with contextlib.suppress(OSError):  # either side closed: the relay ends
            while data := src.recv(65536):
                if log is not None:
                    log.append(data)
                dst.sendall(data)

    def close(self) -> None:
        for s in (self.listener, self.upstream):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()


def str8_frame(frame: bytes) -> bytes:
    """``frame`` (msgpack) with every string under 256 bytes spelled the long way (str8,
    ``\\xd9 len``) where msgpack would use the short one: it decodes to the same messages,
    but holds none of their tags' usual bytes (``\\xa3shm``, ``\\xa7release``)."""
    out = bytearray()
    _pack_long(msgspec.msgpack.decode(frame), out)
    return bytes(out)


def _pack_long(v: object, out: bytearray) -> None:
    if isinstance(v, str):
        raw = v.encode()
        if len(raw) < 256:
            out += b"\xd9" + bytes([len(raw)]) + raw
        else:
            out += msgspec.msgpack.encode(v)
    elif isinstance(v, list | tuple):
        if len(v) >= 1 << 16:
            raise ValueError(f"str8_frame: a list of {len(v)} items (at most 65535)")
        out += b"\xdc" + len(v).to_bytes(2, "big")
        for x in v:
            _pack_long(x, out)
    elif isinstance(v, dict):
        if len(v) >= 1 << 16:
            raise ValueError(f"str8_frame: a map of {len(v)} items (at most 65535)")
        out += b"\xde" + len(v).to_bytes(2, "big")
        for k, x in v.items():
            _pack_long(k, out)
            _pack_long(x, out)
    else:  # numbers, booleans, None, bytes: as msgpack spells them
        out += msgspec.msgpack.encode(v)
