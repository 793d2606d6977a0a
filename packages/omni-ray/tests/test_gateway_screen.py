"""Every gateway method a Ray caller can reach checks who calls it (the pass it carries,
:mod:`omni_ray.grants`) and what it carries, with the channels off (no CURVE): each forged
call is refused and counted, the legitimate one goes through.

The first tests drive :class:`NodeGateway` objects in this process (no channels; their
calls to other gateways replaced); the last one forges every call from a Ray task on the
other node of a simulated cluster against a live pipeline's head gateway."""

from __future__ import annotations

import os
import stat
import uuid

import pytest
import zmq
from omni_core.dataplane.serial import (
    decode_control_frame,
    decode_data_frame,
    decode_status_frame,
    encode_frame,
)
from omni_core.dataplane.shm import Arena, SegmentOwner
from omni_core.dataplane.transport import RESULTS, STATUS
from omni_core.events import (
    Cancel,
    Heartbeat,
    LoadFailed,
    ReaderLost,
    Ready,
    Release,
    Segment,
    ShmHandle,
    Shutdown,
    StageStats,
    Submit,
)
from omni_core.worker.host import CLIENT
from omni_ray.gateway import NodeGateway
from omni_ray.grants import CONTROL, SECRET_FILE, Grants, Peer, node_pass, read_secret
from omni_ray.testing import FakeRef

HERE, THERE, OTHER, HEAD = "node-here", "node-there", "node-other", "node-head"


class Node:
    """A gateway on node ``node`` without channels, ``a`` on THERE, ``b`` on ``node``; the
    sockets the orchestrator (head) or worker b would bind are bound by the test."""

    def __init__(self, node: str = HERE) -> None:
        self.grants = Grants()
        self.node = node
        self.control, self.local = self.grants.control(node), self.grants.node_pass(node, node)
        peers = {n: self.grants.peer(n, node) for n in (THERE, OTHER, HEAD, HERE) if n != node}
        self.gw = NodeGateway(
            f"t{uuid.uuid4().hex[:8]}",
            node,
            HEAD,
            ["a", "b"],
            channel_ip=None,
            peers=peers,
            grant=self.grants.grant(node),
        )
        self.gw._deliver_remote = lambda *a, **k: True  # nothing leaves this node
        self.gw.set_routes(self.control, {"a": (THERE, 1), "b": (node, 1)})
        self.ctx = zmq.Context()
        self.inbox: dict[str, zmq.Socket] = {}
        bound = {STATUS: self.gw.addr, RESULTS: self.gw.addr} if node == HEAD else {}
        for ep in ("b.data", "b.ctl", *bound):
            sock = self.ctx.socket(zmq.PULL)
            sock.bind(bound.get(ep, self.gw.inner).endpoint(ep))
            self.inbox[ep] = sock

    def of(self, caller: str) -> tuple[str, str]:
        """Node ``caller``'s real pass for this gateway."""
        return self.grants.node_pass(caller, self.node)

    def received(self, endpoint: str, wait_ms: int = 300) -> list[bytes]:
        sock, out = self.inbox[endpoint], []
        while sock.poll(wait_ms):
            out.append(sock.recv())
            wait_ms = 50
        return out

    def refused(self) -> tuple[int, int]:
        """(calls refused, messages refused) so far."""
        info = self.gw.info()
        return info["calls_refused"], info["refused"]

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.gw.close(self.control)


@pytest.fixture
def here():
    n = Node(HERE)
    yield n
    n.close()


@pytest.fixture
def head():
    n = Node(HEAD)
    yield n
    n.close()


def forged_passes(n: Node) -> dict[str, object]:
    """Passes that are not the launcher's for ``n``'s gateway."""
    other = Grants()  # another pipeline's launcher
    return {
        "none": None,
        "not a pair": ("x",),
        "not strings": (CONTROL, 7),
        "guessed control": (CONTROL, "0" * 64),
        "another pipeline's control": other.control(n.node),
        "another gateway's control": n.grants.control(THERE),
        "a node's": n.of(THERE),
        "this node's own": n.local,
    }


def refuses(call, *args) -> bool:
    """Whether ``call(*args)`` is refused (:class:`PermissionError`)."""
    try:
        call(*args)
    except PermissionError:
        return True
    return False


