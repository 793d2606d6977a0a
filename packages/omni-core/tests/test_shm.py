import fcntl
import os
import stat
import threading
import time
import warnings

import numpy as np
import pytest
from omni_core.dataplane import shm as shm_module
from omni_core.dataplane.serial import ArrayCodec
from omni_core.dataplane.shm import (
    Arena,
    SegmentOwner,
    SegmentReader,
    ShmPoolExhausted,
    list_segments,
    sweep_stale,
)
from omni_testing.faults import child_reporting


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


# a process that owns one segment in ``argv[1]`` and lives until its stdin closes
_OWNER = """
import sys
from omni_core.dataplane.shm import SegmentOwner
owner = SegmentOwner(sys.argv[1], token="peer")
print(owner.create("x", 4096), flush=True)
sys.stdin.read()
"""


def _owner_process(directory):
    return child_reporting(_OWNER, str(directory))


def _segment(directory, name, mode=0o600):
    path = directory / name
    path.write_bytes(b"x")
    path.chmod(mode)
    return path


def test_a_sigkilled_owners_segments_are_swept(tmp_path):
    p, name = _owner_process(tmp_path)
    assert sweep_stale(str(tmp_path)) == []  # its owner lives: locked
    p.kill()
    p.wait()
    assert sweep_stale(str(tmp_path)) == [name]
    assert list(tmp_path.iterdir()) == []


def test_a_live_owners_segment_is_kept_whatever_its_pid_says(tmp_path):
    """The owner lock decides, not the pid in the name: that pid may be reused, or
    belong to another pid namespace sharing /dev/shm."""
    p, name = _owner_process(tmp_path)
    try:
        # the live owner's segment under a name whose pid is dead
        dead_pid_name = "omni-999999999-peer-x-0"
        os.rename(tmp_path / name, tmp_path / dead_pid_name)
        # an unlocked segment named with a live pid (ours): its owner is gone
        _segment(tmp_path, f"omni-{os.getpid()}-abcd-x-0")
        assert sweep_stale(str(tmp_path)) == [f"omni-{os.getpid()}-abcd-x-0"]
        assert [x.name for x in tmp_path.iterdir()] == [dead_pid_name]
    finally:
        p.stdin.close()
        p.wait()
    assert sweep_stale(str(tmp_path)) == [dead_pid_name]  # its owner exited


def test_a_live_segment_of_this_process_is_kept(tmp_path):
    owner = SegmentOwner(str(tmp_path))
    name = owner.create("x", 4096)
    assert sweep_stale(str(tmp_path)) == []
    SegmentOwner(str(tmp_path)).unlink_all()  # another pipeline of this process starts
    assert (tmp_path / name).exists()
    owner.unlink_all()
    assert list(tmp_path.iterdir()) == []


def test_the_sweep_skips_what_is_not_a_stale_segment_of_ours(tmp_path):
    keep = [
        _segment(tmp_path, "other"),
        _segment(tmp_path, "omni-config"),  # the prefix, not the naming pattern
        _segment(tmp_path, "omni-1-abcd-x-y"),
        _segment(tmp_path, "omni-999999999-abcd-shared-0", mode=0o644),  # not private
    ]
    target = _segment(tmp_path, "target")
    (tmp_path / "omni-999999999-abcd-link-0").symlink_to(target)
    (tmp_path / "omni-999999999-abcd-dir-0").mkdir(mode=0o700)
    keep += [
        target,
        tmp_path / "omni-999999999-abcd-link-0",
        tmp_path / "omni-999999999-abcd-dir-0",
    ]
    if os.geteuid() == 0:  # another user's segment (only root can make one)
        foreign = _segment(tmp_path, "omni-999999999-abcd-foreign-0")
        os.chown(foreign, 65534, 65534)
        keep.append(foreign)
    assert sweep_stale(str(tmp_path)) == []
    assert sorted(tmp_path.iterdir()) == sorted(keep)


def test_a_segment_the_sweep_may_not_remove_fails_nothing(tmp_path, monkeypatch):
    stale = _segment(tmp_path, "omni-999999999-abcd-x-0")

    def refuse(path, *a, **kw):
        raise PermissionError(1, "Operation not permitted", path)

    with monkeypatch.context() as m:
        m.setattr(shm_module.os, "unlink", refuse)
        assert sweep_stale(str(tmp_path)) == []
        owner = SegmentOwner(str(tmp_path))  # a start is not failed by it
    assert stale.exists()
    owner.unlink_all()
    if os.geteuid() != 0:  # a directory this user may not write into: EACCES
        tmp_path.chmod(0o500)
        try:
            assert sweep_stale(str(tmp_path)) == []
        finally:
            tmp_path.chmod(0o700)
    assert sweep_stale(str(tmp_path)) == [stale.name]
    assert sweep_stale(str(tmp_path / "missing")) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make another user's segment")
