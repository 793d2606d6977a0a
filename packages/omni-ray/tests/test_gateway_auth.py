"""The gateways' cross-node channels admit only the pipeline's keys (ZMQ CURVE), and what
an admitted peer sends may touch only what is its own.

The first tests drive a :class:`NodeGateway` in this process (its channels are real CURVE
servers; its calls to other nodes' gateways replaced by a queue); the last one a real
pipeline on the simulated cluster."""

from __future__ import annotations

import queue
import socket
import threading
import time
import uuid

import pytest
import zmq
from omni_core.events import Cancel, Error, Release, Segment, ShmHandle
from omni_core.serial import decode_control_frame, decode_data_frame, encode_frame
from omni_core.transport import RESULTS, push_socket
from omni_ray.channel_auth import ChannelKeys
from omni_ray.gateway import GATEWAY_ERROR, NodeGateway
from omni_ray.objects import HeldObjects, segment_name
from omni_testing.faults import wait_for

HERE, THERE, HEAD = "node-here", "node-there", "node-head"


class Gateway:
    """A gateway on node HERE with worker ``b`` on it (the test binds b's sockets, as b's
    worker would) and ``a`` elsewhere; what it sends to other nodes lands in ``remote``."""

    def __init__(self) -> None:
        self.pipeline = f"t{uuid.uuid4().hex[:8]}"
        self.gw = NodeGateway(self.pipeline, HERE, HEAD, ["a", "b"], channel_ip="127.0.0.1")
        self.remote: queue.Queue = queue.Queue()
        self.gw._deliver_remote = self._record
        self.gw.set_routes({"a": (THERE, 1), "b": (HERE, 1)})
        self.ctx = zmq.Context()
        self.inbox = {}
        for ep in ("b.data", "b.ctl"):  # what reaches worker b
            sock = self.ctx.socket(zmq.PULL)
            sock.bind(self.gw.inner.endpoint(ep))
            self.inbox[ep] = sock
        self.channels = self.gw.channel_addresses()

    def _record(self, node, endpoint, frames, refs=None) -> bool:
        self.remote.put((endpoint, [bytes(f) for f in frames]))
        return True

    def received(self, endpoint: str, wait_s: float = 0.5) -> list[bytes]:
        """What reached worker b's ``endpoint`` within ``wait_s``."""
        sock, out = self.inbox[endpoint], []
        end = time.monotonic() + wait_s
        while (left := end - time.monotonic()) > 0:
            if sock.poll(int(left * 1000) + 1):
                out.append(sock.recv())
        return out

    def errors(self, timeout: float = 5.0) -> list[Error]:
        endpoint, frames = self.remote.get(timeout=timeout)
        assert endpoint == RESULTS
        return [m for f in frames for m in decode_data_frame(f)]

    def sender(self, endpoint: str, keys: ChannelKeys | None, which: str = "pipeline"):
        """A PUSH socket to ``endpoint``'s channel: without keys, with the pipeline's, or
        with another pipeline's (``keys`` given)."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.linger = 0
        if keys is not None:
            keys.client(sock)
        sock.connect(self.channels[endpoint])
        return sock

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.gw.close()


@pytest.fixture
def gw():
    g = Gateway()
    yield g
    g.close()


def segment(rid: str, handles=None) -> Segment:
    return Segment(request_id=rid, sequence=0, stage="a", tokens=[7], device_handles=handles or {})


def test_a_peer_without_the_pipelines_keys_gets_nothing_through(gw):
    frame = encode_frame([segment("r1")])
    theirs = ChannelKeys.new()  # another pipeline's
    wrong_client = ChannelKeys(
        gw.gw.keys.server_public,
        gw.gw.keys.server_secret,
        theirs.client_public,
        theirs.client_secret,
    )
    socks = [gw.sender("b.data", k) for k in (None, theirs, wrong_client)]
    for s in socks:
        s.send(frame)
    assert gw.received("b.data", 1.0) == []  # nothing delivered
    wait_for(lambda: gw.gw.info()["auth_failures"] >= 3, 5, "three failed handshakes")
    # the pipeline's keys: the same frame goes through (the check above can fail)
    good = gw.sender("b.data", gw.gw.keys)
    good.send(frame)
    assert gw.received("b.data", 2.0) == [frame]
    assert gw.gw.failure() is None


def test_a_forged_release_over_a_channel_is_refused_and_the_rest_goes_on(gw):
    """Another node never holds a slot here: a Release arriving over a channel is forged,
    whoever it names; it never reaches the producer (so it frees nothing)."""
    seg = gw.gw.create_segment("b", 1 << 16)
    forged = Release(slots=[(0, 1)], segment=seg, reader="a")
    cancel = Cancel(request_id="r1")
    s = gw.sender("b.ctl", gw.gw.keys)  # an admitted peer: a gateway of this pipeline
    s.send(encode_frame([forged, cancel]))
    s.send(encode_frame([forged]))
    got = [m for f in gw.received("b.ctl", 1.0) for m in decode_control_frame(f)]
    assert got == [cancel]
    assert gw.gw.info()["refused"] == 2
    # from a process on this node (ipc) a release goes to the producer as before
    local = push_socket(gw.ctx, gw.gw.addr.control("b"))
    local.send(encode_frame([forged]))
    assert [m for f in gw.received("b.ctl", 2.0) for m in decode_control_frame(f)] == [forged]
    local.close(linger=0)


def test_a_handle_to_a_segment_here_over_a_channel_fails_its_request(gw):
    seg = gw.gw.create_segment("a", 1 << 16)
    slot = ShmHandle(seg, 0, 16, "|u1", (16,), "a", 1)
    other = ShmHandle(segment_name("another", "ab" * 8), 0, 16, "|u1", (16,), "a", 0)
    mine = ShmHandle(segment_name(gw.pipeline, "cd" * 8), 0, 16, "|u1", (16,), "a", 0)
    path = ShmHandle("/etc/passwd", 0, 16, "|u1", (16,), "a", 1)
    s = gw.sender("b.data", gw.gw.keys)
    msgs = [
        segment("slot", {"x": slot}),
        segment("other", {"x": other}),
        segment("path", {"x": path}),
        segment("ok", {"x": mine}),
    ]
    s.send(encode_frame(msgs))
    passed = [m for f in gw.received("b.data", 1.0) for m in decode_data_frame(f)]
    assert [m.request_id for m in passed] == ["ok"]
    errors = gw.errors()
    assert sorted(e.request_id for e in errors) == ["other", "path", "slot"]
    assert all(e.code == GATEWAY_ERROR and "refused" in e.message for e in errors)
    assert gw.gw.info()["refused"] == 3
    assert gw.remote.empty()  # no release went to a producer on their behalf


class Relay:
    """A TCP relay to a channel that records what the client sends."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.sent: list[bytes] = []
        self.upstream: socket.socket | None = None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        self.upstream = up = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(up, conn, None), daemon=True).start()
        self._pump(conn, up, self.sent)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, log: list[bytes] | None) -> None:
        try:
            while data := src.recv(65536):
                if log is not None:
                    log.append(data)
                dst.sendall(data)
        except OSError:
            pass


