"""The gateway's forwarding threads never die silently: a frame or message they cannot
handle is logged and dropped (its slots released, its request failed) and what follows
still goes through; a thread that cannot go on is reported by ``failure()``.

The first tests drive a :class:`NodeGateway` in this process (its calls to other nodes'
gateways replaced by a recorder); the last one a real pipeline on a simulated cluster."""

import logging
import mmap
import os
import queue
import time
import uuid

import pytest
import zmq
from omni_core.dataplane.serial import decode_control_frame, decode_event_frame, encode_frame
from omni_core.dataplane.shm import SHM_DIR
from omni_core.dataplane.transport import RESULTS, Addresses, push_socket
from omni_core.events import Error, InlineArray, Release, Segment, ShmHandle
from omni_ray import gateway as gateway_module
from omni_ray.gateway import GATEWAY_ERROR, NodeGateway
from omni_ray.grants import Grants
from omni_ray.objects import segment_name
from omni_ray.testing import FakeRef

HERE, THERE, HEAD = "node-here", "node-there", "node-head"
GARBAGE = b"garbage with \xa3shm in it"  # carries the shm tag: the gateway decodes it


class Recorder:
    """Stands in for the other nodes' gateways: every delivery, by endpoint."""

    def __init__(self) -> None:
        self.calls: queue.Queue = queue.Queue()
        self.by_endpoint: dict[str, list[bytes]] = {}
        self.fail_next: set[str] = set()  # endpoints whose next delivery raises

    def __call__(self, node: str, endpoint: str, frames: list[bytes], refs=None) -> bool:
        if endpoint in self.fail_next:
            self.fail_next.discard(endpoint)
            raise RuntimeError(f"synthetic delivery failure to {endpoint}")
        expected = HEAD if endpoint == RESULTS else THERE
        assert node == expected, (node, endpoint)
        self.calls.put((endpoint, [bytes(f) for f in frames]))
        return True

    def wait(self, endpoint: str, count: int, timeout: float = 10.0) -> list[bytes]:
        """The first ``count`` frames delivered to ``endpoint``."""
        end = time.monotonic() + timeout
        while len(self.by_endpoint.get(endpoint, [])) < count:
            left = end - time.monotonic()
            assert left > 0, f"{endpoint}: {self.by_endpoint.get(endpoint)}"
            try:
                ep, frames = self.calls.get(timeout=left)
            except queue.Empty:
                continue
            self.by_endpoint.setdefault(ep, []).extend(frames)
        return self.by_endpoint[endpoint][:count]


GRANTS = Grants()
CTL, LOCAL = GRANTS.control(HERE), GRANTS.node_pass(HERE, HERE)  # the launcher's, this node's


def make_gateway(monkeypatch=None, broken: str | None = None):
    """A gateway on a node that is not the head, stages ``a`` and ``b`` on another node;
    with ``broken``, that endpoint's socket cannot be bound."""
    if broken is not None:
        real = gateway_module.pull_socket

        def pull_socket(ctx, address, hwm=1000, setup=None):
            if address.endswith(f"/{broken}"):
                raise zmq.ZMQError(zmq.EADDRINUSE)
            return real(ctx, address, hwm, setup)

        monkeypatch.setattr(gateway_module, "pull_socket", pull_socket)
    gw = NodeGateway(f"t{uuid.uuid4().hex[:8]}", HERE, HEAD, ["a", "b"], grant=GRANTS.grant(HERE))
    rec = Recorder()
    gw._deliver_remote = rec  # no frame is sent before this is in place
    gw.set_routes(CTL, {"a": (THERE, 1), "b": (THERE, 1)})
    return gw, rec


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def segment(rid, seq=0, tokens=(1,), handles=None):
    return Segment(
        request_id=rid, sequence=seq, stage="a", tokens=list(tokens), device_handles=handles or {}
    )


