"""The serial module's edges, called directly: the inline/shared-memory threshold at its
limit, what cannot go on the wire, which segments pack into a run, a frame salvaged
message by message, and the array codec's conversions."""

import types
import warnings

import msgspec
import numpy as np
import pytest
from omni_core.dataplane import serial
from omni_core.dataplane.serial import (
    ArrayCodec,
    BadMessage,
    array_from_flat,
    array_nbytes,
    array_to_flat,
    check_request,
    decode_event_frame,
    encode_frame,
    pack_runs,
    salvage_frame,
)
from omni_core.dataplane.shm import EXTERNAL_SEGMENTS, Arena, SegmentOwner, ShmPoolExhausted
from omni_core.events import Completed, InlineArray, Segment, SegmentRun, ShmHandle


@pytest.fixture
def owner():
    o = SegmentOwner()
    yield o
    o.unlink_all()


# --------------------------------------------------------------------------- threshold


@pytest.mark.parametrize(("nbytes", "kind"), [(64 * 1024 - 1, InlineArray), (64 * 1024, ShmHandle)])
def test_default_threshold_is_64_kib_exactly(owner, nbytes, kind):
    arena = Arena(owner.create("a", 1 << 18))
    codec = ArrayCodec("p", arena)
    handles = codec.pack({"x": np.zeros(nbytes, dtype=np.uint8)}, {"r": 1})
    assert type(handles["x"]) is kind


# --------------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    "value",
    [object(), 2**70, "\ud800"],  # unsupported type, int out of range, bad unicode
    ids=["type", "overflow", "surrogate"],
)
def test_check_request_names_the_request_for_each_failure(value):
    with pytest.raises(TypeError, match="request r7: cannot be serialized"):
        check_request({"v": value}, "r7")


def test_check_request_passes_a_plain_request():
    check_request({"prompt": "hi", "n": 2**63}, "r1")


# --------------------------------------------------------------------------- runs


def seg(seq: int, rid: str = "r", stage: str = "s", last: bool = False, **kw) -> Segment:
    return Segment(request_id=rid, stage=stage, sequence=seq, tokens=[seq], is_last=last, **kw)


def shape(out: list) -> list:
    """("run", first sequence, length, is_last) per run, the sequence per segment."""
    return [
        ("run", m.sequence, len(m), m.is_last) if type(m) is SegmentRun else m.sequence for m in out
    ]


def test_consecutive_segments_pack_into_one_run():
    out = pack_runs([seg(3), seg(4), seg(5)])
    assert shape(out) == [("run", 3, 3, False)]
    assert [s.tokens for s in out[0].segments()] == [[3], [4], [5]]


def test_a_last_segment_ends_the_run():
    out = pack_runs([seg(0), seg(1), seg(2, last=True), seg(3), seg(4)])
    assert shape(out) == [("run", 0, 3, True), ("run", 3, 2, False)]


def test_a_last_segment_never_starts_a_run():
    assert shape(pack_runs([seg(0, last=True), seg(1)])) == [0, 1]


@pytest.mark.parametrize(
    "second",
    [
        seg(2),  # a gap in the sequence
        seg(0),  # the same sequence again
        seg(1, rid="other"),
        seg(1, stage="other"),
        seg(1, device_handles={"x": InlineArray(b"\0", "uint8", (1,), False)}),
        Completed(request_id="r", stage="s", sequence=1),
    ],
    ids=["gap", "repeat", "request", "stage", "arrays", "not-a-segment"],
)
def test_what_breaks_a_run(second):
    out = pack_runs([seg(0), second])
    assert out == [out[0], second] and type(out[0]) is Segment


def test_a_segment_with_arrays_stays_alone():
    arrays = {"x": InlineArray(b"\0", "uint8", (1,), False)}
    assert shape(pack_runs([seg(0, device_handles=arrays), seg(1), seg(2)])) == [
        0,
        ("run", 1, 2, False),
    ]


# --------------------------------------------------------------------------- frames


def test_salvage_of_a_frame_that_is_no_list():
    good, bad = salvage_frame(b"\xc1", "event")
    assert good == []
    assert len(bad) == 1 and bad[0][:2] == (None, None)
    assert bad[0].error.startswith("undecodable frame:")


def test_salvage_keeps_good_messages_and_expands_runs_beside_a_bad_one():
    run = SegmentRun.of([seg(0), seg(1)], "s", 0)
    bad_ext = b"\xc7\x03\xff\x00\x00\x00"  # a timestamp of a length msgpack has not
    frame = b"\x94" + encode_frame([seg(5, rid="a")])[1:] + bad_ext
    frame += encode_frame([{"event_type": "segment", "request_id": "b", "stage": 3}])[1:]
    frame += encode_frame([run])[1:]
    good, bad = salvage_frame(frame, "event")
    assert [(m.request_id, m.sequence) for m in good] == [("a", 5), ("r", 0), ("r", 1)]
    assert [type(m) for m in good] == [Segment] * 3
    assert [b[:2] for b in bad] == [(None, None), ("b", None)]
    assert all(isinstance(b, BadMessage) and b.error for b in bad)