def test_a_start_is_not_failed_by_a_foreign_users_segment_in_dev_shm():
    name = "omni-999999999-f0reign-x-0"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.write(b"x")
    os.chmod(path, 0o600)
    os.chown(path, 65534, 65534)
    try:
        owner = SegmentOwner()  # sweeps /dev/shm
        owner.unlink_all()
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_segments_are_locked_by_their_owner_until_unlinked(owner):
    name = owner.create("stage", 4096)
    fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner.unlink(name)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once unlinked
    finally:
        os.close(fd)


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


class ExternalStore:
    """An external writer that keeps arrays in a dict (a backend's object store)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.cancelled: list[tuple[str, dict]] = []

    def write(self, flat, readers):
        if "r" not in readers:
            return None  # not for this reader: the producer takes a slot
        name = f"ext:{len(self.objects)}"
        self.objects[name] = flat.tobytes()
        return name

    def cancel(self, segment, readers):
        self.cancelled.append((segment, readers))
        del self.objects[segment]

    def __call__(self, segment):  # the reading side (EXTERNAL_SEGMENTS)
        return memoryview(self.objects[segment])


def test_an_external_writer_takes_the_arrays_a_slot_would_hold(owner, monkeypatch):
    store = ExternalStore()
    monkeypatch.setitem(shm_module.EXTERNAL_WRITERS, "p", store)
    monkeypatch.setitem(shm_module.EXTERNAL_SEGMENTS, "ext:", store)
    arena = Arena(owner.create("p", 1 << 22))
    producer = ArrayCodec("p", arena, threshold=1024)
    big = np.arange(4096, dtype=np.int32).reshape(64, 64)
    handles = producer.pack({"big": big, "small": np.arange(3)}, {"r": 1})
    assert handles["big"].segment == "ext:0" and handles["big"].offset == 0
    assert type(handles["small"]).__name__ == "InlineArray"  # below the threshold: inline
    assert arena.slots_in_use == 0  # no slot was rented for it
    arrays, _ = ArrayCodec("r").unpack(handles)
    assert np.array_equal(arrays["big"], big) and arrays["big"].dtype == np.int32
    # a writer that declines: a slot, as without one
    assert producer.pack({"big": big}, {"q": 1})["big"].segment == arena.name
    # the message fails to pack after the writer took an array: the writer lets it go
    with pytest.raises(TypeError):
        producer.pack({"big": big, "bad": [1, 2]}, {"r": 1})
    assert store.cancelled == [("ext:1", {"r": 1})] and list(store.objects) == ["ext:0"]


def test_codec_rejects_object_arrays():
    with pytest.raises(TypeError, match="Python objects"):
        ArrayCodec("p").pack({"x": np.array([object()])}, {})
    with pytest.raises(TypeError, match="numpy array"):
        ArrayCodec("p").pack({"x": [1, 2]}, {})


def test_codec_torch_tensors(owner):
    torch = pytest.importorskip(
        "torch", reason="needs torch, which omni-core does not bring (runs in the workspace)"
    )
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


def test_reader_views_are_read_only_and_the_mapping_refuses_writes(owner):
    arena = Arena(owner.create("p", 1 << 20))
    producer = ArrayCodec("p", arena, threshold=1024)
    reader = ArrayCodec("r")
    data = np.arange(4096, dtype=np.float32)
    handles = producer.pack({"a": data, "b": data.tobytes()}, {"r": 1, "s": 1})
    arrays, _ = reader.unpack(handles)
    for view in (arrays["a"], arrays["b"]):
        assert not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1
        with pytest.raises(ValueError):
            view.flags.writeable = True  # its buffer is read-only: no way back
    buf = reader.reader.buffer(handles["a"].segment)
    with pytest.raises(TypeError):  # mapped PROT_READ
        buf[handles["a"].offset] = 0
    with pytest.raises(TypeError):
        buf.write(b"x")
    assert np.array_equal(arrays["a"], data)


def test_a_torch_tensor_handed_to_a_stage_cannot_corrupt_the_slot(owner):
    torch = pytest.importorskip(
        "torch", reason="needs torch, which omni-core does not bring (runs in the workspace)"
    )
    arena = Arena(owner.create("p", 1 << 20))
    producer = ArrayCodec("p", arena, threshold=1024)
    t = torch.arange(8192, dtype=torch.float32)
    handles = producer.pack({"t": t}, {"r": 1, "s": 1})  # fan-out: two readers share it
    h = handles["t"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable NumPy array" warning
        mine, _ = ArrayCodec("r").unpack(handles)
    mine["t"].mul_(-1)  # the stage scribbles on what it was given
    mine["t"][0] = 12345.0
    slot = np.frombuffer(arena.buf, dtype=np.float32, count=8192, offset=h.offset)
    assert np.array_equal(slot, t.numpy())  # the producer's slot is intact
    peer, _ = ArrayCodec("s").unpack(handles)
    assert torch.equal(peer["t"], t)  # and so is what the fan-out peer reads
