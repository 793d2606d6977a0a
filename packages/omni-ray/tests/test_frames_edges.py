"""FrameGuard at its edges, without a Ray cluster: real frames (omni_core's encoding),
real shared-memory segments (a SegmentOwner and its Arenas in a temporary directory), a
real zmq context whose sockets to the producers and the client are bound here; only
``ray.put`` is replaced (by a recorder) where an array goes to the object store.

What a caller sees: the frame that goes on (its arrays copied in, or put into the object
store from the threshold up), the releases that reach the producers, the errors
(``gateway_error``) that end the requests of what was dropped, the counters, the logs."""

from __future__ import annotations

import logging

import msgspec
import pytest
import ray
import zmq
from omni_core.dataplane.serial import decode_control_frame, decode_data_frame, encode_frame
from omni_core.dataplane.shm import Arena, SegmentOwner, SegmentReader
from omni_core.dataplane.transport import RESULTS, Addresses
from omni_core.events import (
    Cancel,
    Error,
    InlineArray,
    ReaderLost,
    Release,
    Segment,
    ShmHandle,
    Shutdown,
    Submit,
)
from omni_ray.frames import GATEWAY_ERROR, FrameGuard
from omni_ray.objects import segment_name
from omni_ray.testing import FakeRef
from omni_testing.hostile import str8_frame

NODE = "0123456789abcdefghij"  # longer than every cut of it in a log or a message
HEAD = "head-node-0123456789"
THERE = "there-node-0123456789"
PIPE = "tpipe"
GARBAGE = b"garbage with \xa3shm in it"
DEEP = b"\x91" * 100_000 + b"\xc0"  # nested too deep for any decoder: RecursionError
END = b"--end of what was sent--"
LONG = "omni-" + "x" * 75 + "0123456789"  # 90 characters: its first 80 are all x's after omni-


class Store:
    """Stands in for ``ray.put``: what was put, and the reference it gave back."""

    def __init__(self) -> None:
        self.put: list[bytes] = []

    def __call__(self, value):
        assert value.dtype == "uint8"
        self.put.append(bytes(value))
        return FakeRef(f"key{len(self.put)}")


class Rig:
    """A FrameGuard on node NODE (head HEAD) of pipeline PIPE; producers ``a`` and ``c``
    and the client bound here, so what it sends them can be read back."""

    def __init__(self, root, threshold: int | None = None, forget: bool = True) -> None:
        (root / "shm").mkdir(parents=True)
        (root / "s").mkdir()
        self.shm = str(root / "shm")
        self.owner = SegmentOwner(self.shm)
        self.arenas: dict[str, Arena] = {}
        self.ctx = zmq.Context()
        self.addr = Addresses(str(root / "s"))
        self.forgotten: list[tuple[str, list[str]]] = []
        self.guard = FrameGuard(
            NODE,
            self.addr,
            self.ctx,
            SegmentReader(self.shm),
            PIPE,
            threshold,
            self._forget if forget else None,
            HEAD,
        )
        self.outs: dict[str, zmq.Socket] = {}
        self.inbox: dict[str, zmq.Socket] = {}
        for ep in ("a.ctl", "c.ctl", RESULTS):
            sock = self.ctx.socket(zmq.PULL)
            sock.rcvtimeo = 10_000
            sock.bind(self.addr.endpoint(ep))
            self.inbox[ep] = sock

    def _forget(self, endpoint: str, keys: list[str]) -> None:
        self.forgotten.append((endpoint, keys))

    def arena(self, producer: str, size: int = 1 << 16) -> Arena:
        if producer not in self.arenas:
            self.arenas[producer] = Arena(self.owner.create(producer, size), self.shm)
        return self.arenas[producer]

    def slot(self, payload: bytes, producer: str = "a") -> ShmHandle:
        """An array of ``payload`` in a slot of ``producer``'s, read by ``b``."""
        arena = self.arena(producer)
        off, rental = arena.rent(len(payload), {"b": 1})
        arena.buf[off : off + len(payload)] = payload
        return ShmHandle(arena.name, off, len(payload), "|u1", (len(payload),), producer, rental)

    def sent(self, endpoint: str) -> list[bytes]:
        """Every frame the guard sent to ``endpoint`` so far (none: it never opened a
        socket to it)."""
        sock = self.outs.get(endpoint)
        if sock is None:
            return []
        sock.send(END)  # after all it sent, on the same socket
        frames = []
        while (f := self.inbox[endpoint].recv()) != END:
            frames.append(f)
        return frames

    def errors(self) -> list[Error]:
        return [m for f in self.sent(RESULTS) for m in decode_data_frame(f)]

    def failed(self) -> list[tuple[str, str, str, str]]:
        return [(e.request_id, e.stage, e.message, e.code) for e in self.errors()]

    def releases(self, producer: str = "a") -> list[Release]:
        return [m for f in self.sent(f"{producer}.ctl") for m in decode_control_frame(f)]

    def close(self) -> None:
        for a in self.arenas.values():
            a.close()
        self.owner.unlink_all()
        self.ctx.destroy(linger=0)