# ------------------------------------------------------------------ the launcher's calls
def test_control_calls_take_the_launchers_pass_for_this_gateway_alone(here):
    """set_routes, admit, unlink_segment and close: every forged pass is refused and
    counted, and changes nothing; the launcher's pass works (the check can fail)."""
    seg = here.gw.create_segment(here.local, "b", 1 << 16)
    reroute = {"b": (THERE, 99)}
    intruder = {"intruder": Peer(token="1" * 64)}
    forged = forged_passes(here)
    calls = {
        "set_routes": lambda who: here.gw.set_routes(who, reroute),
        "admit": lambda who: here.gw.admit(who, intruder),
        "unlink_segment": lambda who: here.gw.unlink_segment(who, seg),
        "close": lambda who: here.gw.close(who),
    }
    refused = [refuses(call, who) for call in calls.values() for who in forged.values()]
    assert all(refused) and len(refused) == len(calls) * len(forged) == 32
    assert here.refused() == (32, 0)
    assert here.gw.current_routes(here.local)[0]["b"] == HERE  # not rerouted
    assert here.gw.callers.caller(("intruder", "1" * 64)) is None  # not admitted
    assert os.path.exists(f"/dev/shm/{seg}") and not here.gw.stop  # not unlinked, not closed
    # the launcher's
    here.gw.set_routes(here.control, reroute)
    assert here.gw.current_routes(here.local)[0]["b"] == THERE
    here.gw.admit(here.control, intruder)
    assert here.gw.callers.caller(("intruder", "1" * 64)) == "intruder"
    here.gw.unlink_segment(here.control, seg)
    assert not os.path.exists(f"/dev/shm/{seg}")
    assert here.refused() == (32, 0)


def test_this_nodes_calls_take_its_own_pass(here):
    """lend, create_segment, current_routes: for this node's processes alone (a node's
    pass is for calls across nodes; its pass for its own gateway is not this one's)."""
    here.gw.held.hold("b", [FakeRef("k1")])
    other_node = here.grants.node_pass(THERE, THERE)
    for who in (here.of(THERE), other_node, here.control, (HERE, "0" * 64), None):
        assert refuses(lambda w=who: here.gw.lend(w, ["k1"], "b"))
        assert refuses(lambda w=who: here.gw.create_segment(w, "b", 1 << 16))
        assert refuses(lambda w=who: here.gw.current_routes(w))
    assert here.refused() == (15, 0)
    # what it carries: a reader that does not live here, a worker it does not have
    assert refuses(lambda: here.gw.lend(here.local, ["k1"], "a"))  # a lives on THERE
    assert refuses(lambda: here.gw.lend(here.local, ["k1"], CLIENT))  # not the head
    assert refuses(lambda: here.gw.create_segment(here.local, "zz", 1 << 16))
    assert refuses(lambda: here.gw.create_segment(here.local, "@driver", 1 << 16))
    assert refuses(lambda: here.gw.create_segment(here.local, "b", -1))
    assert here.refused() == (20, 0)
    assert [r.key for r in here.gw.lend(here.local, ["k1"], "b")] == ["k1"]
    assert here.gw.create_segment(here.local, "b", 1 << 16).startswith("omni-")
    assert here.gw.current_routes(here.local)[0]["b"] == HERE


def test_the_node_secret_is_in_the_private_socket_directory_and_passes_are_per_target(here):
    path = os.path.join(here.gw.socket_dir, SECRET_FILE)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(here.gw.socket_dir).st_mode) == 0o700
    secret = read_secret(here.gw.socket_dir)
    assert node_pass(HERE, secret, HERE) == here.local  # what its workers show
    # a pass is good at the gateway it is for: THERE's pass for OTHER is not one here
    assert here.gw.callers.caller(here.grants.node_pass(THERE, OTHER)) is None
    assert here.gw.callers.caller(here.of(THERE)) == THERE
    for shown in (repr(here.grants), repr(here.grants.grant(HERE)), repr(here.of(THERE)[0])):
        assert secret not in shown and here.control[1] not in shown