def test_salvage_of_data_keeps_runs_packed():
    run = SegmentRun.of([seg(0), seg(1)], "s", 0)
    good, bad = salvage_frame(encode_frame([run]), "data")
    assert bad == [] and good == [run]


def test_a_frame_of_runs_only_comes_back_as_segments():
    frame = encode_frame([SegmentRun.of([seg(0), seg(1)], "s", 0)])
    assert [(type(m), m.sequence) for m in decode_event_frame(frame)] == [
        (Segment, 0),
        (Segment, 1),
    ]


def test_undecodable_frame_raises():
    with pytest.raises(msgspec.DecodeError):
        decode_event_frame(b"\x91\xc1")


# --------------------------------------------------------------------------- arrays


def test_bytes_to_flat_is_no_tensor():
    flat, dtype, shp, torch_ = array_to_flat(b"abc")
    assert (flat.tolist(), dtype, shp, torch_) == ([97, 98, 99], "bytes", (3,), False)
    assert array_nbytes(b"abc") == 3


def test_numpy_2d_to_flat_and_back():
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    flat, dtype, shp, torch_ = array_to_flat(a)
    assert flat.shape == (12,) and flat.dtype == np.uint8
    assert (dtype, shp, torch_) == ("<i2", (2, 3), False)
    back = array_from_flat(flat, dtype, shp, False, False)
    assert np.array_equal(back, a)
    assert array_nbytes(a) == 12


def test_bytes_back_as_bytes_only_when_owned():
    raw = np.frombuffer(b"xyz", dtype=np.uint8)
    assert array_from_flat(raw, "bytes", (3,), False, True) == b"xyz"
    view = array_from_flat(raw, "bytes", (3,), False, False)
    assert isinstance(view, np.ndarray) and view.tobytes() == b"xyz"


def test_numpy_with_torch_loaded_is_no_tensor():
    pytest.importorskip("torch")
    flat, dtype, shp, torch_ = array_to_flat(np.ones((2, 2), dtype=np.float32))
    assert (flat.size, dtype, shp, torch_) == (16, "<f4", (2, 2), False)
    assert array_nbytes(np.ones(3, dtype=np.float64)) == 24


def test_torch_2d_to_flat_and_back():
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    flat, dtype, shp, torch_ = array_to_flat(t)
    assert (flat.shape, dtype, shp, torch_) == ((24,), "float32", (2, 3), True)
    assert array_nbytes(t) == 24
    back = array_from_flat(flat.copy(), dtype, shp, True, False)
    assert torch.equal(back, t)


def test_a_tensor_off_the_cpu_goes_through_host_memory():
    torch = pytest.importorskip("torch")
    host = torch.arange(4, dtype=torch.int32)

    class OffCpu:  # what a device tensor offers the codec
        __module__ = "torch.fake"
        device = types.SimpleNamespace(type="cuda")

        def detach(self):
            return self

        def cpu(self):
            return host

    flat, dtype, shp, torch_ = array_to_flat(OffCpu())
    assert (flat.size, dtype, shp, torch_) == (16, "int32", (4,), True)


def test_a_tensor_over_read_only_memory_is_a_copy():
    torch = pytest.importorskip("torch")
    raw = np.arange(8, dtype=np.uint8)
    raw.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns over a read-only array
        t = array_from_flat(raw, "uint8", (2, 4), True, False)
    t[0, 0] = 99
    assert raw[0] == 0 and t.shape == (2, 4)
    assert isinstance(t, torch.Tensor)


def test_a_tensor_over_writeable_memory_shares_it():
    pytest.importorskip("torch")
    raw = np.arange(8, dtype=np.uint8)
    t = array_from_flat(raw, "uint8", (8,), True, True)
    t[0] = 99
    assert raw[0] == 99


def test_default_rent_timeout():
    assert ArrayCodec("p").rent_timeout == 30.0


# --------------------------------------------------------------------------- codec


class RecordingWriter:
    """An external writer that takes arrays of ``takes`` bytes and records cancels."""

    def __init__(self, takes: int) -> None:
        self.takes = takes
        self.written: list[str] = []
        self.cancelled: list[str] = []

    def write(self, flat, readers):
        if flat.size != self.takes:
            return None
        self.written.append(f"ext-{len(self.written)}")
        return self.written[-1]

    def cancel(self, segment, readers):
        self.cancelled.append(segment)


@pytest.fixture
def writer(monkeypatch):
    w = RecordingWriter(takes=100)
    monkeypatch.setitem(serial.EXTERNAL_WRITERS, "p", w)
    return w


