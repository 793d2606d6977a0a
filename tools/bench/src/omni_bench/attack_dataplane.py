"""The data plane under attack (``omni bench attack``'s ``dataplane`` arm).

Local backend (:func:`run_local_attacks`): a pipeline ``src`` (holds each request a while)
-> ``sink`` (reads arrays). Its sink's segment name is found taken at start (a file under
it appears just before it is made: the name a squatter would need to guess); then, while
normal requests run, a frame posing as ``src``'s first event of an attack request is pushed
into the sink's data socket for each hostile segment reference: an absolute path, ``../``,
a ``/`` inside a runtime-like name, a name that is not the runtime's, a symbolic link, a
FIFO, a file that is not private, another user's file (as root), a span past the segment's
end, the segment of another producer. Each must fail its own request naming the segment
(``refused`` of ``attempted``) while the sink keeps serving (``sink_restarts == 0``).

Simulated Ray cluster (:func:`run_ray_channel_attacks`, two nodes on this machine): frames
posing as ``src``'s first event sent over ``up``'s channel on the other node by a peer
without the keys and with another pipeline's keys (``forged_accepted``: requests they
spoiled), a frame sent with the keys then its captured bytes replayed over a new
connection (``replayed_accepted``; ``auth_failures`` counts refused handshake attempts,
not clients: a client may retry), and forged Releases and ReaderLosts
(with another node's keys; also spelled as str8 msgpack) for the slots a reader holds on
the head node (``slots_freed_early``; ``releases_refused`` counts the messages refused).

``lost``: requests sent during the attacks that got no terminal event by their deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from omni_core import Pipeline
from omni_core.dataplane.serial import encode_frame
from omni_core.dataplane.shm import owner_prefix
from omni_core.events import ReaderLost, Release, Segment, ShmHandle
from omni_testing.configs import chain
from omni_testing.hostile import (
    PlantedSegments,
    Relay,
    hostile_segment_names,
    push_frames,
    squatted_segment_names,
    str8_frame,
)

DEADLINE_S = 30.0


def first_event(rid: str, segment: str, producer: str = "src", offset: int = 0) -> Segment:
    handle = ShmHandle(segment, offset, 16, "|u1", (16,), producer, 1)
    return Segment(request_id=rid, sequence=0, stage="src", device_handles={"data": handle})


class Load:
    """Normal requests in a thread while the attacks run: each must end in time."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        self.stop = threading.Event()
        self.ok = self.failed = self.lost = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            out = self.pipe.generate([{}], timeout_s=DEADLINE_S)[0]
            if out.finish_reason == "timeout":
                self.lost += 1
            elif out.ok:
                self.ok += 1
            else:
                self.failed += 1

    def end(self) -> None:
        self.stop.set()
        self.thread.join(DEADLINE_S + 10)


def ended(handle: Any, timeout_s: float) -> list[Any] | None:
    """The events of ``handle``, once its terminal one came within ``timeout_s`` (None:
    lost)."""
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.extend(handle), daemon=True)
    t.start()
    t.join(timeout_s)
    return list(got) if got and got[-1].terminal else None