def test_a_replayed_frame_is_refused_in_its_session_and_on_a_new_connection(gw):
    relay = Relay(gw.channels["b.data"])
    client = gw.ctx.socket(zmq.PUSH)
    client.linger = 0
    gw.gw.keys.client(client)
    client.connect(relay.address)
    frame = encode_frame([segment("r1")])
    client.send(frame)
    assert gw.received("b.data", 2.0) == [frame]
    # within the session: the last message's bytes again (its nonce is not new)
    relay.upstream.sendall(relay.sent[-1])
    assert gw.received("b.data", 1.0) == []
    # on a fresh connection: the whole captured session (the handshake cannot be replayed)
    before = gw.gw.info()["auth_failures"]
    with socket.create_connection(relay.target) as raw:
        raw.sendall(b"".join(relay.sent))
        assert gw.received("b.data", 1.0) == []
    wait_for(lambda: gw.gw.info()["auth_failures"] > before, 5, "the replay to be refused")
    client.close(linger=0)


def test_keys_never_show_their_secrets_in_repr():
    keys = ChannelKeys.new()
    assert keys.server_secret.decode() not in repr(keys)
    assert keys.client_secret.decode() not in repr(keys)


class FakeRef:
    def __init__(self, key: str) -> None:
        self.key = key

    def hex(self) -> str:
        return self.key