@pytest.fixture
def make(tmp_path):
    rigs: list[Rig] = []

    def make(threshold: int | None = None, forget: bool = True) -> Rig:
        rig = Rig(tmp_path / str(len(rigs)), threshold, forget)
        rigs.append(rig)
        return rig

    yield make
    for r in rigs:
        r.close()


@pytest.fixture
def store(monkeypatch):
    s = Store()
    monkeypatch.setattr(ray, "put", s)
    return s


def segment(rid: str, handles=None, seq: int = 0, stage: str = "a") -> Segment:
    return Segment(
        request_id=rid, sequence=seq, stage=stage, tokens=[seq], device_handles=handles or {}
    )


def obj(key: str, pipeline: str = PIPE) -> ShmHandle:
    """A handle of an object its producer put into the store."""
    return ShmHandle(segment_name(pipeline, key), 0, 16, "|u1", (16,), "a", 0)


def lost(rid: str, stage: str, endpoint: str, why: str) -> tuple[str, str, str, str]:
    """The error (request, stage, message, code) a request ends with when the guard gave
    up on a message of it."""
    return (
        rid,
        stage,
        f"gateway on node {NODE[:12]}: a message of stage {stage!r} to {endpoint} was lost: {why}",
        GATEWAY_ERROR,
    )