def test_bad_frames_and_messages_are_dropped_and_the_rest_goes_through(zctx, caplog):
    gw, rec = make_gateway()
    try:
        seg = gw.segments.create("a", 4096)
        fd = os.open(os.path.join(SHM_DIR, seg), os.O_RDWR)
        with mmap.mmap(fd, 0) as m:
            m[64:68] = b"\x01\x02\x03\x04"
        os.close(fd)
        good = ShmHandle(seg, 64, 4, "|u1", (4,), "a", 7)
        # a segment of a's that is gone (its name as this runtime makes them)
        gone_name = seg.rsplit("-", 2)[0] + "-99-" + "0" * 16
        gone = ShmHandle(gone_name, 0, 4, "|u1", (4,), "a", 8)
        bad_message = {"event_type": "segment", "request_id": "r2", "stage": "a", "sequence": "x"}
        frames = [
            GARBAGE,  # undecodable as a whole, and not even a list of messages
            encode_frame(
                [
                    segment("r1", handles={"k": good}),
                    bad_message,  # does not decode: fails r2 only
                    segment("r3", handles={"k": gone}),  # arrays unreadable: fails r3 only
                    segment("r1", seq=1, tokens=[2]),
                ]
            ),
            encode_frame([segment("r4", tokens=[5])]),  # the frame after: as it was
        ]
        sock = push_socket(zctx, gw.addr.data("b"))
        with caplog.at_level(logging.ERROR, logger="omni.ray.gateway"):
            for f in frames:
                sock.send(f)
            sent = rec.wait("b.data", 2)
            first = decode_event_frame(sent[0])
            assert [(e.request_id, e.sequence) for e in first] == [("r1", 0), ("r1", 1)]
            assert first[0].device_handles == {
                "k": InlineArray(b"\x01\x02\x03\x04", "|u1", (4,), False)
            }
            assert sent[1] == frames[2]
            # both slots go back to their producer (a's control endpoint), read by b
            rels = [m for f in rec.wait("a.ctl", 2) for m in decode_control_frame(f)]
            assert all(isinstance(r, Release) and r.reader == "b" for r in rels)
            assert sorted((r.segment, r.slots) for r in rels) == sorted(
                [(seg, [(64, 7)]), (gone_name, [(0, 8)])]
            )
            # r2 and r3 end with an error at the caller; r1 and r4 do not
            errors = decode_event_frame(rec.wait(RESULTS, 1)[0])
            assert all(isinstance(e, Error) and e.code == GATEWAY_ERROR for e in errors)
            assert sorted(e.request_id for e in errors) == ["r2", "r3"]
            r3 = next(e for e in errors if e.request_id == "r3")
            assert "b.data" in r3.message and "FileNotFoundError" in r3.message
        info = gw.info()
        assert info["dropped"] == 3 and info["failures"] == {}
        assert gw.failure() is None
        unreadable = [r for r in caplog.records if "cannot read the arrays" in r.getMessage()]
        assert unreadable and unreadable[0].exc_info is not None  # with its traceback
        assert any("undecodable frame" in r.getMessage() for r in caplog.records)
        sock.close(linger=0)
    finally:
        gw.close(CTL)


def test_an_unexpected_delivery_error_drops_that_batch_only(zctx, caplog):
    gw, rec = make_gateway()
    try:
        rec.fail_next.add("b.data")
        sock = push_socket(zctx, gw.addr.data("b"))
        with caplog.at_level(logging.ERROR, logger="omni.ray.gateway"):
            sock.send(encode_frame([segment("r1")]))
            errors = decode_event_frame(rec.wait(RESULTS, 1)[0])
            assert [(e.request_id, e.code) for e in errors] == [("r1", GATEWAY_ERROR)]
            assert "synthetic delivery failure" in errors[0].message
            later = encode_frame([segment("r2")])
            sock.send(later)
            assert rec.wait("b.data", 1) == [later]  # the thread went on
        logged = [r for r in caplog.records if "unexpected error" in r.getMessage()]
        assert logged and logged[0].exc_info is not None
        assert gw.failure() is None
        sock.close(linger=0)
    finally:
        gw.close(CTL)


def wait_held(gw, n, timeout=10.0):
    end = time.monotonic() + timeout
    while len(gw.held) != n:
        assert time.monotonic() < end, (len(gw.held), gw.held.by_reader())
        time.sleep(0.02)


