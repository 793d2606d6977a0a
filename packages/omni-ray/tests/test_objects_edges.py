"""ray.objects at its edges, without a Ray cluster: a gateway's holdings (hold, lend,
release, a reader or a producer that goes), the releases a gateway takes out of a control
frame, the names of objects, and a producer's writer and a reader's resolver against
in-process gateways (Ray's calls answered by :class:`FakeRay`, on its own clock)."""

import logging

import numpy as np
import pytest
import ray
from omni_core.dataplane.serial import decode_control_frame, encode_frame
from omni_core.dataplane.shm import EXTERNAL_WRITERS, BadSegment, SegmentReader
from omni_core.events import Cancel, ReaderLost, Release
from omni_core.worker.host import CLIENT
from omni_ray import objects
from omni_ray.grants import CallerCheck, Grants
from omni_ray.objects import (
    HeldObjects,
    install_reader,
    install_writer,
    is_object,
    key_of,
    segment_name,
    take_releases,
    uninstall_reader,
)
from omni_ray.routes import DRIVER, gateway_name, inbox_of, reader_of
from omni_ray.testing import FakeRef

MIB4 = 4 << 20  # arrays from 4 MiB take the object store
PIPE = "p1"
HERE, NODE_B, NODE_C = "node-here", "node-b", "node-c"
GRANTS = Grants()
SECRET = GRANTS.grant(HERE).secret  # this node's: its workers' calls carry passes from it


def keys(refs):
    return [r.key if r is not None else None for r in refs]


def release_of(key: str, reader: str, pipeline: str = PIPE) -> Release:
    return Release(slots=[(0, 0)], segment=segment_name(pipeline, key), reader=reader)


# ------------------------------------------------------------------ names of objects
def test_an_objects_segment_name_gives_back_its_key_and_is_an_object():
    name = segment_name("pipe:with:colons", "0123abcd")
    assert name == "ray:pipe:with:colons:0123abcd"
    assert key_of(name) == "0123abcd" and is_object(name)
    assert key_of(segment_name(PIPE, "")) == ""  # the prefix a reader's resolver is at


@pytest.mark.parametrize("name", ["omni-1-x-a-0", "xray:p1:k1", "RAY:p1:k1", "", "ray"])
def test_names_that_are_not_objects(name):
    assert not is_object(name)


# ------------------------------------------------------------------ a gateway's holdings
def test_nothing_held_at_first():
    held = HeldObjects()
    assert len(held) == 0 and held.released == 0 and held.by_reader() == {}
    assert held.lend(["k1"], "b") == [None]
    held.release("b", ["k1"])  # a release of what was never held: nothing happens
    assert held.released == 0 and held.forget_reader("b") == 0 and held.forget_producer("a") == 0


def test_held_objects_are_counted_by_reader_one_held_for_two_counts_for_each():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1"), FakeRef("k2")])
    held.hold("c", [FakeRef("k1")])
    held.hold("b", [FakeRef("k1")])  # the same object for the same reader again: held once
    assert len(held) == 2 and held.by_reader() == {"b": 2, "c": 1}
    held.release("b", ["k1"])  # one release ends b's hold of it
    assert held.by_reader() == {"b": 1, "c": 1} and held.released == 1
    assert keys(held.lend(["k1"], "b")) == [None] and keys(held.lend(["k1"], "c")) == ["k1"]


def test_a_lend_answers_each_key_in_order_none_for_what_is_not_held_for_that_reader():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1"), FakeRef("k2")])
    held.hold("c", [FakeRef("k3")])
    got = held.lend(["nope", "k1", "k3", "k2"], "b")  # k3 is c's
    assert keys(got) == [None, "k1", None, "k2"]
    assert held.lend([], "b") == []
    assert len(held) == 3  # a lend keeps what it lends


def test_a_release_drops_the_object_with_its_last_reader_and_counts_each_release_once():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1"), FakeRef("k2")])
    held.hold("c", [FakeRef("k1")])
    held.release("b", ["unknown", "k1", "k2"])  # an unknown key first: the rest still go
    assert held.released == 2 and len(held) == 1 and held.by_reader() == {"c": 1}
    held.release("b", ["k1"])  # stale: b released it already
    held.release("d", ["k1"])  # never held for d
    assert held.released == 2 and keys(held.lend(["k1"], "c")) == ["k1"]
    held.release("c", ["k1"])
    assert held.released == 3 and len(held) == 0 and held.by_reader() == {}


