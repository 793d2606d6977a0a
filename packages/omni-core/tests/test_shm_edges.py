"""The shared-memory data plane at its edges: the slot allocator's free list (where a freed
slot joins its neighbours, how much room a payload takes), release accounting, and the
limits on names, spans, modes and sizes of the segments a reader maps."""

import errno
import os
import threading
from pathlib import Path

import pytest
from omni_core.dataplane import shm as shm_module
from omni_core.dataplane.shm import (
    ALIGN,
    NAME_MAX,
    Arena,
    BadSegment,
    SegmentOwner,
    ShmPoolExhausted,
    check_segment_name,
    check_span,
    create_locked,
    list_segments,
    map_segment,
    sweep_stale,
)


@pytest.fixture
def owner(tmp_path):
    o = SegmentOwner(str(tmp_path))
    yield o
    o.unlink_all()


def _arena(owner: SegmentOwner, slots: int) -> Arena:
    """An arena of ``slots`` * ALIGN bytes."""
    return Arena(owner.create("a", slots * ALIGN), owner.directory)


def _fits_now(arena: Arena, nbytes: int) -> int | None:
    """The offset a rent of ``nbytes`` gets without waiting; None when it would wait."""
    try:
        return arena.rent(nbytes, {"r": 1}, timeout=0)[0]
    except ShmPoolExhausted:
        return None


# -- the free list ---------------------------------------------------------------------
def test_a_slot_freed_between_two_free_ranges_joins_both(owner):
    arena = _arena(owner, 8)
    a = arena.rent(ALIGN, {"r": 1})
    b = arena.rent(ALIGN, {"r": 1})
    c = arena.rent(2 * ALIGN, {"r": 1})
    arena.rent(4 * ALIGN, {"r": 1})  # the rest stays held
    arena.release([a], "r")
    arena.release([c], "r")  # free: [0, 64) and [128, 256)
    assert _fits_now(arena, 3 * ALIGN) is None  # no range of 192 yet
    arena.release([b], "r")  # joins the range after it, then the one before
    assert _fits_now(arena, 4 * ALIGN + 1) is None
    assert _fits_now(arena, 4 * ALIGN) == 0


def test_a_slot_freed_after_a_free_range_that_does_not_touch_it_stays_apart(owner):
    arena = _arena(owner, 4)
    slots = [arena.rent(ALIGN, {"r": 1}) for _ in range(4)]
    arena.release([slots[0]], "r")
    arena.release([slots[2]], "r")  # [0, 64) and [128, 192): slot 1 lies between
    assert _fits_now(arena, 2 * ALIGN) is None
    arena.release([slots[3]], "r")  # joins [128, 192) only
    assert _fits_now(arena, 2 * ALIGN) == 2 * ALIGN
    assert _fits_now(arena, ALIGN) == 0


def test_a_slot_freed_before_a_free_range_joins_it(owner):
    arena = _arena(owner, 4)
    slots = [arena.rent(ALIGN, {"r": 1}) for _ in range(4)]
    arena.release([slots[3]], "r")
    arena.release([slots[2]], "r")
    arena.release([slots[1]], "r")
    assert _fits_now(arena, 3 * ALIGN) == ALIGN
    assert arena.bytes_free == 0  # slot 0 is still held


def test_slots_released_in_every_position_of_a_long_free_list(owner):
    """Five free ranges, each release searched for among them; all end as one range."""
    arena = _arena(owner, 10)
    slots = [arena.rent(ALIGN, {"r": 1}) for _ in range(10)]
    for i in (0, 2, 4, 6, 8):
        arena.release([slots[i]], "r")
    for i in (7, 3, 9, 1, 5):
        arena.release([slots[i]], "r")
    assert _fits_now(arena, 10 * ALIGN) == 0


@pytest.mark.parametrize(
    ("nbytes", "room"),
    [(0, ALIGN), (1, ALIGN), (ALIGN - 1, ALIGN), (ALIGN, ALIGN), (ALIGN + 1, 2 * ALIGN)],
)
def test_a_payload_takes_whole_aligned_units(owner, nbytes, room):
    arena = _arena(owner, 4)
    assert arena.rent(nbytes, {"r": 1})[0] == 0
    assert arena.rent(1, {"r": 1})[0] == room
    assert arena.bytes_free == 4 * ALIGN - room - ALIGN


# -- waiting ---------------------------------------------------------------------------
def test_a_zero_timeout_fails_at_once_and_counts_the_wait(owner):
    arena = _arena(owner, 1)
    arena.rent(1, {"r": 1})
    assert arena.blocked_s == 0
    with pytest.raises(ShmPoolExhausted, match="within 0s"):
        arena.rent(1, {"r": 1}, timeout=0)
    assert 0 <= arena.blocked_s < 0.5


