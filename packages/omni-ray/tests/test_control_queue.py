"""The Ray Client actor's event queue: each request's events wait in its own inbox, merged
as the caller's own inbox would merge them when the caller polls slower than the stages
produce, so what waits is bounded by the requests' output, not by their event count."""

import numpy as np
from omni_core.events import Completed, Segment
from omni_ray.control_actor import EventQueue, ForwardInbox


def seg(rid: str, i: int, **kw) -> Segment:
    ev = Segment(request_id=rid, stage="decode", tokens=[i], payload={"text": f"t{i}"}, **kw)
    ev.arrays = {}
    return ev


def test_a_lagging_poller_gets_the_same_stream_in_fewer_events():
    queue = EventQueue()
    a, b = ForwardInbox(queue), ForwardInbox(queue)
    for i in range(500):
        a.put(seg("a", i))
        b.put(seg("b", i))
    done = Completed(request_id="a", stage="decode")
    done.arrays = {}
    a.put(done)
    assert len(a) <= 66 and len(b) <= 65  # merged past 64 waiting: memory stays bounded
    events = queue.take(0.0)
    assert not queue.waiting and queue.take(0.0) == []
    for rid in ("a", "b"):
        mine = [e for e in events if e.request_id == rid]
        tokens = [t for e in mine if isinstance(e, Segment) for t in e.tokens]
        assert tokens == list(range(500))  # every token, in order
        text = "".join(e.payload["text"] for e in mine if isinstance(e, Segment))
        assert text == "".join(f"t{i}" for i in range(500))
        assert [e.sequence for e in mine] == list(range(len(mine)))  # dense numbers
    assert isinstance([e for e in events if e.request_id == "a"][-1], Completed)


def test_arrays_leave_as_flat_arrays_beside_the_events_and_a_poll_is_bounded():
    queue = EventQueue()
    inbox = ForwardInbox(queue)
    for i in range(3):
        ev = Segment(request_id="r", stage="vae")
        ev.arrays = {"image": np.full((4, 1 << 18), i, np.float32)}  # 4 MiB each
        inbox.put(ev)
    first = queue.take(0.0, max_bytes=6 << 20)  # the first two (the second crosses it)
    rest = queue.take(0.0, max_bytes=6 << 20)
    assert [len(first), len(rest)] == [2, 1] and not queue.waiting
    for i, ev in enumerate(first + rest):
        h, flat = ev.device_handles["image"], ev.flat["image"]
        assert (h.dtype, h.shape, h.data) == ("<f4", (4, 1 << 18), b"")
        assert flat.dtype == np.uint8 and flat.view(np.float32)[0] == i