# ------------------------------------------------------------------ deliveries
def test_a_delivery_is_screened_as_a_channel_frame_from_the_node_its_pass_proves(here):
    """With the channels off every frame between nodes is a deliver call: from THERE (a
    valid pass) the orchestrator's messages and a Release guessing rental ids are
    refused; the same from the head arrive; a data frame from THERE arrives."""
    seg = here.gw.create_segment(here.local, "b", 1 << 16)
    guesses = [(0, r) for r in range(1, 257)]
    forged_ctl = [
        Cancel(request_id="r1"),
        Shutdown(drain=False),
        ReaderLost(reader="a"),
        Release(slots=guesses, segment=seg, reader="a"),
    ]
    for m in forged_ctl:
        assert here.gw.deliver(here.of(THERE), "b.ctl", [encode_frame([m])])
    submit = encode_frame([Submit(request_id="s1", request={})])
    assert here.gw.deliver(here.of(THERE), "b.data", [submit])
    assert here.received("b.ctl") == [] and here.received("b.data") == []
    assert here.refused() == (0, len(forged_ctl) + 1)
    # no pass, a guessed one, or posing as the head: the call itself is refused
    for who in (None, (HEAD, "0" * 64), here.control):
        assert refuses(lambda w=who: here.gw.deliver(w, "b.ctl", [encode_frame(forged_ctl)]))
    for no_such in ("zz.data", "@driver.data", "b.status", "b", 7):
        assert refuses(here.gw.deliver, here.of(THERE), no_such, [submit])
    assert here.refused() == (8, len(forged_ctl) + 1)
    # the legitimate ones
    from_head = [Cancel(request_id="r1"), Shutdown(drain=False)]
    assert here.gw.deliver(here.of(HEAD), "b.ctl", [encode_frame(from_head)])
    got = [m for f in here.received("b.ctl") for m in decode_control_frame(f)]
    assert got == from_head
    data = encode_frame([Segment(request_id="r2", sequence=0, stage="a", tokens=[1])])
    assert here.gw.deliver(here.of(THERE), "b.data", [data])
    assert [m.request_id for f in here.received("b.data") for m in decode_data_frame(f)] == ["r2"]
    assert here.refused() == (8, len(forged_ctl) + 1)


def test_the_heads_status_and_results_endpoints_are_screened(head):
    """Frames to the orchestrator's endpoints always come by deliver calls: a status
    message about a worker another node runs, a Submit or a slot handle in results, are
    refused; a worker's own status and its results arrive."""
    seg = SegmentOwner(token="x").create("b", 1 << 16)
    stats = StageStats()
    about_b = [  # b runs on the head: THERE may not speak of it
        Ready(stage="b", pid=1, load_s=0.0),
        LoadFailed(stage="b", pid=1, message="forged"),
        Heartbeat(stage="b", pid=1, ts=0.0, stats=stats),
    ]
    for m in about_b:
        assert head.gw.deliver(head.of(THERE), STATUS, [encode_frame([m])])
    slot = ShmHandle(seg, 0, 16, "|u1", (16,), "b", 1)
    bad_results = [
        Submit(request_id="s1", request={}),
        Segment(request_id="r1", sequence=0, stage="a", device_handles={"x": slot}),
    ]
    for m in bad_results:
        assert head.gw.deliver(head.of(THERE), RESULTS, [encode_frame([m])])
    assert head.received(STATUS) == []
    errors = [m for f in head.received(RESULTS) for m in decode_data_frame(f)]
    assert sorted(e.request_id for e in errors) == ["r1", "s1"]  # their requests fail
    assert all(e.event_type == "error" and "refused" in e.message for e in errors)
    assert head.refused() == (0, len(about_b) + len(bad_results))
    # a's own status (it runs on THERE), one not placed yet, and a result: they arrive
    own = Ready(stage="a", pid=2, load_s=0.1)
    head.gw.set_routes(head.control, {"b": (None, 2)})  # b restarting: its Ready may come
    early = Ready(stage="b", pid=3, load_s=0.1)
    head.gw.deliver(head.of(THERE), STATUS, [encode_frame([own, early])])
    assert [m for f in head.received(STATUS) for m in decode_status_frame(f)] == [own, early]
    result = encode_frame([Segment(request_id="r2", sequence=0, stage="a", tokens=[5])])
    assert head.gw.deliver(head.of(THERE), RESULTS, [result])
    assert head.received(RESULTS) == [result]
    assert head.refused() == (0, len(about_b) + len(bad_results))


# ------------------------------------------------------------------ holds and releases
def test_a_node_releases_only_what_it_held(here):
    """Objects THERE holds here for b: OTHER (a valid pass of its own) can neither
    release them nor hold them anew; a hold on an endpoint with no reader, and one by
    a pass that is not a node's, are refused; THERE's release lets go."""
    assert here.gw.hold(here.of(THERE), "b.data", [FakeRef("k1"), FakeRef("k2")])
    for call in (
        lambda: here.gw.release(here.of(OTHER), "b", ["k1", "k2"]),
        lambda: here.gw.hold(here.of(OTHER), "b.data", [FakeRef("k1")]),
        lambda: here.gw.hold(here.of(THERE), "b.ctl", [FakeRef("k3")]),
        lambda: here.gw.hold(here.control, "b.data", [FakeRef("k3")]),
        lambda: here.gw.release((THERE, "0" * 64), "b", ["k1"]),
    ):
        assert refuses(call)
    assert here.refused() == (5, 0)
    assert here.gw.held.by_reader() == {"b": 2}
    # an early release from OTHER does not make THERE's later hold take nothing
    here.gw.release(here.of(OTHER), "b", ["k4"])
    assert here.gw.hold(here.of(THERE), "b.data", [FakeRef("k4")])
    assert here.gw.held.by_reader() == {"b": 3}
    here.gw.release(here.of(THERE), "b", ["k1", "k2", "k4"])
    assert here.gw.held.by_reader() == {} and here.gw.held.released == 3
    assert here.refused() == (5, 0)