def test_a_reader_is_lent_only_the_objects_held_for_it():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1")])
    assert held.lend(["k1"], "c") == [None]  # another reader's object: not lent
    assert [r.key for r in held.lend(["k1"], "b")] == ["k1"]


# ---------------------------------------------------------------------- a live pipeline
def up_tokens(events) -> list[int]:
    return [t for e in events if isinstance(e, Segment) and e.stage == "up" for t in e.tokens or []]


def test_forged_frames_on_a_live_pipelines_channel_are_not_accepted(cluster):
    """``src`` (node_a) holds each request a while; a frame posing as its first event is
    sent over ``up``'s channel on node_b while it waits. From a peer without the keys, or
    with another pipeline's, it never arrives: the request's output is src's alone. With
    the pipeline's keys (the control) it does arrive and spoils that request. A Release
    over the head's channel, even with the keys, is refused."""
    import ray
    from omni_core import Pipeline
    from omni_ray.testing import on
    from omni_testing.configs import chain

    cfg = chain(
        ("src", "synthetic.sleep", {"hold_s": 1.0}, on("node_a")),
        ("up", "synthetic.map", {"scale": 2}, on("node_b")),
        heartbeat_interval_s=0.1,
    )
    with Pipeline(cfg, backend="ray") as pipe:
        launcher = pipe.backend.launcher
        keys = launcher.channel_keys
        head = launcher.gateways[launcher.head_node]
        (far,) = [gw for n, gw in launcher.gateways.items() if n != launcher.head_node]
        far_channels = ray.get(far.channel_addresses.remote(), timeout=30)
        head_channels = ray.get(head.channel_addresses.remote(), timeout=30)
        ctx = zmq.Context()
        socks = []  # kept open: a socket closed at once drops what it has not sent

        def forge(rid: str, k: ChannelKeys | None) -> None:
            sock = ctx.socket(zmq.PUSH)
            socks.append(sock)
            sock.linger = 0
            if k is not None:
                k.client(sock)
            sock.connect(far_channels["up.data"])
            forged = Segment(request_id=rid, sequence=0, stage="src", tokens=[999])
            sock.send(encode_frame([forged]))

        try:
            cases = {"none": None, "theirs": ChannelKeys.new(), "control": keys}
            handles = {c: pipe.submit({}, request_id=f"forged-{c}", timeout_s=60) for c in cases}
            for c, k in cases.items():
                forge(f"forged-{c}", k)
            outs = {c: list(h) for c, h in handles.items()}
            for c in ("none", "theirs"):
                last = outs[c][-1]
                assert last.event_type == "completed", (c, last)
                assert up_tokens(outs[c]) == [0]
            spoiled = outs["control"]
            assert spoiled[-1].event_type == "error" or 1998 in up_tokens(spoiled), spoiled
            info = ray.get(far.info.remote(), timeout=30)
            assert info["auth_failures"] >= 2 and info["failures"] == {}
            # a Release over a channel, with the keys: refused, the producer never sees it
            rel = ctx.socket(zmq.PUSH)
            rel.linger = 0
            keys.client(rel)
            rel.connect(head_channels["src.ctl"])
            rel.send(encode_frame([Release(slots=[(0, 1)], segment="x", reader="up")]))
            wait_for(lambda: ray.get(head.info.remote(), timeout=30)["refused"] == 1, 10, "refusal")
        finally:
            ctx.destroy(linger=0)
        outs = pipe.generate([{}, {}], timeout_s=60)
        assert all(o.ok for o in outs), [o.error for o in outs]