def run_local_attacks() -> dict[str, Any]:
    cfg = chain(
        ("src", "synthetic.sleep", {"hold_s": 0.2}),
        ("sink", "synthetic.array_sink", {}),
        heartbeat_interval_s=0.1,
    )
    res: dict[str, Any] = {}
    planted: PlantedSegments | None = None
    t0 = time.monotonic()
    try:
        with squatted_segment_names("sink") as taken, Pipeline(cfg) as pipe:
            first = pipe.generate([{}], timeout_s=DEADLINE_S)[0]
            res["squatted_start_ok"] = bool(taken) and first.ok and pipe.healthy
            src_arena = next(n for n in pipe.backend.launcher.segments.names if "-src-" in n)
            planted = PlantedSegments(owner_prefix(src_arena), "src")
            cases = hostile_segment_names(planted)
            msgs = {c: first_event(f"attack-{c}", n) for c, n in cases.items()}
            msgs["past_end"] = first_event("attack-past_end", src_arena, offset=1 << 40)
            msgs["other_producer"] = first_event("attack-other_producer", src_arena, "sink")
            sink_pid = pipe.pids()["sink"]
            load = Load(pipe)
            handles = {c: pipe.submit({}, m.request_id, DEADLINE_S) for c, m in msgs.items()}
            address = pipe.backend.addr.data("sink")
            push_frames(address, *(encode_frame([m]) for m in msgs.values()))
            refused, lost, not_refused = 0, 0, []
            for c, h in handles.items():
                events = ended(h, DEADLINE_S + 10)
                segment = msgs[c].device_handles["data"].segment
                last = events[-1] if events else None
                if last is None:
                    lost += 1
                elif last.event_type == "error" and segment[:60] in (last.message or ""):
                    refused += 1
                else:
                    not_refused.append(c)
            load.end()
            after = pipe.generate([{}, {}], timeout_s=DEADLINE_S)
            res.update(
                attempted=len(msgs),
                refused=refused,
                not_refused=not_refused,
                served_during=load.ok,
                failed_during=load.failed,
                served_after=sum(o.ok for o in after),
                sink_restarts=pipe.metrics()["stages"]["sink"]["restarts"],
                sink_same_pid=pipe.pids()["sink"] == sink_pid,
                healthy_after=pipe.healthy,
                lost=lost + load.lost + sum(o.finish_reason == "timeout" for o in after),
            )
    finally:
        if planted is not None:
            planted.remove()
    res["local_s"] = round(time.monotonic() - t0, 1)
    return res