def test_a_reader_that_dies_loses_its_holds_and_the_others_keep_theirs():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1"), FakeRef("k2")])
    held.hold("c", [FakeRef("k2"), FakeRef("k3")])
    assert held.forget_reader("b") == 2
    assert len(held) == 2 and held.by_reader() == {"c": 2}  # k1 went, k2 stays for c
    assert keys(held.lend(["k1", "k2"], "c")) == [None, "k2"]
    assert held.forget_reader("b") == 0  # nothing more
    assert held.released == 0  # a lost reader released nothing
    assert held.forget_reader("c") == 2 and len(held) == 0


def test_a_producer_that_restarts_takes_what_no_reader_was_lent_yet():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1"), FakeRef("k2")], producer="a")
    held.hold("c", [FakeRef("k3")], producer="other")
    held.hold("b", [FakeRef("k4")])  # put by a gateway: no producer of its own
    assert keys(held.lend(["k1"], "b")) == ["k1"]  # b maps k1: its release ends it now
    assert held.forget_producer("a") == 1  # k2 only
    assert held.by_reader() == {"b": 2, "c": 1}
    assert keys(held.lend(["k1", "k2", "k4"], "b")) == ["k1", None, "k4"]
    assert held.forget_producer("a") == 0 and held.forget_producer("") == 0
    assert held.forget_producer("other") == 1 and held.by_reader() == {"b": 2}


def test_an_object_lent_then_released_is_gone_for_its_producer_too():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1")], producer="a")
    held.lend(["k1"], "b")
    held.release("b", ["k1"])
    assert len(held) == 0 and held.forget_producer("a") == 0
    held.hold("b", [FakeRef("k1")], producer="a")  # held again (its producer's next life)
    assert held.forget_producer("a") == 1 and len(held) == 0


def test_a_release_that_comes_before_its_hold_makes_the_hold_take_nothing():
    """The producer gave up waiting and let go; the gateway ran the two calls in the
    other order (a threaded actor may)."""
    held = HeldObjects()
    a, b = FakeRef("a" * 32), FakeRef("b" * 32)
    held.release("r", [a.key])
    held.hold("r", [a, b], producer="p")
    assert keys(held.lend([a.key, b.key], "r")) == [None, b.key]
    assert held.released == 0 and len(held) == 1
    held.hold("r", [a])  # only once: a hold that comes again is taken
    assert len(held) == 2


def test_releases_before_their_holds_are_remembered_up_to_a_bound_oldest_forgotten_first():
    held = HeldObjects()
    refs = [FakeRef(f"{i:032x}") for i in range(HeldObjects.LET_GO_MAX + 1)]
    for r in refs:
        held.release("r", [r.key])
    held.hold("r", refs[:2])  # the first was forgotten: taken; the second is not
    assert keys(held.lend([refs[0].key, refs[1].key], "r")) == [refs[0].key, None]
    held.clear()
    held.hold("r", [refs[-1]])
    assert len(held) == 1  # clear() forgot the let-go too


def test_a_cleared_holding_holds_nothing():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1")], producer="a")
    held.clear()
    assert len(held) == 0 and held.by_reader() == {} and held.forget_producer("a") == 0


# ------------------------------------------------------------------ take_releases
def test_a_frame_of_object_releases_only_ends_here():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1"), FakeRef("k2")])
    frame = encode_frame([release_of("k1", "b"), release_of("k2", "b")])
    assert take_releases(frame, held) is None
    assert len(held) == 0 and held.released == 2


def test_the_object_releases_are_taken_out_wherever_they_are_and_the_rest_goes_on():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1"), FakeRef("k2")])
    slot = Release(slots=[(64, 3)], segment="omni-1-x-a-0", reader="b")
    cancel = Cancel(request_id="r1")
    frame = encode_frame([cancel, release_of("k1", "b"), slot, release_of("k2", "b")])
    assert decode_control_frame(take_releases(frame, held)) == [cancel, slot]
    assert len(held) == 0 and held.released == 2


def test_a_frame_with_nothing_to_take_goes_on_as_it_is():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1")])
    frame = encode_frame([Cancel(request_id="r1"), Release(slots=[], segment="omni-x", reader="b")])
    assert take_releases(frame, held) is frame
    empty = encode_frame([])
    assert take_releases(empty, held) is empty
    assert len(held) == 1 and held.released == 0


def test_a_release_of_an_object_not_held_here_is_still_taken_out():
    held = HeldObjects()
    frame = encode_frame([release_of("gone", "b"), Cancel(request_id="r1")])
    assert decode_control_frame(take_releases(frame, held)) == [Cancel(request_id="r1")]
    assert held.released == 0


