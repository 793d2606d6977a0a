"""The Sender: frames per destination, runs in columns, counts, a full socket."""

import zmq
from omni_core.dataplane.serial import decode_data_frame, decode_event_frame
from omni_core.dataplane.transport import Sender, Waker, pull_socket, push_socket
from omni_core.events import Error, Segment, SegmentRun


def seg(i, **kw):
    return Segment(request_id="r", sequence=i, stage="s", tokens=[i], payload={"i": i}, **kw)


def make(tmp_path, names, hwm=1000):
    ctx = zmq.Context()
    pulls = {n: pull_socket(ctx, f"ipc://{tmp_path}/{n}", 1000) for n in names}
    pushes = {n: push_socket(ctx, f"ipc://{tmp_path}/{n}", hwm) for n in names}
    return ctx, pulls, pushes


def frames(sock):
    out = []
    while sock.poll(500):
        out.append(sock.recv())
    return out


def test_one_run_fanned_out_reaches_every_destination_and_is_counted_once_per_event(tmp_path):
    ctx, pulls, pushes = make(tmp_path, ["a", "b"])
    bad = []
    sender = Sender(  # gap_s: nothing leaves before a flush
        pushes,
        Waker(),
        gap_s=1e9,
        on_unencodable=lambda m, e, d: bad.append(d) or Error(request_id="r"),
    )
    run = SegmentRun.of([seg(i) for i in range(5)], "s", 0)
    for d in ("a", "b"):
        sender.put_many(d, [run], 5)
    for d in ("a", "b"):
        sender.put(d, seg(5))
    assert sender.waiting == 12 and sender.counts == {"a": 6, "b": 6}
    sender.flush()
    assert sender.waiting == 0 and sender.sent == 12 and sender.must == {"a": 0, "b": 0}
    # a second, shorter frame through the reused buffer: no bytes of the first one left
    sender.put_many("a", [seg(6)], 1)
    sender.flush()
    for d in ("a", "b"):
        got = [m for f in frames(pulls[d]) for m in decode_event_frame(f)]
        assert [m.sequence for m in got] == list(range(7 if d == "a" else 6))
    # an event that cannot be encoded: its run is replaced (the request fails), the rest go
    sender.put_many("a", [SegmentRun.of([seg(7), seg(8, logprobs=[object()])], "s", 7)], 2)
    sender.put("a", seg(9))
    sender.flush()
    (frame,) = frames(pulls["a"])
    assert [type(m).__name__ for m in decode_data_frame(frame)] == ["Error", "Segment"]
    assert bad == ["a"] and sender.waiting == 0
    ctx.destroy(linger=0)


def test_a_frame_a_full_socket_refuses_waits_and_goes_first(tmp_path):
    ctx = zmq.Context()
    push = push_socket(ctx, f"ipc://{tmp_path}/x", hwm=1)
    push.setsockopt(zmq.SNDBUF, 4096)
    sender = Sender({"x": push}, Waker(), gap_s=1e9)
    blob = b"x" * 65536
    n = 0
    while "x" not in sender.stalled:  # nobody reads: the socket fills up
        sender.put("x", Segment(request_id="r", sequence=n, stage="s", payload={"b": blob}))
        sender.flush()
        n += 1
        assert n < 1000
    assert isinstance(sender.stalled["x"], bytes)  # a copy: the buffer is reused
    sender.put_many("x", [seg(n)], 1)
    pull = pull_socket(ctx, f"ipc://{tmp_path}/x", 1000)
    got = []
    while len(got) < n + 1:
        sender.flush()
        if pull.poll(200):
            got += decode_data_frame(pull.recv())
    assert [m.sequence for m in got] == list(range(n + 1))
    ctx.destroy(linger=0)
