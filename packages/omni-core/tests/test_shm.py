import os
import stat
import threading
import time

import numpy as np
import pytest
from omni_core.serial import ArrayCodec
from omni_core.shm import (
    Arena,
    SegmentOwner,
    SegmentReader,
    ShmPoolExhausted,
    list_segments,
    sweep_stale,
)


@pytest.fixture
def owner():
    o = SegmentOwner()
    yield o
    o.unlink_all()


def test_segments_are_owner_only_and_unlinked(owner):
    name = owner.create("stage", 1 << 20)
    st = os.stat(f"/dev/shm/{name}")
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert name in list_segments(os.getpid())
    owner.unlink_all()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_stale_segments_of_dead_owners_are_swept(tmp_path):
    (tmp_path / "omni-999999999-abcd-x-0").write_bytes(b"x")
    (tmp_path / f"omni-{os.getpid()}-abcd-x-0").write_bytes(b"x")
    (tmp_path / "other").write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == ["omni-999999999-abcd-x-0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"omni-{os.getpid()}-abcd-x-0", "other"]


def test_rent_and_return_with_refcounts(owner):
    arena = Arena(owner.create("a", 1 << 16))
    off = arena.rent(1000, {"b": 1, "c": 1})
    assert arena.slots_in_use == 1
    arena.release([off], "b")
    assert arena.slots_in_use == 1  # c still reads it
    arena.release([off], "c")
    assert arena.slots_in_use == 0 and arena.bytes_free == arena.size
    arena.release([off], "c")  # a stray release is counted, not fatal
    assert arena.unknown_releases == 1


def test_free_space_coalesces(owner):
    arena = Arena(owner.create("a", 4096))
    offs = [arena.rent(1024, {"r": 1}) for _ in range(4)]
    with pytest.raises(ShmPoolExhausted):
        arena.rent(64, {"r": 1}, timeout=0.05)
    for off in (offs[1], offs[3], offs[2], offs[0]):
        arena.release([off], "r")
    assert arena._free == [(0, 4096)]
    assert arena.rent(4096, {"r": 1})[0] == 0


def test_full_pool_blocks_until_a_release(owner):
    arena = Arena(owner.create("a", 4096))
    off = arena.rent(4096, {"r": 1})
    threading.Timer(0.1, arena.release, ([off], "r")).start()
    t0 = time.monotonic()
    assert arena.rent(4096, {"r": 1}, timeout=5)[0] == 0
    assert time.monotonic() - t0 >= 0.09 and arena.blocked_s > 0


def test_too_large_payload_names_the_setting(owner):
    arena = Arena(owner.create("a", 4096))
    with pytest.raises(ShmPoolExhausted, match="shm_pool_bytes"):
        arena.rent(8192, {"r": 1})


def test_forget_reader_frees_its_slots(owner):
    arena = Arena(owner.create("a", 1 << 16))
    a = arena.rent(100, {"dead": 1})
    b = arena.rent(100, {"dead": 1, "alive": 1})
    assert arena.forget_reader("dead") == 1
    assert arena.slots_in_use == 1
    arena.release([b], "alive")
    assert arena.slots_in_use == 0
    assert a != b


def test_codec_round_trip_views_without_copy(owner):
    arena = Arena(owner.create("p", 1 << 22))
    producer = ArrayCodec("p", arena, threshold=1024)
    reader = ArrayCodec("r", reader=SegmentReader())
    big = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    small = np.arange(10, dtype=np.int64)
    blob = bytes(range(256)) * 40
    handles = producer.pack({"big": big, "small": small, "blob": blob}, {"r": 1})
    assert type(handles["big"]).__name__ == "ShmHandle"
    assert type(handles["small"]).__name__ == "InlineArray"
    arrays, shm = reader.unpack(handles)
    assert np.array_equal(arrays["big"], big) and arrays["big"].dtype == np.float32
    assert not arrays["big"].flags.writeable  # readers share the slot
    assert np.array_equal(arrays["small"], small)
    assert arrays["blob"].tobytes() == blob
    assert {h.offset for h in shm} == {handles["big"].offset, handles["blob"].offset}
    assert all(h.rental > 0 for h in shm)
    copied, _ = reader.unpack(handles, copy=True)
    assert copied["blob"] == blob and copied["big"].flags.writeable


def test_codec_rejects_object_arrays():
    with pytest.raises(TypeError, match="Python objects"):
        ArrayCodec("p").pack({"x": np.array([object()])}, {})
    with pytest.raises(TypeError, match="numpy array"):
        ArrayCodec("p").pack({"x": [1, 2]}, {})


def test_codec_torch_tensors(owner):
    torch = pytest.importorskip("torch")
    arena = Arena(owner.create("p", 1 << 22))
    producer = ArrayCodec("p", arena, threshold=1024)
    reader = ArrayCodec("r")
    t = torch.randn(128, 64).to(torch.bfloat16)
    arrays, _ = reader.unpack(producer.pack({"t": t, "s": torch.arange(3)}, {"r": 1}))
    assert isinstance(arrays["t"], torch.Tensor) and arrays["t"].dtype == torch.bfloat16
    assert torch.equal(arrays["t"], t) and torch.equal(arrays["s"], torch.arange(3))


def test_a_stale_release_cannot_free_a_later_rental_of_the_same_offset(owner):
    arena = Arena(owner.create("a", 4096))
    first = arena.rent(4096, {"r": 1})
    arena.release([first], "r")
    second = arena.rent(4096, {"r": 1})
    assert second[0] == first[0] and second[1] != first[1]
    arena.release([first], "r")  # late duplicate of the first release
    assert arena.slots_in_use == 1 and arena.unknown_releases == 1
    arena.release([second], "r")
    assert arena.slots_in_use == 0


def test_cancel_frees_a_slot_whatever_its_readers(owner):
    arena = Arena(owner.create("a", 4096))
    slot = arena.rent(100, {"r": 1, "s": 2})
    arena.cancel(slot)
    assert arena.slots_in_use == 0


def test_a_failed_pack_returns_the_slots_it_rented(owner):
    arena = Arena(owner.create("p", 1 << 20))
    codec = ArrayCodec("p", arena, threshold=1024)
    with pytest.raises(TypeError):
        codec.pack({"ok": np.zeros(4096, np.uint8), "bad": [1, 2, 3]}, {"r": 1})
    assert arena.slots_in_use == 0