def test_a_reader_lost_drops_its_objects_and_goes_on_to_the_producer():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1")])
    held.hold("c", [FakeRef("k2")])
    lost = ReaderLost(reader="b")
    frame = encode_frame([lost, release_of("k2", "c")])
    assert decode_control_frame(take_releases(frame, held)) == [lost]
    assert len(held) == 0 and held.released == 1  # the lost reader's hold is no release


def test_a_frame_that_does_not_decode_goes_on_untouched():
    held = HeldObjects()
    held.hold("b", [FakeRef("k1")])
    garbage = b"\xc1 not msgpack"
    assert take_releases(garbage, held) is garbage
    assert len(held) == 1


# ------------------------------------------------------------------ Ray, in process
class Died(ray.exceptions.RayError):
    """A Ray error (an actor or an owner that died), with the text given."""


class Call:
    """A remote call's answer, due at ``at`` on the fake clock (None: never)."""

    def __init__(self, value=None, error=None, at=0.0):
        self.value, self.error, self.at = value, error, at

    def done(self, now):
        return self.at is not None and self.at <= now


class Method:
    """A gateway's method: the pass each call carries is checked as the gateway would
    (from a node, ``local``: this node alone), then left out of ``calls``."""

    def __init__(self, fn, check, local=False):
        self.fn, self.check, self.local = fn, check, local
        self.calls = []

    def remote(self, who, *args):
        caller = self.check.caller(who)
        assert caller is not None and (not self.local or caller == self.check.node), who
        self.calls.append(args)
        return self.fn(*args)


class Gateway:
    """A node's gateway: holds what it is asked to for the reader of the endpoint, and
    answers after ``delay`` seconds (None: never), or with ``error``, or ``answer``."""

    def __init__(self, fake, node):
        self.fake, self.node = fake, node
        self.held = HeldObjects()
        self.answer, self.delay, self.error = True, 0.0, None
        self.then = None  # called with each hold
        nodes = (HERE, NODE_B, NODE_C)
        check = CallerCheck(GRANTS.grant(node), {n: GRANTS.peer(n, node) for n in nodes})
        self.hold = Method(self._hold, check)
        self.release = Method(lambda reader, keys: self.held.release(reader, keys), check)
        self.lend = Method(
            lambda keys, reader: Call(self.held.lend(keys, reader), at=fake.now), check, True
        )
        self.current_routes = Method(
            lambda: Call((dict(fake.routes), dict(fake.versions)), at=fake.now), check, True
        )

    def _hold(self, endpoint, refs, producer, life):
        if self.then is not None:
            self.then()
        at = None if self.delay is None else self.fake.now + self.delay
        if self.error is not None:
            return Call(error=self.error, at=at)
        if self.answer:
            self.held.hold(reader_of(endpoint), refs, producer)
        return Call(self.answer, at=at)


class FakeRay:
    """``ray.put``/``get``/``wait``/``get_actor`` in this process, on a clock that moves
    only while a wait waits; ``ray.get`` of an answer not yet due fails (it would block)."""

    def __init__(self):
        self.now = 0.0
        self.objects = {}
        self.gateways = {}
        self.routes = {}
        self.versions = {}
        self.timeouts = []  # each ray.get's
        self.waits = 0

    def monotonic(self):
        return self.now

    def gateway(self, node):
        gw = self.gateways[gateway_name(PIPE, node)] = Gateway(self, node)
        return gw

    def put(self, value):
        ref = FakeRef(f"{len(self.objects):032x}")
        self.objects[ref.key] = value
        return ref

    def get(self, what, timeout=None):
        self.timeouts.append(timeout)
        if isinstance(what, FakeRef):
            value = self.objects[what.key]
            if isinstance(value, Exception):
                raise value
            return value
        assert what.done(self.now), "ray.get would block"
        if what.error is not None:
            raise what.error
        return what.value

    def wait(self, calls, num_returns, timeout):
        self.waits += 1
        assert self.waits < 1000, "waits forever"
        if sum(c.done(self.now) for c in calls) < num_returns:
            due = [c.at for c in calls if c.at is not None and c.at > self.now]
            self.now = min([self.now + timeout, *due])
        ready = [c for c in calls if c.done(self.now)]
        return ready, [c for c in calls if not c.done(self.now)]

    def get_actor(self, name):
        if name not in self.gateways:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return self.gateways[name]