def test_every_array_is_packed(owner):
    codec = ArrayCodec("p", Arena(owner.create("a", 1 << 16)), threshold=100)
    arrays = {"a": b"1", "b": b"22", "c": np.zeros(100, np.uint8), "d": np.ones(100, np.uint8)}
    handles = codec.pack(arrays, {"r": 1})
    assert {k: type(h) for k, h in handles.items()} == {
        "a": InlineArray,
        "b": InlineArray,
        "c": ShmHandle,
        "d": ShmHandle,
    }


def test_an_external_writer_takes_what_it_can(owner, writer):
    arena = Arena(owner.create("a", 1 << 16))
    codec = ArrayCodec("p", arena, threshold=10)
    arrays = {k: np.zeros(n, np.uint8) for k, n in [("a", 100), ("b", 100), ("c", 50)]}
    handles = codec.pack(arrays, {"r": 1})
    assert [(h.segment, h.offset, h.rental) for h in (handles["a"], handles["b"])] == [
        ("ext-0", 0, 0),
        ("ext-1", 0, 0),
    ]
    assert handles["c"].segment == arena.name and arena.slots_in_use == 1


def test_a_failed_pack_gives_back_what_it_took(owner, writer):
    arena = Arena(owner.create("a", 4096))
    codec = ArrayCodec("p", arena, threshold=10)
    arrays = {
        "slot": np.zeros(50, np.uint8),
        "ext": np.zeros(100, np.uint8),
        "huge": np.zeros(8192, np.uint8),
    }
    with pytest.raises(ShmPoolExhausted):
        codec.pack(arrays, {"r": 1})
    assert arena.slots_in_use == 0
    assert writer.cancelled == ["ext-0"]


def test_a_pack_interrupted_gives_back_its_slots(owner, monkeypatch):
    arena = Arena(owner.create("a", 1 << 16))
    codec = ArrayCodec("p", arena, threshold=10)

    def interrupted(value):
        if isinstance(value, str):
            raise KeyboardInterrupt
        return array_to_flat(value)

    monkeypatch.setattr(serial, "array_to_flat", interrupted)
    with pytest.raises(KeyboardInterrupt):
        codec.pack({"a": np.zeros(50, np.uint8), "b": "stop"}, {"r": 1})
    assert arena.slots_in_use == 0


@pytest.mark.parametrize("torch_", [False, True])
def test_unpack_inline_copies_only_when_asked(torch_):
    if torch_:
        pytest.importorskip("torch")
    codec = ArrayCodec("p")
    handles = {"x": InlineArray(b"\x01\x02", "uint8", (2,), torch_)}
    view, shm = codec.unpack(handles)
    copied, _ = codec.unpack(handles, copy=True)
    assert shm == []
    assert copied["x"].tolist() == [1, 2]
    if torch_:  # a tensor is always over its own memory
        view["x"][0] = 9
        assert handles["x"].data == b"\x01\x02"
    else:
        assert not view["x"].flags.writeable and copied["x"].flags.writeable


def test_unpack_from_a_slot_copies_only_when_asked(owner):
    arena = Arena(owner.create("a", 1 << 16))  # producer "a"'s own segment
    codec = ArrayCodec("a", arena, threshold=10)
    handles = codec.pack({"x": np.arange(20, dtype=np.uint8)}, {"r": 2})
    view, shm = codec.unpack(handles)
    copied, _ = codec.unpack(handles, copy=True)
    assert shm == [handles["x"]]
    assert not view["x"].flags.writeable and copied["x"].flags.writeable
    assert copied["x"].tolist() == list(range(20))


def test_releases_one_per_producer_segment():
    def h(producer, segment, offset, rental):
        return ShmHandle(segment, offset, 8, "uint8", (8,), producer, rental, False)

    handles = [h("p", "s1", 0, 1), h("q", "s2", 64, 2), h("p", "s1", 128, 3)]
    out = serial.releases(handles, "me")
    assert [(p, r.segment, r.reader, r.slots) for p, r in out] == [
        ("p", "s1", "me", [(0, 1), (128, 3)]),
        ("q", "s2", "me", [(64, 2)]),
    ]


def test_a_writeable_external_segment_is_read_only_once_unpacked(monkeypatch):
    lent = bytearray(range(16))  # a backend's buffer that happens to be writeable
    monkeypatch.setitem(EXTERNAL_SEGMENTS, "ext-", lambda name: lent)
    handle = ShmHandle("ext-1", 4, 8, "uint8", (8,), "q", 0, False)
    arrays, shm = ArrayCodec("p").unpack({"x": handle})
    assert shm == [handle] and arrays["x"].tolist() == list(range(4, 12))
    assert not arrays["x"].flags.writeable  # fan-out peers share the buffer
