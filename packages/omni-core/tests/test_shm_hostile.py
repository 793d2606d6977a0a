"""Segment names and spans from the wire are not trusted.

A handle names a segment and a span of it; a reader maps only a name this runtime makes
(of its own pipeline, of the handle's producer), opened without following a link or
blocking, a private regular file of this user, and a span inside it. Anything else fails
the one request the message belongs to, quickly, with an error naming the segment, and
the stage keeps serving. A segment name found taken at creation is retried under another.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from omni_core import Pipeline
from omni_core.dataplane.serial import ArrayCodec, encode_frame
from omni_core.dataplane.shm import (
    SHM_DIR,
    Arena,
    BadSegment,
    SegmentOwner,
    SegmentReader,
    owner_prefix,
)
from omni_core.events import Segment, ShmHandle
from omni_testing.configs import chain
from omni_testing.hostile import (
    PlantedSegments,
    hostile_segment_names,
    push_frames,
    squatted_segment_names,
)


@pytest.fixture
def owner() -> Iterator[SegmentOwner]:
    o = SegmentOwner()
    yield o
    o.unlink_all()


def unpack_in_thread(codec: ArrayCodec, handle: ShmHandle) -> BaseException | None:
    """Unpack ``handle`` in a thread that must finish within 2 s (a FIFO must not hang)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            codec.unpack({"x": handle})
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(2.0)
    assert not t.is_alive(), f"unpacking {handle.segment!r} hangs"
    return out[0]


def test_hostile_segment_names_are_refused_quickly_naming_the_segment(owner):
    seg = owner.create("p", 1 << 16)
    prefix = owner_prefix(seg)
    planted = PlantedSegments(prefix, "p")
    try:
        codec = ArrayCodec("r", reader=SegmentReader(scope=prefix))
        for case, name in hostile_segment_names(planted).items():
            t0 = time.monotonic()
            err = unpack_in_thread(codec, ShmHandle(name, 0, 16, "|u1", (16,), "p", 1))
            assert time.monotonic() - t0 < 1.0, case
            if case == "missing":
                assert isinstance(err, FileNotFoundError), (case, err)
                continue
            assert isinstance(err, BadSegment), (case, err)
            assert repr(name[:255]) in str(err), (case, str(err))
        # the real segment still reads
        arrays, _ = codec.unpack({"x": ShmHandle(seg, 64, 16, "|u1", (16,), "p", 1)})
        assert arrays["x"].tolist() == [0] * 16
    finally:
        planted.remove()


@pytest.mark.parametrize(
    ("offset", "nbytes", "producer", "why"),
    [
        ((1 << 16) - 8, 16, "p", "outside"),  # runs past the end
        (1 << 20, 1, "p", "outside"),  # starts past the end
        (-64, 16, "p", "outside"),
        (0, -1, "p", "outside"),  # "count=-1" would read to the end
        (0, 16, "q", "not a segment of its producer 'q'"),
    ],
)
def test_a_span_outside_the_segment_or_another_producers_segment_is_refused(
    owner, offset, nbytes, producer, why
):
    seg = owner.create("p", 1 << 16)
    codec = ArrayCodec("r", reader=SegmentReader(scope=owner_prefix(seg)))
    with pytest.raises(BadSegment, match=why) as e:
        codec.unpack({"x": ShmHandle(seg, offset, nbytes, "|u1", (max(nbytes, 0),), producer, 1)})
    assert seg in str(e.value)


def test_another_pipelines_segment_is_out_of_scope(owner):
    mine = owner.create("p", 4096)
    other = SegmentOwner()
    try:
        theirs = other.create("p", 4096)
        codec = ArrayCodec("r", reader=SegmentReader(scope=owner_prefix(mine)))
        with pytest.raises(BadSegment, match="not a segment of this pipeline"):
            codec.unpack({"x": ShmHandle(theirs, 0, 16, "|u1", (16,), "p", 1)})
    finally:
        other.unlink_all()


def test_names_carry_fresh_randomness(owner):
    a, b = owner.create("p", 4096), owner.create("p", 4096)
    ra, rb = a.rsplit("-", 1)[1], b.rsplit("-", 1)[1]
    assert len(ra) == 16 and ra != rb
    with pytest.raises(ValueError, match="not a worker name"):
        owner.create("../x", 4096)