@pytest.fixture
def fake(monkeypatch):
    fake = FakeRay()
    for name in ("put", "get", "wait", "get_actor"):
        monkeypatch.setattr(ray, name, getattr(fake, name))
    monkeypatch.setattr(objects, "time", fake)
    return fake


def writer_on(fake, worker="up", version=1, **readers_at):
    """``worker``'s writer on this node, and every reader (name -> node) routed."""
    fake.routes = {worker: HERE, **readers_at}
    fake.versions = {worker: version, **dict.fromkeys(readers_at, 1)}
    return objects.ObjectWriter(PIPE, worker, HERE, fake.gateway(HERE), SECRET)


def array(nbytes=MIB4):
    return np.zeros(nbytes, np.uint8)


# ------------------------------------------------------------------ a producer's writer
def test_an_array_from_4_mib_for_a_reader_on_another_node_goes_through_the_object_store(fake):
    gw_b = fake.gateway(NODE_B)
    writer = writer_on(fake, b=NODE_B)
    flat = array()
    segment = writer.write(flat, {"b": 1})
    assert is_object(segment) and segment.startswith(segment_name(PIPE, ""))
    assert fake.objects[key_of(segment)] is flat and writer.puts == 1
    ((endpoint, refs, producer, life),) = gw_b.hold.calls
    assert (endpoint, keys(refs), producer, life) == (inbox_of("b"), [key_of(segment)], "up", 1)
    assert writer.write(array(MIB4 - 1), {"b": 1}) is None  # one byte less: a slot
    assert writer.puts == 1 and len(fake.objects) == 1


def test_an_array_for_readers_on_two_other_nodes_is_put_once_and_held_by_both(fake):
    gw_b, gw_c = fake.gateway(NODE_B), fake.gateway(NODE_C)
    writer = writer_on(fake, b=NODE_B, c=NODE_C)
    segment = writer.write(array(), {"b": 1, "c": 2})
    assert segment is not None and len(fake.objects) == 1 and writer.puts == 1
    assert gw_b.held.by_reader() == {"b": 1} and gw_c.held.by_reader() == {"c": 1}
    assert writer.write(array(), {"b": 1}) is not None
    assert writer.puts == 2 and len(gw_b.hold.calls) == 2 and len(gw_c.hold.calls) == 1


def test_the_callers_arrays_go_to_the_drivers_node(fake):
    gw_b = fake.gateway(NODE_B)
    writer = writer_on(fake, **{DRIVER: NODE_B})
    assert writer.write(array(), {CLIENT: 1}) is not None
    assert [c[0] for c in gw_b.hold.calls] == [inbox_of(CLIENT)]


@pytest.mark.parametrize(
    "readers",
    [
        {"b": 1, "near": 1},  # one reader on this node: it reads the slot
        {"b": 1, "nowhere": 1},  # one reader not placed
        {"b": 1, "stranger": 1},  # one reader the routes do not know
        {CLIENT: 1},  # the caller, with no driver's route
    ],
)
def test_an_array_with_a_reader_not_on_another_node_takes_a_slot(fake, readers):
    fake.gateway(NODE_B)
    writer = writer_on(fake, b=NODE_B, near=HERE, nowhere=None)
    assert writer.write(array(), readers) is None
    assert fake.objects == {} and writer.puts == 0


def test_a_reader_counted_zero_times_is_not_a_reader(fake):
    gw_b = fake.gateway(NODE_B)
    writer = writer_on(fake, b=NODE_B, near=HERE)
    assert writer.write(array(), {"near": 0, "b": 1}) is not None
    assert writer.write(array(), {"b": 1, "near": -1}) is not None
    assert len(gw_b.hold.calls) == 2
    assert writer.write(array(), {"b": 0}) is None  # no reader at all: a slot


def test_a_producer_not_routed_to_this_node_takes_slots(fake):
    fake.gateway(NODE_B)
    writer = writer_on(fake, b=NODE_B)
    fake.routes["up"] = NODE_B  # its route says another node (it moved, say)
    assert writer.write(array(), {"b": 1}) is None
    fake.routes["up"] = HERE
    fake.now += 1.5  # the routes are asked again
    assert writer.write(array(), {"b": 1}) is not None


def test_a_producers_first_life_may_be_version_0(fake):
    gw_b = fake.gateway(NODE_B)
    writer = writer_on(fake, version=0, b=NODE_B)
    assert writer.write(array(), {"b": 1}) is not None
    assert gw_b.hold.calls[0][3] == 0


