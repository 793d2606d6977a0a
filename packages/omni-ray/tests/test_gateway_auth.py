"""The gateways' cross-node channels admit only the pipeline's keys (ZMQ CURVE), and what
an admitted peer sends may touch only what is its own.

The first tests drive a :class:`NodeGateway` in this process (its channels are real CURVE
servers; its calls to other nodes' gateways replaced by a queue); the last one a real
pipeline on the simulated cluster."""

from __future__ import annotations

import queue
import socket
import time
import uuid

import pytest
import zmq
from omni_core.dataplane.serial import decode_control_frame, decode_data_frame, encode_frame
from omni_core.dataplane.transport import RESULTS, push_socket
from omni_core.events import (
    Cancel,
    Error,
    ReaderLost,
    Release,
    Segment,
    SegmentGone,
    ShmHandle,
    Shutdown,
    Submit,
)
from omni_ray.channel_auth import ChannelKeys
from omni_ray.gateway import GATEWAY_ERROR, NodeGateway
from omni_ray.grants import Grants
from omni_ray.objects import HeldObjects, segment_name
from omni_ray.testing import FakeRef
from omni_testing.faults import wait_for
from omni_testing.hostile import Relay, str8_frame

HERE, THERE, HEAD = "node-here", "node-there", "node-head"


class Gateway:
    """A gateway on node HERE with worker ``b`` on it (the test binds b's sockets, as b's
    worker would) and ``a`` elsewhere; what it sends to other nodes lands in ``remote``.
    ``there`` and ``head``: the keys of the gateways of nodes THERE and HEAD (the
    orchestrator's), both admitted."""

    def __init__(self) -> None:
        self.pipeline = f"t{uuid.uuid4().hex[:8]}"
        grants = Grants()
        self.control, self.local = grants.control(HERE), grants.node_pass(HERE, HERE)
        self.gw = NodeGateway(
            self.pipeline,
            HERE,
            HEAD,
            ["a", "b"],
            channel_ip="127.0.0.1",
            keys=ChannelKeys.new(),
            grant=grants.grant(HERE),
        )
        assert self.gw.keys is not None
        self.there, self.head = ChannelKeys.new(), ChannelKeys.new()
        peers = {n: grants.peer(n, HERE, k) for n, k in ((THERE, self.there), (HEAD, self.head))}
        self.gw.admit(self.control, peers)
        self.remote: queue.Queue = queue.Queue()
        self.gw._deliver_remote = self._record
        self.gw.set_routes(self.control, {"a": (THERE, 1), "b": (HERE, 1)})
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        self.inbox = {}
        for ep in ("b.data", "b.ctl"):  # what reaches worker b
            sock = self.ctx.socket(zmq.PULL)
            sock.bind(self.gw.inner.endpoint(ep))
            self.inbox[ep] = sock
        self.channels = self.gw.channel_addresses(self.control)

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

    def sender(self, endpoint: str, keys: ChannelKeys | None) -> zmq.Socket:
        """A PUSH socket to ``endpoint``'s channel, with ``keys`` (None: without keys); kept
        open until the end (one closed at once drops what it has not sent)."""
        sock = self.ctx.socket(zmq.PUSH)
        self.socks.append(sock)
        sock.linger = 0
        if keys is not None:
            keys.client(sock, self.gw.keys.server_public)
        sock.connect(self.channels[endpoint])
        return sock

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.gw.close(self.control)


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
    # a node's keys: the same frame goes through (the check above can fail)
    good = gw.sender("b.data", gw.there)
    good.send(frame)
    assert gw.received("b.data", 2.0) == [frame]
    assert gw.gw.failure() is None


def test_a_forged_release_over_a_channel_is_refused_and_the_rest_goes_on(gw):
    """Another node never holds a slot here: a Release arriving over a channel is forged,
    whoever it names; it never reaches the producer (so it frees nothing)."""
    seg = gw.gw.create_segment(gw.local, "b", 1 << 16)
    forged = Release(slots=[(0, 1)], segment=seg, reader="a")
    cancel = Cancel(request_id="r1")
    s = gw.sender("b.ctl", gw.head)  # the head node's gateway: it may send the cancel
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
    seg = gw.gw.create_segment(gw.local, "a", 1 << 16)
    slot = ShmHandle(seg, 0, 16, "|u1", (16,), "a", 1)
    other = ShmHandle(segment_name("another", "ab" * 8), 0, 16, "|u1", (16,), "a", 0)
    mine = ShmHandle(segment_name(gw.pipeline, "cd" * 8), 0, 16, "|u1", (16,), "a", 0)
    path = ShmHandle("/etc/passwd", 0, 16, "|u1", (16,), "a", 1)
    s = gw.sender("b.data", gw.there)
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


def test_frames_spelling_their_tags_the_long_way_are_screened_all_the_same(gw):
    """msgpack may spell "shm" and "release" as str8 (``\\xd9\\x03shm``); the receiver
    decodes them alike, so the screen must too: a slot handle and a Release spelled so
    are refused as the short spellings are."""
    seg = gw.gw.create_segment(gw.local, "a", 1 << 16)
    slot = ShmHandle(seg, 0, 16, "|u1", (16,), "a", 1)
    data = str8_frame(encode_frame([segment("slot", {"x": slot}), segment("ok")]))
    assert b"\xa3shm" not in data and b"\xd9\x03shm" in data
    gw.sender("b.data", gw.there).send(data)
    passed = [m for f in gw.received("b.data", 1.0) for m in decode_data_frame(f)]
    assert [m.request_id for m in passed] == ["ok"]
    assert [e.request_id for e in gw.errors()] == ["slot"]
    seg = gw.gw.create_segment(gw.local, "b", 1 << 16)
    forged = Release(slots=[(0, 1)], segment=seg, reader="a")
    ctl = str8_frame(encode_frame([forged]))
    assert b"\xa7release" not in ctl
    for keys in (gw.there, gw.head):  # from no node
        gw.sender("b.ctl", keys).send(ctl)
    assert gw.received("b.ctl", 1.0) == []
    assert gw.gw.info()["refused"] == 3