# ---------------------------------------------------------------------- Ray channels
def wait_until(cond: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def run_ray_channel_attacks() -> dict[str, Any]:
    """Forged and replayed frames and forged Releases on a simulated two-node cluster."""
    import ray
    from omni_ray.channel_auth import ChannelKeys
    from omni_ray.testing import on, simulated_cluster

    t0 = time.monotonic()
    res: dict[str, Any] = {}
    cfg = chain(
        ("src", "synthetic.sleep", {"hold_s": 1.0}, on("node_a")),
        ("up", "synthetic.map", {"scale": 2}, on("node_b")),
        ("arrays", "synthetic.array_source", {"nbytes": 256 << 10}, on("node_a")),
        ("hold", "synthetic.sleep", {"hold_s": 2.0}, on("node_a")),
        edges=[{"from": "src", "to": "up"}, {"from": "arrays", "to": "hold"}],
        heartbeat_interval_s=0.1,
    )
    ctx = zmq.Context()
    try:
        with simulated_cluster(nodes=2), Pipeline(cfg, backend="ray") as pipe:
            launcher = pipe.backend.launcher
            head = launcher.gateways[launcher.head_node]
            ((far_node, far),) = [
                (n, g) for n, g in launcher.gateways.items() if n != launcher.head_node
            ]
            keys = launcher.node_keys[launcher.head_node]  # a node's: frames get through
            control = launcher.grants.control
            far_ch = ray.get(far.channel_addresses.remote(control(far_node)), timeout=30)
            head_ch = ray.get(
                head.channel_addresses.remote(control(launcher.head_node)), timeout=30
            )
            far_server = launcher.node_keys[far_node].server_public

            def sender(
                address: str, k: ChannelKeys | None, server: bytes = far_server
            ) -> zmq.Socket:
                sock = ctx.socket(zmq.PUSH)
                sock.linger = 0
                if k is not None:
                    k.client(sock, server)
                sock.connect(address)
                return sock

            # forged first events for requests src holds, from peers without the keys
            cases = {"no_keys": None, "other_pipeline_keys": ChannelKeys.new()}
            handles = {c: pipe.submit({}, f"forged-{c}", DEADLINE_S) for c in cases}
            socks = [sender(far_ch["up.data"], k) for k in cases.values()]
            for s, c in zip(socks, cases, strict=True):
                forged = Segment(request_id=f"forged-{c}", sequence=0, stage="src", tokens=[7])
                s.send(encode_frame([forged]))
            forged_accepted = lost = 0
            for h in handles.values():
                events = ended(h, DEADLINE_S + 10)
                if events is None:
                    lost += 1
                    continue
                tokens = [t for e in events if isinstance(e, Segment) for t in e.tokens or []]
                if events[-1].event_type != "completed" or 14 in tokens:
                    forged_accepted += 1
            # replay: a frame sent with the keys through a recording relay, then its
            # bytes over a new connection; up's intake counts what it takes in
            received = lambda: pipe.metrics()["stages"]["up"]["received"]  # noqa: E731
            base = received()
            relay = Relay(far_ch["up.data"])
            legit = sender(relay.address, keys)
            legit.send(
                encode_frame([Segment(request_id="replay-1", sequence=0, stage="src", tokens=[1])])
            )
            seen = wait_until(lambda: received() >= base + 1, 10)
            with socket.create_connection(relay.target) as raw:
                raw.sendall(b"".join(relay.sent))
                time.sleep(1.0)  # ten heartbeats
            replayed_accepted = received() - (base + 1)
            # forged Releases and ReaderLosts (with node_b's keys: admitted, but not the
            # orchestrator's node; some spelled the long way) for the slot hold is reading
            arrays = lambda: pipe.metrics()["stages"]["arrays"]["shm_slots_in_use"]  # noqa: E731
            h = pipe.submit({"nbytes": 256 << 10}, "slots-1", DEADLINE_S)
            holding = wait_until(lambda: arrays() >= 1, 10)
            segment = ray.get(launcher.workers["arrays"].actor.where.remote())["segment"]
            slots = [(i * (256 << 10), r) for i in range(4) for r in range(1, 5)]
            rel = sender(head_ch["arrays.ctl"], launcher.node_keys[far_node], keys.server_public)
            for reader in ("hold", "up", "client"):
                frame = encode_frame([Release(slots=slots, segment=segment, reader=reader)])
                rel.send(frame)
                rel.send(str8_frame(frame))
                rel.send(str8_frame(encode_frame([ReaderLost(reader=reader)])))
            time.sleep(0.5)
            early = holding and arrays() == 0 and not h.done
            lost += ended(h, DEADLINE_S + 10) is None
            after = pipe.generate([{}, {}], timeout_s=DEADLINE_S)
            far_info = ray.get(far.info.remote(), timeout=30)
            head_info = ray.get(head.info.remote(), timeout=30)
            res.update(
                forged_sent=len(cases),
                forged_accepted=forged_accepted,
                auth_failures=far_info["auth_failures"],
                replay_original_delivered=seen,
                replayed_accepted=max(0, replayed_accepted),
                releases_refused=head_info["refused"],
                slot_held_before_release=holding,
                slots_freed_early=int(early),
                served_after=sum(o.ok for o in after),
                lost=lost + sum(o.finish_reason == "timeout" for o in after),
            )
    finally:
        ctx.destroy(linger=0)
    res["s"] = round(time.monotonic() - t0, 1)
    return res


def run_ray_gateway_attacks(measure_s: float = 8.0) -> dict[str, Any]:
    """``omni bench attack``'s ``ray`` arm: with the channels off (every frame between
    nodes a gateway call), a Ray task on the other node holding that node's secret forges
    every gateway call the screen must refuse (:mod:`omni_ray.forged_calls`), again and
    again for ``measure_s``, while a normal client's requests cross the nodes one after
    another: their p99 latency idle and under the forgeries (``ratio``, target <= 2),
    ``forged_accepted`` (target 0), the legitimate calls going through (``legit_ok``) and
    ``lost`` (target 0)."""
    import os

    import ray
    from omni_ray.forged_calls import forge_from
    from omni_ray.testing import on, simulated_cluster

    from omni_bench.attack_shares import p99

    cfg = chain(
        ("src", "synthetic.source", {"segment": 2}, on("node_a")),
        ("up", "synthetic.map", {"scale": 2}, on("node_b")),
        heartbeat_interval_s=0.1,
    )
    before = os.environ.get("OMNI_RAY_CHANNELS")
    os.environ["OMNI_RAY_CHANNELS"] = "0"  # every frame between nodes a gateway call
    t0 = time.monotonic()
    try:
        with simulated_cluster(nodes=2), Pipeline(cfg, backend="ray") as pipe:
            launcher = pipe.backend.launcher
            head_node = launcher.head_node
            head = launcher.gateways[head_node]
            (far,) = [n for n in launcher.gateways if n != head_node]
            segment = launcher.workers["src"].segment
            lost = 0

            def latencies(seconds: float) -> list[float]:
                nonlocal lost
                ms: list[float] = []
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    t = time.perf_counter()
                    (out,) = pipe.generate([{"n": 4}], timeout_s=DEADLINE_S)
                    if out.ok:
                        ms.append((time.perf_counter() - t) * 1000)
                    else:
                        lost += 1
                return ms

            latencies(1.0)  # warm
            idle = latencies(measure_s)
            forged: dict[str, Any] = {}

            def forge() -> None:
                pid = launcher.pipeline_id
                forged.update(forge_from(far, pid, head_node, "src", segment, measure_s + 2))

            forger = threading.Thread(target=forge)
            forger.start()
            refused = lambda: ray.get(head.info.remote(), timeout=30)["calls_refused"]  # noqa: E731
            if not wait_until(lambda: refused() > 0 or not forger.is_alive(), 120):
                raise RuntimeError("the forged calls did not start in 120 s")
            during = latencies(measure_s)
            forger.join()
            if not forged:
                raise RuntimeError("the forging task failed")
            info = ray.get(head.info.remote(), timeout=30)
            served = pipe.generate([{"n": 4}, {"n": 4}], timeout_s=DEADLINE_S)
            lost += sum(not o.ok for o in served)
    finally:
        if before is None:
            os.environ.pop("OMNI_RAY_CHANNELS", None)
        else:
            os.environ["OMNI_RAY_CHANNELS"] = before
    idle_p99, attack_p99 = p99(idle), p99(during)
    return {
        "p99_ms_idle": idle_p99,
        "p99_ms_attack": attack_p99,
        "ratio": round(attack_p99 / idle_p99, 2) if idle_p99 > 0 else float("nan"),
        "normal_requests": len(idle) + len(during),
        "forged_sent": forged["sent"],
        "forged_refused": forged["refused"],
        "forged_accepted": len(forged["accepted"]),
        "accepted_calls": sorted(set(forged["accepted"])),
        "calls_refused": info["calls_refused"],
        "messages_refused": info["refused"],
        "legit_ok": forged["legit_ok"],
        "lost": lost,
        "s": round(time.monotonic() - t0, 1),
    }


def run_dataplane_attacks(ray: bool = True) -> dict[str, Any]:
    """Both parts (the Ray one where omni-ray is installed and ``ray``), as one flat dict:
    the local part's keys as they are, the Ray part's prefixed ``ray_``, ``lost`` and
    ``forged_accepted`` / ``slots_freed_early`` at the top."""
    res = run_local_attacks()
    if ray:
        try:
            import omni_ray  # noqa: F401
        except ImportError:
            res["ray"] = "skipped: omni-ray is not installed"
            return res
        part = run_ray_channel_attacks()
        for k, v in part.items():
            res[k if k in ("forged_accepted", "slots_freed_early") else f"ray_{k}"] = v
        res["lost"] += part["lost"]
    return res
