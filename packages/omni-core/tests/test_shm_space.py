"""A full ``/dev/shm`` fails the request that needed the room, never the producer: a
segment is sparse, and its arena gives a slot its pages (``posix_fallocate``) before the
slot is written, so where tmpfs has no page left the write is a
:class:`ShmSpaceExhausted` naming the segment, its size and the free space, not a SIGBUS.
On a real tmpfs of 4 MiB (mounted here when this user may) and with ``posix_fallocate``
made to fail."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from omni_core.dataplane.shm import Arena, SegmentOwner, ShmPoolExhausted, ShmSpaceExhausted

MIB = 1 << 20
TINY = 4 * MIB  # the tmpfs
SEGMENT = 16 * MIB  # the segment made in it: sparse, four times its room

# in a child process: on a producer that SIGBUSes, the test fails instead of pytest dying
FILL = """
import json, sys
import numpy as np
from omni_core.dataplane.serial import ArrayCodec
from omni_core.dataplane.shm import Arena, SegmentOwner, ShmSpaceExhausted
d, size = sys.argv[1], int(sys.argv[2])
owner = SegmentOwner(d)
arena = Arena(owner.create("w", size), d)
codec = ArrayCodec("w", arena)
held, error = [], None
for i in range(size >> 20):
    try:
        held.append(codec.pack({"x": np.full(1 << 20, i + 1, np.uint8)}, {"r": 1})["x"])
    except ShmSpaceExhausted as e:
        error = str(e)
        break
intact = all((np.frombuffer(arena.buf, np.uint8, h.nbytes, h.offset) == i + 1).all()
             for i, h in enumerate(held))
slots = arena.slots_in_use
arena.release([(held[-1].offset, held[-1].rental)], "r")  # room again: the next one fits
again = codec.pack({"x": np.full(1 << 20, 7, np.uint8)}, {"r": 1})["x"].offset
print(json.dumps({"name": arena.name, "packed": len(held), "error": error, "intact": intact,
                  "slots": slots, "again": again, "freed": held[-1].offset}))
"""


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[str]:
    where = tmp_path / "shm"
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TINY},mode=1777", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_tmpfs_fails_the_write_that_needed_room_not_the_producer(tiny_tmpfs, caplog):
    r = subprocess.run(
        [sys.executable, "-c", FILL, tiny_tmpfs, str(SEGMENT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, (r.returncode, r.stderr)  # -7: SIGBUS
    got = json.loads(r.stdout)
    # as many 1 MiB slots as the tmpfs holds, then the clear error; the others intact
    assert 2 <= got["packed"] <= TINY // MIB and got["intact"], got
    assert got["slots"] == got["packed"]  # the failed write's slot went back
    error = got["error"]
    assert f"'{got['name']}'" in error and f"({SEGMENT} bytes)" in error, error
    assert "bytes free in" in error and tiny_tmpfs in error, error
    assert got["again"] == got["freed"]  # its pages were given once: reused
    # and the segment's creation said it was bigger than the room
    with caplog.at_level(logging.WARNING, logger="omni.shm"):
        owner = SegmentOwner(tiny_tmpfs)
        owner.create("v", SEGMENT)
        owner.unlink_all()
    (said,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"is {SEGMENT} bytes" in said and "free in" in said, said


def test_a_segment_that_cannot_be_backed_is_an_error_naming_it(tmp_path, monkeypatch):
    owner = SegmentOwner(str(tmp_path))
    arena = Arena(owner.create("w", 4 * MIB), str(tmp_path))
    try:
        off, rental = arena.rent(MIB, {"r": 1})  # backed: the first MiB
        assert off == 0

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "posix_fallocate", full)
        free = arena.bytes_free
        with pytest.raises(ShmSpaceExhausted) as e:
            arena.rent(MIB, {"r": 1})
        assert isinstance(e.value, ShmPoolExhausted)  # fails its request as a full pool does
        said = str(e.value)
        assert arena.name in said and f"({4 * MIB} bytes)" in said, said
        assert "No space left on device" in said and "bytes free in" in said, said
        assert arena.bytes_free == free and arena.slots_in_use == 1  # nothing kept
        # a slot inside what is already backed needs no new page
        arena.release([(0, rental)], "r")
        assert arena.rent(MIB, {"r": 1})[0] == 0
    finally:
        arena.close()
        owner.unlink_all()


# a pipeline whose /dev/shm (a private mount namespace's) is 8 MiB, its pool 64 MiB
PIPELINE = """
import json
from omni_core import Pipeline
from omni_testing.configs import chain
cfg = chain(("src", "synthetic.array_source", {}), ("sink", "synthetic.array_sink", {}),
            name="tight", shm_pool_bytes=64 << 20, heartbeat_interval_s=0.1)
with Pipeline(cfg) as pipe:
    pids = pipe.pids()
    outs = pipe.generate([{"nbytes": 1 << 20}, {"nbytes": 16 << 20}, {"nbytes": 1 << 20}],
                         timeout_s=60)
    print(json.dumps({"ok": [o.ok for o in outs], "errors": [o.error for o in outs],
                      "same_pids": pipe.pids() == pids, "healthy": pipe.healthy}))
"""


def test_a_pipeline_on_a_full_dev_shm_fails_only_the_request_that_needed_room():
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs over /dev/shm takes root")
    script = f'mount -t tmpfs -o size={2 * TINY},mode=1777 tmpfs /dev/shm && exec "$0" -c "$1"'
    r = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, PIPELINE],
        capture_output=True,
        text=True,
        timeout=180,
    )
    if r.returncode != 0 and "unshare" in r.stderr and "Operation not permitted" in r.stderr:
        pytest.skip(f"no mount namespace here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["ok"] == [True, False, True], got
    assert "ShmSpaceExhausted" in got["errors"][1] and "bytes free in /dev/shm" in got["errors"][1]
    assert got["same_pids"] and got["healthy"], got  # no producer died