ORCHESTRATORS = [
    Cancel(request_id="r1"),
    ReaderLost(reader="a"),
    SegmentGone(segment="omni-x"),
    Shutdown(drain=False),
]


@pytest.mark.parametrize("spell", [lambda f: f, str8_frame], ids=["short", "str8"])
def test_the_orchestrators_messages_are_taken_from_the_head_node_alone(gw, spell):
    """A ReaderLost frees every slot its reader holds: from any node but the head (where
    the orchestrator is) it, and every other message of the orchestrator's, is refused."""
    gw.sender("b.ctl", gw.there).send(spell(encode_frame(ORCHESTRATORS)))
    gw.sender("b.data", gw.there).send(spell(encode_frame([Submit(request_id="s1", request={})])))
    assert gw.received("b.ctl", 1.0) == [] and gw.received("b.data", 0.1) == []
    assert [e.request_id for e in gw.errors()] == ["s1"]
    assert gw.gw.info()["refused"] == len(ORCHESTRATORS) + 1
    # the same from the head node's gateway: they arrive (the checks above can fail)
    gw.sender("b.ctl", gw.head).send(spell(encode_frame(ORCHESTRATORS)))
    gw.sender("b.data", gw.head).send(encode_frame([Submit(request_id="s2", request={})]))
    got = [m for f in gw.received("b.ctl", 1.0) for m in decode_control_frame(f)]
    assert got == ORCHESTRATORS
    assert [m.request_id for m in decode_data_frame(gw.received("b.data", 1.0)[0])] == ["s2"]
    assert gw.gw.info()["refused"] == len(ORCHESTRATORS) + 1


def test_an_undecodable_control_message_over_a_channel_is_logged_and_counted(gw, caplog):
    bad = b"\x92" + encode_frame([Cancel(request_id="r1")])[1:] + b"\x81\xaaevent_type\xa3bad"
    gw.sender("b.ctl", gw.head).send(bad)
    got = [m for f in gw.received("b.ctl", 1.0) for m in decode_control_frame(f)]
    assert got == [Cancel(request_id="r1")]  # the rest goes on
    assert gw.gw.info()["dropped"] == 1
    assert "undecodable control message" in caplog.text


def test_channels_admit_nobody_once_the_zap_handler_fails(gw):
    """Without its ZAP handler libzmq would admit any client knowing the server key: the
    channels enforce the domain and are closed, and the gateway reports the failure."""
    zap = gw.gw.zap

    def broken(request):
        raise RuntimeError("boom")

    zap.answer = broken
    gw.sender("b.data", gw.there).send(encode_frame([segment("r1")]))  # the failing ask
    wait_for(lambda: gw.gw.failure() is not None, 5, "the failure to be reported")
    assert "channel authentication" in gw.gw.failure()["part"]
    gw.sender("b.data", gw.there).send(encode_frame([segment("r2")]))
    assert gw.received("b.data", 1.5) == []


def test_a_replayed_frame_is_refused_in_its_session_and_on_a_new_connection(gw):
    relay = Relay(gw.channels["b.data"])
    client = gw.ctx.socket(zmq.PUSH)
    client.linger = 0
    gw.there.client(client, gw.gw.keys.server_public)
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


def test_keys_never_show_their_secrets_nor_the_server_key_in_repr():
    keys = ChannelKeys.new()
    for secret in (keys.server_secret, keys.client_secret, keys.server_public):
        assert secret.decode() not in repr(keys)


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
    a node's keys (the control) it does arrive and spoils that request. A Release and
    a ReaderLost over the head's channel, with node_b's keys, are refused."""
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
        head = launcher.gateways[launcher.head_node]
        ((far_node, far),) = [
            (n, g) for n, g in launcher.gateways.items() if n != launcher.head_node
        ]
        keys = launcher.node_keys[launcher.head_node]
        far_server = launcher.node_keys[far_node].server_public
        head_server = keys.server_public
        control = launcher.grants.control
        far_channels = ray.get(far.channel_addresses.remote(control(far_node)), timeout=30)
        head_channels = ray.get(
            head.channel_addresses.remote(control(launcher.head_node)), timeout=30
        )
        ctx = zmq.Context()
        socks = []  # kept open: a socket closed at once drops what it has not sent

        def forge(rid: str, k: ChannelKeys | None) -> None:
            sock = ctx.socket(zmq.PUSH)
            socks.append(sock)
            sock.linger = 0
            if k is not None:
                k.client(sock, far_server)
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
            # a Release and a ReaderLost over a channel, from node_b (not the orchestrator's
            # node): refused, the producer never sees them
            rel = ctx.socket(zmq.PUSH)
            rel.linger = 0
            launcher.node_keys[far_node].client(rel, head_server)
            rel.connect(head_channels["src.ctl"])
            rel.send(encode_frame([Release(slots=[(0, 1)], segment="x", reader="up")]))
            rel.send(str8_frame(encode_frame([ReaderLost(reader="up")])))
            wait_for(lambda: ray.get(head.info.remote(), timeout=30)["refused"] == 2, 10, "refusal")
        finally:
            ctx.destroy(linger=0)
        outs = pipe.generate([{}, {}], timeout_s=60)
        assert all(o.ok for o in outs), [o.error for o in outs]