def test_a_taken_name_is_retried_under_another(owner, caplog):
    with squatted_segment_names("p", times=3) as squatted:
        name = owner.create("p", 4096)
        assert len(squatted) == 3 and os.path.join(SHM_DIR, name) not in squatted
        Arena(name).close()  # a segment like any other
        for path in squatted:  # left as they were
            with open(path, "rb") as f:
                assert f.read() == b"squatted"
        assert sum("is taken" in r.getMessage() for r in caplog.records) == 3


# ---------------------------------------------------------------------- a live pipeline
SLOW_SRC = chain(
    ("src", "synthetic.sleep", {"hold_s": 0.3}),
    ("sink", "synthetic.array_sink", {}),
    heartbeat_interval_s=0.1,
)


def forged(rid: str, name: str, producer: str = "src", offset: int = 0, nbytes: int = 16) -> Any:
    handle = ShmHandle(name, offset, nbytes, "|u1", (max(nbytes, 0),), producer, 1)
    return Segment(request_id=rid, sequence=0, stage="src", device_handles={"data": handle})


def test_a_pipeline_refuses_hostile_frames_and_keeps_serving():
    """Each hostile handle is pushed into the sink's data socket as the first event of a
    request in flight (src holds it): that request fails naming the segment; the sink is
    not restarted and later requests complete. The sink's own segment was squatted at
    start: the stage started anyway."""
    planted: PlantedSegments | None = None
    try:
        with squatted_segment_names("sink") as squatted, Pipeline(SLOW_SRC) as pipe:
            assert len(squatted) == 1 and pipe.health()["sink"]["state"] == "ready"
            assert pipe.generate([{}], timeout_s=20)[0].ok
            segments = pipe.backend.launcher.segments.names
            src_arena = next(n for n in segments if "-src-" in n)
            planted = PlantedSegments(owner_prefix(src_arena), "src")
            cases = hostile_segment_names(planted)
            messages = {case: forged(f"attack-{case}", name) for case, name in cases.items()}
            messages["past_end"] = forged("attack-past_end", src_arena, offset=(1 << 40))
            messages["foreign_producer"] = forged("attack-foreign", src_arena, producer="other")
            sink_pid = pipe.pids()["sink"]
            handles = {
                c: pipe.submit({}, request_id=m.request_id, timeout_s=20)
                for c, m in messages.items()
            }
            push_frames(
                pipe.backend.addr.data("sink"), *(encode_frame([m]) for m in messages.values())
            )
            for case, h in handles.items():
                events = list(h)
                last = events[-1]
                assert last.event_type == "error", (case, last)
                segment = messages[case].device_handles["data"].segment
                assert segment[:60] in last.message, (case, last.message)
            outs = pipe.generate([{} for _ in range(3)], timeout_s=20)
            assert [o.ok for o in outs] == [True] * 3, [o.error for o in outs]
            assert pipe.pids()["sink"] == sink_pid  # never restarted
            assert pipe.healthy
    finally:
        if planted is not None:
            planted.remove()


def test_a_result_naming_another_pipelines_segment_is_refused():
    """A result pushed onto the orchestrator's results socket may name only this
    pipeline's segments: a valid, private segment of another owner (planted here) fails
    just that request, naming it; the pipeline serves on."""
    planted = PlantedSegments(f"omni-{os.getpid()}-0ther0wner-", "sink")
    try:
        with Pipeline(SLOW_SRC) as pipe:
            assert pipe.generate([{}], timeout_s=20)[0].ok
            name = planted.file()
            h = pipe.submit({}, request_id="attack-result", timeout_s=20)
            bad = forged("attack-result", name, producer="sink")
            bad.stage = "sink"
            push_frames(pipe.backend.addr.results, encode_frame([bad]))
            last = list(h)[-1]
            assert last.event_type == "error" and name[:60] in last.message, last
            assert "not a segment of this pipeline" in last.message, last.message
            outs = pipe.generate([{} for _ in range(3)], timeout_s=20)
            assert [o.ok for o in outs] == [True] * 3, [o.error for o in outs]
            assert pipe.healthy
    finally:
        planted.remove()


def test_a_real_array_still_goes_through_the_checks(owner):
    arena = Arena(owner.create("p", 1 << 20))
    producer = ArrayCodec("p", arena, threshold=1024)
    handles = producer.pack({"x": np.arange(4096, dtype=np.int32)}, {"r": 1})
    arrays, shm = ArrayCodec("r", reader=SegmentReader(scope=owner_prefix(arena.name))).unpack(
        handles
    )
    assert arrays["x"].tolist() == list(range(4096)) and len(shm) == 1
    arena.close()