def logged(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


def gone(rig: Rig) -> str:
    """A segment of ``a``'s, named as the runtime names them, that is not there."""
    return f"{rig.owner.prefix}a-99-{'0' * 16}"


# ------------------------------------------------------------ arrays bound off-node
def test_an_array_of_exactly_the_threshold_goes_to_the_store_one_byte_less_rides_inline(
    make, store
):
    rig = make(threshold=256)
    rig.slot(b"\0" * 64)  # the arrays below lie past the segment's start
    big, small = rig.slot(bytes(range(256))), rig.slot(b"\x07" * 255)
    frame = encode_frame([segment("r1", {"big": big, "small": small})])
    out, refs = rig.guard.inline_all("b.data", [frame], rig.outs)
    (msg,) = decode_data_frame(out[0])
    assert msg.device_handles == {
        "big": ShmHandle(segment_name(PIPE, "key1"), 0, 256, "|u1", (256,), "a", 0),
        "small": InlineArray(b"\x07" * 255, "|u1", (255,)),
    }
    assert store.put == [bytes(range(256))]  # exactly the slot's bytes
    assert [r.hex() for r in refs] == ["key1"]
    assert rig.guard.puts == 1
    # both slots go back to their producer at once, read or not
    slots = [(big.offset, big.rental), (small.offset, small.rental)]
    assert rig.releases() == [Release(slots=slots, segment=big.segment, reader="b")]
    assert rig.forgotten == [] and rig.errors() == [] and rig.guard.dropped == 0


def test_every_array_rides_inline_without_a_threshold_or_without_refs_to_keep(make, store):
    payload = bytes(range(200)) * 2
    unlimited = make(threshold=None)
    h = unlimited.slot(payload)
    out, refs = unlimited.guard.inline_all("b.data", [encode_frame([segment("r1", {"x": h})])], {})
    assert decode_data_frame(out[0])[0].device_handles == {"x": InlineArray(payload, "|u1", (400,))}
    assert refs == []
    # a threshold, but no list for references (inline called alone): inline as well
    limited = make(threshold=256)
    h = limited.slot(payload)
    out = limited.guard.inline(encode_frame([segment("r1", {"x": h})]), "b.data", limited.outs)
    assert decode_data_frame(out)[0].device_handles == {"x": InlineArray(payload, "|u1", (400,))}
    assert store.put == [] and unlimited.guard.puts == limited.guard.puts == 0
    assert [r.segment for r in limited.releases()] == [h.segment]


def test_a_frame_without_arrays_or_for_a_control_endpoint_goes_on_as_it_is(make):
    rig = make(threshold=256)
    plain = encode_frame([segment("r1"), segment("r2"), Submit(request_id="s", request={})])
    assert rig.guard.inline(plain, "b.data", rig.outs) is plain
    assert rig.guard.inline_all("b.data", [plain], rig.outs) == ([plain], [])
    # control frames carry no arrays: not even decoded
    assert rig.guard.inline_all("a.ctl", [GARBAGE], rig.outs) == ([GARBAGE], [])
    # an object its producer put already stays where it is: nothing to release
    with_object = encode_frame([segment("r1", {"o": obj("k1")})])
    assert rig.guard.inline(with_object, "b.data", rig.outs) is with_object
    assert rig.outs == {} and rig.guard.dropped == 0


def test_a_slot_ending_exactly_at_its_segments_end_is_read_one_byte_beyond_fails_its_request(
    make, caplog
):
    rig = make()
    arena = rig.arena("a", 128)
    rig.slot(b"\x01" * 64)
    last = rig.slot(b"\x02" * 64)
    assert last.offset + last.nbytes == arena.size == 128
    beyond = ShmHandle(arena.name, 65, 64, "|u1", (64,), "a", 9)
    frame = encode_frame([segment("r1", {"x": beyond}), segment("r2", {"x": last})])
    with caplog.at_level(logging.ERROR, logger="omni.ray.gateway"):
        out = rig.guard.inline(frame, "b.data", rig.outs)
    (msg,) = decode_data_frame(out)
    assert msg.request_id == "r2"
    assert msg.device_handles == {"x": InlineArray(b"\x02" * 64, "|u1", (64,))}
    why = f"handle of 64 bytes at offset 65 lies beyond segment {arena.name} (128 bytes)"
    assert rig.failed() == [
        lost("r1", "a", "b.data", f"its arrays cannot be read: ValueError: {why}")
    ]
    # the unreadable slot goes back too (its producer may reuse whatever it names)
    (rel,) = rig.releases()
    assert rel.reader == "b" and rel.slots == [(65, 9), (last.offset, last.rental)]
    assert rig.guard.dropped == 1
    (record,) = logged(caplog, "cannot read the arrays of a message of request r1")
    assert record.getMessage().startswith(f"gateway {NODE[:8]}: b.data: ")
    assert record.exc_info is not None and record.request_id == "r1"


def test_one_unreadable_message_fails_its_request_once_and_the_rest_of_the_frame_goes_on(make):
    rig = make()
    good = rig.slot(b"\x05" * 32)
    missing = ShmHandle(gone(rig), 0, 8, "|u1", (8,), "a", 3)
    inline = InlineArray(b"\x01\x02", "|u1", (2,))
    frame = encode_frame(
        [
            segment("r1", {"x": missing, "o": obj("k9"), "i": inline}),  # unreadable
            segment("r2"),  # no arrays
            segment("r3", {"x": good}),
            segment("r1", {"x": missing}, seq=1),  # r1 again: one error for both
        ]
    )
    out, refs = rig.guard.inline_all("b.data", [frame], rig.outs)
    assert [(m.request_id, m.device_handles) for m in decode_data_frame(out[0])] == [
        ("r2", {}),
        ("r3", {"x": InlineArray(b"\x05" * 32, "|u1", (32,))}),
    ]
    (err,) = rig.errors()
    assert err.request_id == "r1" and err.code == GATEWAY_ERROR
    assert "its arrays cannot be read: FileNotFoundError" in err.message
    # its slots go back (each once), its producer's object is let go by whoever holds it
    assert sorted((r.segment, r.slots, r.reader) for r in rig.releases()) == sorted(
        [(good.segment, [(good.offset, good.rental)], "b"), (missing.segment, [(0, 3)] * 2, "b")]
    )
    assert rig.forgotten == [("b.data", ["k9"])]
    assert rig.guard.dropped == 2 and refs == []


def test_an_unreadable_messages_objects_are_let_go_with_nobody_to_tell(make):
    rig = make(forget=False)
    missing = ShmHandle(gone(rig), 0, 8, "|u1", (8,), "a", 3)
    frame = encode_frame([segment("r1", {"x": missing, "o": obj("k9")}), segment("r2")])
    out = rig.guard.inline(frame, "b.data", rig.outs)
    assert [m.request_id for m in decode_data_frame(out)] == ["r2"]
    assert [e.request_id for e in rig.errors()] == ["r1"]


def test_a_frame_that_does_not_decode_is_dropped_and_fails_no_request_it_cannot_name(make, caplog):
    rig = make()
    after = encode_frame([segment("r4")])
    with caplog.at_level(logging.ERROR, logger="omni.ray.gateway"):
        out, refs = rig.guard.inline_all("b.data", [GARBAGE, after], rig.outs)
    assert out == [after] and refs == []
    assert rig.guard.dropped == 1 and rig.outs == {}  # no error, no release sent
    (record,) = logged(caplog, "an undecodable message of request None was dropped")
    assert record.getMessage().startswith(f"gateway {NODE[:8]}: b.data: ")


def test_undecodable_messages_fail_their_own_requests_each_once_the_stage_named_or_the_readers(
    make, caplog
):
    rig = make()
    bad = {"event_type": "segment", "request_id": "r2", "stage": "a", "sequence": "x"}
    nameless = {"event_type": "segment", "request_id": "r5", "sequence": "x"}
    good = msgspec.msgpack.decode(encode_frame([segment("r4")]))[0]
    frame = msgspec.msgpack.encode([5, bad, bad, good, nameless])  # 5: not even a message
    with caplog.at_level(logging.ERROR, logger="omni.ray.gateway"):
        out = rig.guard.inline(frame, "c#2.data", rig.outs)
    assert [m.request_id for m in decode_data_frame(out)] == ["r4"]
    errors = rig.errors()
    assert [(e.request_id, e.stage, e.code) for e in errors] == [
        ("r2", "a", GATEWAY_ERROR),
        ("r5", "c", GATEWAY_ERROR),  # no stage named: the reader's (a replica of c)
    ]
    assert errors[1].message.startswith(
        f"gateway on node {NODE[:12]}: a message of stage 'c' to c#2.data was lost: "
        "undecodable message: "
    )
    assert rig.guard.dropped == 4 and rig.outs.keys() == {RESULTS}
    assert len(logged(caplog, "an undecodable message of request r2")) == 2


def test_a_frame_that_cannot_be_handled_at_all_is_dropped_and_the_next_goes_on(make, caplog):
    rig = make()
    h = rig.slot(b"\x03" * 8)
    after = encode_frame([segment("r1", {"x": h})])
    with caplog.at_level(logging.ERROR, logger="omni.ray.gateway"):
        out, refs = rig.guard.inline_all("b.data", [DEEP, after, DEEP], rig.outs)
    assert [decode_data_frame(f)[0].device_handles for f in out] == [
        {"x": InlineArray(b"\x03" * 8, "|u1", (8,))}
    ]
    assert rig.guard.dropped == 2 and rig.errors() == []
    dropped = logged(caplog, "cannot read a frame's arrays; frame dropped")
    assert len(dropped) == 2 and dropped[0].exc_info is not None
    assert dropped[0].getMessage().startswith(f"gateway {NODE[:8]}: b.data: ")
    cleanup = logged(caplog, "cannot clean up after a dropped frame")
    assert len(cleanup) == 2 and cleanup[0].getMessage().startswith(f"gateway {NODE[:8]}: ")


def test_a_broken_socket_is_not_taken_for_a_bad_frame(make):
    rig = make()
    broken = rig.ctx.socket(zmq.PUSH)
    broken.close()
    outs = {"a.ctl": broken}  # the slot's release cannot be sent
    with pytest.raises(zmq.ZMQError):
        rig.guard.inline_all("b.data", [encode_frame([segment("r1", {"x": rig.slot(b"1")})])], outs)
    with pytest.raises(zmq.ZMQError):
        submit = encode_frame([Submit(request_id="s", request={})])
        rig.guard.screen("b.data", submit, {RESULTS: broken}, THERE)  # refused: its error


def test_the_sockets_it_opens_buffer_a_hundred_thousand_frames(make):
    rig = make()
    rig.guard.fail_requests([("r1", "a", "why")], "b.data", rig.outs)
    assert rig.outs[RESULTS].sndhwm == 100_000
    assert rig.failed() == [lost("r1", "a", "b.data", "why")]


# ------------------------------------------------------------------------- drop()
def test_a_dropped_frame_gives_back_its_arrays_and_fails_its_requests_but_not_its_own_errors(
    make,
):
    rig = make()
    h = rig.slot(b"\x04" * 16)
    frame = encode_frame(
        [
            Error(request_id="r1", stage="b", message="lost", code=GATEWAY_ERROR),
            Error(request_id="r2", stage="b", message="failed", code="stage_error"),
            segment("r3", {"x": h, "o": obj("k2")}, stage="b"),
        ]
    )
    rig.guard.drop(RESULTS, frame, rig.outs, "why")
    assert rig.failed() == [lost("r2", "b", RESULTS, "why"), lost("r3", "b", RESULTS, "why")]
    assert rig.releases() == [
        Release(slots=[(h.offset, h.rental)], segment=h.segment, reader="client")
    ]
    assert rig.forgotten == [(RESULTS, ["k2"])] and rig.guard.dropped == 1


def test_a_dropped_control_frame_is_logged_only(make, caplog):
    rig = make()
    frame = encode_frame([Release(slots=[(0, 1)], segment="omni-x", reader="b")])
    with caplog.at_level(logging.ERROR, logger="omni.ray.gateway"):
        rig.guard.drop("a.ctl", frame, rig.outs, "why")
    assert rig.outs == {} and rig.guard.dropped == 1
    (record,) = logged(caplog, "a frame was dropped: why")
    assert record.getMessage() == f"gateway {NODE[:8]}: a.ctl: a frame was dropped: why"


def test_dropping_never_raises_though_its_cleanup_fails(make, caplog):
    rig = make()

    def forget(endpoint, keys):
        raise RuntimeError("the holder is gone")

    rig.guard.forget_objects = forget
    h = rig.slot(b"\x04" * 16)
    with caplog.at_level(logging.ERROR, logger="omni.ray.gateway"):
        rig.guard.drop("b.data", encode_frame([segment("r1", {"x": h, "o": obj("k")})]), {}, "x")
    (record,) = logged(caplog, "cannot clean up after a dropped frame")
    assert record.exc_info is not None


# ------------------------------------------------------------------------ screen()
def test_a_screened_frame_with_nothing_to_refuse_goes_on_as_it_was_spelled(make):
    rig = make()
    data = str8_frame(encode_frame([segment("r1", {"o": obj("k1")}), segment("r2")]))
    assert rig.guard.screen("b.data", data, rig.outs, THERE) == data
    submit = encode_frame([Submit(request_id="s1", request={})])
    assert rig.guard.screen("b.data", submit, rig.outs, HEAD) == submit  # the head's
    assert rig.outs == {} and rig.guard.refused == rig.guard.dropped == 0


def test_a_handle_not_to_this_pipelines_objects_is_refused_and_named_by_its_first_80_chars(
    make, caplog
):
    rig = make()
    here = rig.slot(b"\x01" * 16)
    first = ShmHandle(LONG, 0, 16, "|u1", (16,), "a", 1)
    frame = encode_frame(
        [
            segment("r1", {"x": first, "y": obj("k", "another"), "z": here}),
            segment("r2", {"x": here}),  # a slot of this node's: forged
            r3 := segment("r3", {"o": obj("k3")}),
        ]
    )
    with caplog.at_level(logging.WARNING, logger="omni.ray.gateway"):
        out = rig.guard.screen("b.data", frame, rig.outs, HEAD)  # not even from the head
    assert decode_data_frame(out) == [r3]
    assert rig.failed() == [
        lost("r1", "a", "b.data", f"refused: it names segment {LONG[:80]!r}"),
        lost("r2", "a", "b.data", f"refused: it names segment {here.segment[:80]!r}"),
    ]
    assert rig.guard.refused == 2 and rig.releases() == []  # none was theirs to release
    assert logged(caplog, "refused a handle")[0].getMessage() == (
        f"gateway {NODE[:8]}: b.data: refused a handle to segment {LONG[:80]!r} from node "
        f"{HEAD[:12]} (not its sender's to send)"
    )


def test_a_submit_is_taken_from_the_head_node_alone(make, caplog):
    rig = make()
    r2 = segment("r2")
    frame = encode_frame([Submit(request_id="s1", request={}), r2])
    with caplog.at_level(logging.WARNING, logger="omni.ray.gateway"):
        from_there = rig.guard.screen("b.data", frame, rig.outs, THERE)
        from_unknown = rig.guard.screen("b.data", frame, rig.outs, None)
    assert from_there == from_unknown == encode_frame([r2])
    assert [e.request_id for e in rig.errors()] == ["s1", "s1"]
    assert rig.guard.screen("b.data", frame, rig.outs, HEAD) is frame
    assert rig.guard.refused == 2
    assert [r.getMessage().rsplit(" from node ", 1)[1] for r in logged(caplog, "submit")] == [
        f"{THERE[:12]} (not its sender's to send)",
        "unknown (not its sender's to send)",
    ]


def test_an_undecodable_message_in_a_screened_frame_is_dropped_and_fails_its_request(make):
    rig = make()
    bad = {"event_type": "segment", "request_id": "r2", "stage": "a", "sequence": "x"}
    r1 = segment("r1")
    good = msgspec.msgpack.decode(encode_frame([r1]))[0]
    out = rig.guard.screen("b.data", msgspec.msgpack.encode([bad, good, bad]), rig.outs, HEAD)
    assert out == encode_frame([r1])
    assert [(e.request_id, e.code) for e in rig.errors()] == [("r2", GATEWAY_ERROR)]
    assert rig.guard.dropped == 2 and rig.guard.refused == 0
    # nothing of it decodes: nothing goes on
    assert rig.guard.screen("b.data", GARBAGE, rig.outs, HEAD) is None
    assert rig.guard.dropped == 3


def test_a_frame_that_cannot_be_screened_is_refused(make, caplog):
    rig = make()
    with caplog.at_level(logging.WARNING, logger="omni.ray.gateway"):
        assert rig.guard.screen("b.data", DEEP, rig.outs, THERE) is None
    assert rig.guard.refused == 1
    (record,) = logged(caplog, "a frame that cannot be screened (RecursionError: ")
    assert record.getMessage().startswith(f"gateway {NODE[:8]}: b.data: refused ")


ORCHESTRATORS = [Cancel(request_id="r1"), ReaderLost(reader="b"), Shutdown(drain=False)]


def test_control_messages_are_the_head_nodes_alone_and_a_release_nobodys(make, caplog):
    rig = make()
    forged = Release(slots=[(0, 1)], segment=LONG, reader="b")
    frame = str8_frame(encode_frame([ORCHESTRATORS[0], forged, *ORCHESTRATORS[1:]]))
    with caplog.at_level(logging.WARNING, logger="omni.ray.gateway"):
        # from the head: all but the release, in the usual spelling
        assert rig.guard.screen("b.ctl", frame, rig.outs, HEAD) == encode_frame(ORCHESTRATORS)
        assert rig.guard.refused == 1
        (record,) = logged(caplog, "refused a release")
        assert record.getMessage() == (
            f"gateway {NODE[:8]}: b.ctl: refused a release of {LONG[:80]!r} for 'b' from node "
            f"{HEAD[:12]} (not its sender's to send)"
        )
        for sender in (THERE, None):
            assert rig.guard.screen("b.ctl", frame, rig.outs, sender) is None
    assert rig.guard.refused == 1 + 2 * 4
    assert len(logged(caplog, "a Cancel (the orchestrator's)")) == 2
    assert rig.outs == {}  # a refused control message fails no request
    ok = encode_frame([Cancel(request_id="r9")])
    assert rig.guard.screen("b.ctl", str8_frame(ok), rig.outs, HEAD) == ok


def test_undecodable_control_messages_are_dropped_and_logged_with_their_sender(make, caplog):
    rig = make()
    bad = {"event_type": "release", "slots": "x"}
    cancel = msgspec.msgpack.decode(encode_frame([Cancel(request_id="r1")]))[0]
    frame = msgspec.msgpack.encode([bad, cancel, bad])
    with caplog.at_level(logging.ERROR, logger="omni.ray.gateway"):
        assert rig.guard.screen("b.ctl", frame, rig.outs, HEAD) == encode_frame(
            [Cancel(request_id="r1")]
        )
        assert rig.guard.dropped == 2 and rig.guard.refused == 0
        assert rig.guard.screen("b.ctl", frame, rig.outs, None) is None
    assert rig.guard.dropped == 4 and rig.guard.refused == 1
    records = logged(caplog, "an undecodable control message from node")
    assert [r.getMessage().split(" was dropped")[0] for r in records] == [
        f"gateway {NODE[:8]}: b.ctl: an undecodable control message from node {HEAD[:8]}"
    ] * 2 + [f"gateway {NODE[:8]}: b.ctl: an undecodable control message from node ?"] * 2