def test_a_rent_waits_for_a_release_within_its_timeout(owner):
    arena = _arena(owner, 1)
    held = arena.rent(ALIGN, {"r": 1})
    release = threading.Thread(target=arena.release, args=([held], "r"))
    # holding the arena's lock, the release can run only once the rent waits
    with arena._cond:
        release.start()
        assert arena.rent(ALIGN, {"r": 1}, timeout=1.0)[0] == 0
    release.join()
    assert 0 < arena.blocked_s < 1.0


# -- release accounting ----------------------------------------------------------------
def test_a_reader_counted_twice_frees_the_slot_on_its_second_release(owner):
    arena = _arena(owner, 1)
    slot = arena.rent(1, {"r": 2})
    arena.release([slot], "r")
    assert arena.slots_in_use == 1 and _fits_now(arena, 1) is None
    arena.release([slot], "r")
    assert arena.slots_in_use == 0 and arena.unknown_releases == 0


def test_readers_counted_zero_hold_nothing(owner):
    arena = _arena(owner, 2)
    slot = arena.rent(1, {"r": 1, "none": 0})
    arena.release([slot], "r")
    assert arena.slots_in_use == 0
    arena.rent(1, {"none": 0})  # nobody reads it: free at once
    assert arena.slots_in_use == 0 and arena.bytes_free == 2 * ALIGN


def test_unknown_and_stale_releases_are_counted_and_the_rest_applied(owner):
    arena = _arena(owner, 2)
    first = arena.rent(ALIGN, {"r": 1})
    arena.release([first], "r")
    second = arena.rent(ALIGN, {"r": 1})  # same offset, a later rental
    other = arena.rent(ALIGN, {"r": 1, "s": 1})
    arena.release([first, (999, 1), other], "r")
    arena.release([second], "stranger")
    assert arena.unknown_releases == 3
    assert arena.slots_in_use == 2  # second (r), other (s)
    arena.release([other], "s")
    arena.release([second], "r")
    assert arena.slots_in_use == 0


def test_cancel_of_an_unknown_or_stale_slot_does_nothing(owner):
    arena = _arena(owner, 1)
    first = arena.rent(1, {"r": 1})
    arena.release([first], "r")
    second = arena.rent(1, {"r": 1})
    arena.cancel((5 * ALIGN, 1))
    arena.cancel(first)
    assert arena.slots_in_use == 1
    arena.cancel(second)
    assert arena.slots_in_use == 0


def test_closing_an_arena_with_a_live_view_does_not_raise(owner):
    arena = _arena(owner, 1)
    view = memoryview(arena.buf)
    arena.close()
    view.release()


# -- names, spans, modes, sizes --------------------------------------------------------
def _name_of_length(n: int) -> str:
    head, tail = "omni-1-tok-", "-0-" + "0" * 16
    return head + "x" * (n - len(head) - len(tail)) + tail


def test_a_name_of_name_max_characters_is_checked_one_more_is_refused():
    assert check_segment_name(_name_of_length(NAME_MAX))
    with pytest.raises(BadSegment):
        check_segment_name(_name_of_length(NAME_MAX + 1))
    assert os.pathconf("/dev/shm", "PC_NAME_MAX") == NAME_MAX


def test_a_span_may_end_at_the_segment_end_not_one_past():
    check_span("s", 0, 0, 10)
    check_span("s", 10, 0, 10)
    check_span("s", 0, 10, 10)
    for offset, nbytes in [(-1, 1), (11, 0), (10, 1), (0, 11), (1, -1)]:
        with pytest.raises(BadSegment, match="outside"):
            check_span("s", offset, nbytes, 10)


def _file(directory, mode: int, size: int) -> str:
    name = f"omni-{os.getpid()}-tok-x-0-{'0' * 16}"
    path = directory / name
    path.write_bytes(b"x" * size)
    path.chmod(mode)
    return name


def test_a_one_byte_private_segment_maps(tmp_path):
    name = _file(tmp_path, 0o600, 1)
    assert len(map_segment(name, str(tmp_path), readonly=True)) == 1


def test_an_empty_segment_is_refused(tmp_path):
    name = _file(tmp_path, 0o600, 0)
    with pytest.raises(BadSegment, match="empty"):
        map_segment(name, str(tmp_path), readonly=True)


@pytest.mark.parametrize("mode", [0o601, 0o610, 0o640, 0o604])
def test_a_segment_others_may_reach_is_neither_mapped_nor_swept(tmp_path, mode):
    name = _file(tmp_path, mode, 8)
    with pytest.raises(BadSegment, match="not private"):
        map_segment(name, str(tmp_path), readonly=True)
    assert sweep_stale(str(tmp_path)) == []
    assert os.path.exists(tmp_path / name)