def test_a_readers_release_of_an_object_ends_here_while_its_producer_restarts(zctx):
    """A reader here releases objects its producer (on another node) put: the releases
    end at this gateway at once, even while the producer is restarting and frames for
    it (an earlier release of a slot) wait for its new place."""
    gw, rec = make_gateway()
    try:
        gw.set_routes(CTL, {"b": (HERE, 2)})  # the reader lives here
        keys = ["k0", "k1", "k2"]
        gw.held.hold("b", [FakeRef(k) for k in keys], producer="a")
        assert [r.key for r in gw.lend(LOCAL, keys, "b")] == keys  # b maps them
        gw.set_routes(CTL, {"a": (None, 3)})  # the producer died: it is restarting

        def release(key):
            segment = segment_name(gw.pipeline_id, key)
            return Release(slots=[(0, 0)], segment=segment, reader="b")

        # a release of a slot of a's earlier life: it waits for a's new place (the
        # object's release in its frame ends here as it is taken in)
        slot = Release(slots=[(64, 3)], segment="omni-1-x-a-0-" + "0" * 16, reader="b")
        sock = push_socket(zctx, gw.addr.control("a"))
        sock.send(encode_frame([slot, release("k0")]))
        wait_held(gw, 2)  # taken in: it waits now
        for key in ("k1", "k2"):  # the frames after it
            sock.send(encode_frame([release(key)]))
        wait_held(gw, 0)  # while a is not placed
        assert gw.held.released == 3 and rec.calls.empty()
        gw.set_routes(CTL, {"a": (THERE, 4)})  # its new life: what waited goes on
        assert decode_control_frame(rec.wait("a.ctl", 1)[0]) == [slot]
        sock.close(linger=0)
    finally:
        gw.close(CTL)


def test_a_thread_that_cannot_go_on_is_reported(monkeypatch, zctx, caplog):
    with caplog.at_level(logging.CRITICAL, logger="omni.ray.gateway"):
        gw, rec = make_gateway(monkeypatch, broken="b.ctl")
        try:
            end = time.monotonic() + 10
            while gw.failure() is None:
                assert time.monotonic() < end, "the broken endpoint was not reported"
                time.sleep(0.02)
            failure = gw.failure()
            assert "b.ctl" in failure["part"] and HERE in failure["part"]
            assert "b.ctl" in failure["error"] and "Address already in use" in failure["error"]
            assert set(gw.info()["failures"]) == {"b.ctl"}
            critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
            assert critical and "b.ctl" in critical[0].getMessage() and critical[0].exc_info
            # the other endpoints still forward
            sock = push_socket(zctx, gw.addr.data("b"))
            frame = encode_frame([segment("r1")])
            sock.send(frame)
            assert rec.wait("b.data", 1) == [frame]
            sock.close(linger=0)
        finally:
            gw.close(CTL)


def test_a_garbage_frame_through_a_real_gateway_costs_no_later_request(cluster):
    import ray
    from omni_core import Pipeline
    from omni_ray.testing import on
    from omni_testing.configs import chain

    cfg = chain(
        ("src", "synthetic.source", {"segment": 2}, on("node_a")),
        ("up", "synthetic.map", {"scale": 2}, on("node_b")),
        edges=[{"from": "src", "to": "up", "window": {"size": 1}}],
        heartbeat_interval_s=0.1,
    )
    with Pipeline(cfg, backend="ray") as pipe:
        launcher = pipe.backend.launcher
        head = launcher.gateways[launcher.head_node]
        where = {n: h["where"] for n, h in pipe.backend.health().items()}
        assert where["src"] != where["up"]  # src's frames to up cross the head's gateway
        ctx = zmq.Context()
        try:
            sock = push_socket(ctx, Addresses(launcher.socket_dir).data("up"))
            bad = encode_frame([{"event_type": "segment", "request_id": "nobody", "x": 1}])
            sock.send(GARBAGE)
            sock.send(bad + b"\xa3shm")  # one message list with trailing bytes
            time.sleep(0.5)  # both reach the gateway before any request's frames
            outs = pipe.generate([{"n": 6}, {"n": 9, "start": 3}], timeout_s=60)
        finally:
            ctx.destroy(linger=0)
        for out, (n, start) in zip(outs, [(6, 0), (9, 3)], strict=True):
            assert out.ok, out.error
            assert [t for e in out.by_stage("up") for t in e.tokens] == [
                2 * t for t in range(start, start + n)
            ]
        info = ray.get(head.info.remote(), timeout=30)
        assert info["dropped"] == 2 and info["failures"] == {}
        assert ray.get(head.failure.remote(), timeout=30) is None