def test_the_routes_are_trusted_for_exactly_one_second(fake):
    fake.gateway(NODE_B)
    writer = writer_on(fake, b=NODE_B)
    asked = writer.gateway.current_routes.calls
    writer.write(array(), {"b": 1})
    assert len(asked) == 1 and fake.timeouts[0] == 60.0  # its gateway gets a minute
    fake.now = 1.0  # exactly one second after: still trusted
    writer.write(array(), {"b": 1})
    assert len(asked) == 1
    fake.now = 1.25
    writer.write(array(), {"b": 1})
    assert len(asked) == 2
    fake.now = 2.25  # exactly one second after
    writer.write(array(), {"b": 1})
    assert len(asked) == 2


def test_a_gateway_that_refuses_the_hold_sends_the_array_to_a_slot_and_routes_are_asked_again(
    fake,
):
    gw_b, gw_c = fake.gateway(NODE_B), fake.gateway(NODE_C)
    gw_c.answer = False  # c left node_c meanwhile
    writer = writer_on(fake, b=NODE_B, c=NODE_C)
    asked = writer.gateway.current_routes.calls
    assert writer.write(array(), {"b": 1, "c": 1}) is None
    assert writer.puts == 0
    # b's gateway held it: it is told to let go; c's did not, and is told nothing
    assert gw_b.release.calls == [("b", ["0" * 32])] and len(gw_b.held) == 0
    assert gw_c.release.calls == []
    gw_c.answer = True
    assert writer.write(array(), {"b": 1, "c": 1}) is not None  # (no time went by)
    assert len(asked) == 2


def test_a_gateway_that_died_sends_the_array_to_a_slot(fake, caplog):
    gw_b, gw_c = fake.gateway(NODE_B), fake.gateway(NODE_C)
    gw_b.error = Died("node_b's gateway died")
    writer = writer_on(fake, b=NODE_B, c=NODE_C)
    with caplog.at_level(logging.WARNING, logger="omni.ray.objects"):
        assert writer.write(array(), {"b": 1, "c": 1}) is None
    assert "Died" in caplog.text and writer.puts == 0
    assert [r for r, _ in gw_c.release.calls] == ["c"] and gw_b.release.calls == []


def test_a_hold_answered_within_the_minute_is_waited_for(fake):
    gw_b = fake.gateway(NODE_B)
    gw_b.delay = 60.5  # just before the first check past the minute
    writer = writer_on(fake, b=NODE_B)
    assert writer.write(array(), {"b": 1}) is not None
    assert fake.now == 60.5 and writer.puts == 1


def test_a_gateway_that_never_answers_is_given_up_after_a_minute(fake, caplog):
    gw_b = fake.gateway(NODE_B)
    gw_b.delay = None
    writer = writer_on(fake, b=NODE_B)
    with caplog.at_level(logging.WARNING, logger="omni.ray.objects"):
        assert writer.write(array(), {"b": 1}) is None
    assert fake.now == 61.0 and writer.puts == 0
    assert "no answer from the gateways" in caplog.text
    # it may hold it yet (here it does, without answering): it is told to let go
    assert gw_b.release.calls == [("b", ["0" * 32])] and len(gw_b.held) == 0


def test_when_one_gateway_never_answers_the_one_that_held_lets_go_too(fake):
    gw_b, gw_c = fake.gateway(NODE_B), fake.gateway(NODE_C)
    gw_c.delay = None
    writer = writer_on(fake, b=NODE_B, c=NODE_C)
    assert writer.write(array(), {"b": 1, "c": 1}) is None
    assert gw_b.release.calls == [("b", ["0" * 32])] and len(gw_b.held) == 0
    assert gw_c.release.calls == [("c", ["0" * 32])] and len(gw_c.held) == 0


def test_a_reader_that_moves_while_its_gateway_does_not_answer_gets_a_slot_at_once(fake):
    gw_b = fake.gateway(NODE_B)
    gw_b.delay = None
    fake.gateway(NODE_C)
    writer = writer_on(fake, b=NODE_B)
    gw_b.then = lambda: fake.routes.update(b=NODE_C)  # b moves once the hold is sent
    assert writer.write(array(), {"b": 1}) is None
    assert fake.now == 1.0
    # the let-go goes where the hold went, not where b is now
    assert gw_b.release.calls == [("b", ["0" * 32])] and len(gw_b.held) == 0
    assert fake.gateways[gateway_name(PIPE, NODE_C)].release.calls == []