def test_a_link_is_refused_with_the_reason(tmp_path):
    target = _file(tmp_path, 0o600, 8)
    link = f"omni-{os.getpid()}-tok-y-0-{'0' * 16}"
    os.symlink(tmp_path / target, tmp_path / link)
    with pytest.raises(BadSegment) as e:
        map_segment(link, str(tmp_path), readonly=True)
    assert str(e.value).endswith(f"cannot be opened: {os.strerror(errno.ELOOP)}")


def test_the_sweep_goes_on_past_a_name_not_ours(tmp_path, monkeypatch):
    stale = _file(tmp_path, 0o600, 8)
    (tmp_path / "other").write_bytes(b"x")
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d: ["other", *real(d)])
    assert sweep_stale(str(tmp_path)) == [stale]


def test_the_sweep_goes_on_past_a_live_segment_to_an_orphan_after_it(owner, monkeypatch):
    """A live pipeline's segment (its owner holds the lock) listed first: left in place,
    and the dead owner's segment listed after it is still removed."""
    live = owner.create("a", 8)
    owner_dir = Path(owner.directory)
    orphan = _file(owner_dir, 0o600, 8)
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d: sorted(real(d), key=lambda n: n != live))
    assert os.listdir(owner.directory)[0] == live
    assert sweep_stale(owner.directory) == [orphan]
    assert os.path.exists(owner_dir / live)
    assert not os.path.exists(owner_dir / orphan)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_sweep_past_live_and_vanished_segments_leaves_no_file_open(owner, monkeypatch):
    """A live owner's segment (its lock taken: opened, then let go) and a name gone
    before it was looked at (never opened) are both skipped, and neither leaves a file
    descriptor behind, however many sweeps run."""
    live = owner.create("a", 8)
    real = os.listdir
    gone = f"omni-{os.getpid()}-tok-x-0-{'1' * 16}"
    monkeypatch.setattr(
        os, "listdir", lambda d: [gone, *real(d)] if d == owner.directory else real(d)
    )
    before = _open_fds()
    for _ in range(3):
        assert sweep_stale(owner.directory) == []
    assert _open_fds() == before
    assert os.path.exists(os.path.join(owner.directory, live))


def test_list_segments_of_one_owner_or_all(tmp_path):
    ours = _file(tmp_path, 0o600, 1)
    theirs = "omni-1-tok-x-0"
    (tmp_path / theirs).write_bytes(b"x")
    (tmp_path / "other").write_bytes(b"x")
    assert list_segments(directory=str(tmp_path)) == sorted([ours, theirs])
    assert list_segments(os.getpid(), str(tmp_path)) == [ours]
    assert list_segments(directory=str(tmp_path / "gone")) == []


# -- the owner -------------------------------------------------------------------------
def test_create_locked_in_a_directory_gone_is_none(tmp_path):
    assert create_locked(str(tmp_path / "gone" / "x")) is None


def test_when_every_name_is_taken_the_error_counts_the_tries(owner, monkeypatch):
    tries = []

    def taken(path, mode=0o600):
        tries.append(path)
        raise FileExistsError(path)

    monkeypatch.setattr(shm_module, "create_locked", taken)
    with pytest.raises(OSError, match="names tried") as e:
        owner.create("x", 4096)
    assert f"{len(tries)} names tried ({len(tries)} taken" in str(e.value)
    assert len(set(tries)) == len(tries) > 1


def test_a_segment_that_cannot_be_sized_is_removed(owner, monkeypatch, tmp_path):
    def refuse(fd, size):
        raise OSError(errno.ENOSPC, "no space")

    monkeypatch.setattr(os, "ftruncate", refuse)
    with pytest.raises(OSError, match="no space"):
        owner.create("x", 4096)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [] and owner.names == []


def test_unlink_of_a_segment_gone_or_never_made(owner, tmp_path):
    name = owner.create("x", 4096)
    os.unlink(tmp_path / name)
    owner.unlink(name)
    owner.unlink("omni-1-tok-x-9-" + "0" * 16)
    assert owner.names == []


def test_create_locked_of_a_file_swept_before_its_lock_is_none(tmp_path, monkeypatch):
    """A sweeper of another process removed the new file before this one locked it: the
    caller retries under another name, and the fd is closed."""
    path = str(tmp_path / "x")
    real = shm_module.fcntl.flock

    def swept_first(fd, op):
        os.unlink(path)
        real(fd, op)

    monkeypatch.setattr(shm_module.fcntl, "flock", swept_first)
    fds = os.listdir("/proc/self/fd")
    assert create_locked(path) is None
    assert os.listdir("/proc/self/fd") == fds


def test_create_locked_closes_its_fd_when_the_lock_fails(tmp_path, monkeypatch):
    def interrupted(fd, op):
        raise KeyboardInterrupt

    monkeypatch.setattr(shm_module.fcntl, "flock", interrupted)
    fds = os.listdir("/proc/self/fd")
    with pytest.raises(KeyboardInterrupt):
        create_locked(str(tmp_path / "x"))
    assert os.listdir("/proc/self/fd") == fds