def test_rental_ids_are_not_a_counter(tmp_path):
    """A Release must name a slot's rental: a forger counting from 1 frees nothing."""
    owner = SegmentOwner(token="r", directory=str(tmp_path))
    arena = Arena(owner.create("p", 1 << 16), directory=str(tmp_path))
    rentals = [arena.rent(64, {"r": 1})[1] for _ in range(64)]
    assert len(set(rentals)) == 64 and sorted(rentals) != list(range(1, 65))
    assert sum(rentals[i + 1] - rentals[i] == 1 for i in range(63)) < 2
    offsets = sorted({off for off in range(0, 64 * 64, 64)})
    arena.release([(off, r) for off in offsets for r in range(1, 1025)], "r")
    assert arena.slots_in_use == 64
    arena.release([(0, rentals[0])], "r")  # the rental's owner: freed
    assert arena.slots_in_use == 63
    owner.unlink_all()


# ------------------------------------------------------------------ a live pipeline
def test_forged_calls_from_another_node_are_refused_on_a_live_pipeline(cluster, monkeypatch):
    """Channels off: a Ray task on node_b, holding node_b's secret (what a compromised
    node holds), makes every forged call against the head's gateway while requests
    run: none is accepted, the legitimate calls go through, the pipeline serves on."""
    import ray
    from omni_core import Pipeline
    from omni_ray.forged_calls import forge_from
    from omni_ray.testing import on
    from omni_testing.configs import chain

    monkeypatch.setenv("OMNI_RAY_CHANNELS", "0")
    cfg = chain(
        ("src", "synthetic.sleep", {"hold_s": 0.5}, on("node_a")),
        ("up", "synthetic.map", {"scale": 2}, on("node_b")),
        heartbeat_interval_s=0.1,
    )
    with Pipeline(cfg, backend="ray") as pipe:
        launcher = pipe.backend.launcher
        assert launcher.channel_ip is None
        head = launcher.gateways[launcher.head_node]
        (far_node,) = [n for n in launcher.gateways if n != launcher.head_node]
        segment = launcher.workers["src"].segment
        during = [pipe.submit({}, request_id=f"during-{i}", timeout_s=60) for i in range(2)]
        res = forge_from(far_node, launcher.pipeline_id, launcher.head_node, "src", segment)
        assert res["accepted"] == [] and res["refused"] == res["sent"] == 24, res
        assert res["legit_ok"], res
        info = ray.get(head.info.remote(), timeout=30)
        assert info["calls_refused"] == 15 and info["refused"] == 9, info
        here = launcher.grants.node_pass(launcher.head_node, launcher.head_node)
        routes, _ = ray.get(head.current_routes.remote(here), timeout=30)
        assert routes["src"] == launcher.head_node and routes["up"] == far_node
        assert os.path.exists(f"/dev/shm/{segment}")
        for h in during:
            assert list(h)[-1].event_type == "completed"
        outs = pipe.generate([{}, {}], timeout_s=60)
        assert all(o.ok for o in outs), [o.error for o in outs]


# ------------------------------------------------------------------ the Ray Client's actor
def test_the_control_actor_takes_its_creators_token_on_every_call():
    """The Ray Client's ControlActor (on the head, by a name any process may look up):
    each call without its creator's token is refused before it touches the pipeline."""
    from omni_ray.control_actor import ControlActor

    actor = ControlActor.__new__(ControlActor)  # its checks alone: no pipeline behind it
    actor._token, actor.refused = "t" * 64, 0
    calls = [
        (actor.start, ()),
        (actor.submit, ({}, "r1", None)),
        (actor.cancel, ("r1",)),
        (actor.poll, (0.0,)),
        (actor.health, ()),
        (actor.metrics, ()),
        (actor.close, (False, 1.0)),
    ]
    for method, args in calls:
        for token in (None, "", "t" * 63, "u" * 64, 7):
            assert refuses(method, token, *args), (method.__name__, token)
    assert actor.refused == len(calls) * 5
    with pytest.raises(AttributeError):  # the token: past the check (no pipeline here)
        actor.cancel("t" * 64, "r1")