def test_each_nodes_gateway_is_looked_up_once(fake, monkeypatch):
    fake.gateway(NODE_B)
    looked = []
    monkeypatch.setattr(ray, "get_actor", lambda name: looked.append(name) or fake.gateways[name])
    writer = writer_on(fake, b=NODE_B)
    writer.write(array(), {"b": 1})
    writer.write(array(), {"b": 1})
    assert looked == [gateway_name(PIPE, NODE_B)]


# ------------------------------------------------------------------ cancel
def test_a_cancelled_array_is_let_go_by_each_readers_gateway(fake):
    gw_b, gw_c = fake.gateway(NODE_B), fake.gateway(NODE_C)
    writer = writer_on(fake, b=NODE_B, c=NODE_C, **{DRIVER: NODE_C})
    writer.write(array(), {"b": 1})  # the routes are known now
    writer.cancel(segment_name(PIPE, "k1"), {"b": 1, "nowhere": 1, CLIENT: 1, "c": 2})
    assert gw_b.release.calls == [("b", ["k1"])]
    assert gw_c.release.calls == [(CLIENT, ["k1"]), ("c", ["k1"])]


@pytest.mark.parametrize("segment", ["omni-1-x-up-0", segment_name("p2", "k1"), "ray:p1x:k1"])
def test_a_cancel_of_what_is_not_this_pipelines_object_does_nothing(fake, segment):
    gw_b = fake.gateway(NODE_B)
    writer = writer_on(fake, b=NODE_B)
    writer.write(array(), {"b": 1})
    writer.cancel(segment, {"b": 1})
    assert gw_b.release.calls == []


def test_a_cancel_toward_a_gateway_that_is_gone_is_dropped(fake):
    gw_b = fake.gateway(NODE_B)
    writer = writer_on(fake, b=NODE_B, c=NODE_C)  # node_c has no gateway (any more)
    writer.write(array(), {"b": 1})
    writer.cancel(segment_name(PIPE, "k1"), {"c": 1, "b": 1})
    assert gw_b.release.calls == [("b", ["k1"])]


def test_install_writer_makes_it_the_workers_external_writer(fake):
    gw = fake.gateway(HERE)
    try:
        writer = install_writer(PIPE, "up#1", HERE, gw, SECRET)
        assert EXTERNAL_WRITERS["up#1"] is writer and writer.worker == "up#1"
    finally:
        EXTERNAL_WRITERS.pop("up#1", None)


# ------------------------------------------------------------------ a reader's resolver
@pytest.fixture
def reading(fake):
    """The reader ``b``'s gateway (on this node) and b's segment reader."""
    gw = fake.gateway(HERE)
    install_reader(PIPE, gw, GRANTS.node_pass(HERE, HERE), "b")
    yield gw, SegmentReader(scope="omni-1-")
    uninstall_reader(PIPE)


def test_a_reader_maps_an_object_held_for_it(fake, reading):
    gw, reader = reading
    ref = fake.put(np.arange(8, dtype=np.uint8))
    gw.held.hold("b", [ref])
    got = reader.buffer(segment_name(PIPE, ref.key))
    assert got.tolist() == list(range(8))
    assert gw.lend.calls == [([ref.key], "b")]
    assert fake.timeouts == [60.0, 600.0]  # a minute for its gateway, ten for the array
    assert len(gw.held) == 1  # held until b releases it


def test_a_reader_asking_for_an_object_not_held_for_it_is_told_so(fake, reading):
    gw, reader = reading
    gw.held.hold("c", [fake.put(np.zeros(4, np.uint8))])  # c's
    with pytest.raises(LookupError, match=r"is not held for 'b' on this node"):
        reader.buffer(segment_name(PIPE, "0" * 32))


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("  owner died\nits address: 10.0.0.1\n", "owner died"),  # the first line only
        ("", ""),
    ],
)
def test_an_object_whose_owner_died_cannot_be_read_and_says_why(fake, reading, text, why):
    gw, reader = reading
    ref = fake.put(Died(text))
    gw.held.hold("b", [ref])
    name = segment_name(PIPE, ref.key)
    with pytest.raises(LookupError) as e:
        reader.buffer(name)
    assert str(e.value) == f"array {name} cannot be read: Died: {why}"


def test_an_uninstalled_reader_resolves_no_object(fake):
    install_reader(PIPE, fake.gateway(HERE), GRANTS.node_pass(HERE, HERE), "b")
    uninstall_reader(PIPE)
    uninstall_reader(PIPE)  # twice: nothing to do
    with pytest.raises(BadSegment):
        SegmentReader(scope="omni-1-").buffer(segment_name(PIPE, "k1"))
