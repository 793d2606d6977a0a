"""Forged gateway calls, as a compromised node would make them (tests, ``omni bench attack``).

:func:`forge_from` runs a Ray task on a node other than the head that holds what such a
node holds (its own node's secret, read from its gateway's socket directory, so its
passes are real) and makes, against the head's gateway, every call the gateway screen
must refuse from there (:mod:`omni_ray.grants`, :mod:`omni_ray.gateway`):

* control calls (``set_routes`` rerouting a head worker to itself, ``admit``,
  ``unlink_segment``, ``close``) with its own pass, with a guessed launcher's token, with
  a pass for its own gateway shown to the head's, and with none;
* calls only the head node's processes may make (``lend`` of the caller's objects,
  ``create_segment``, ``current_routes``), a ``hold`` on a control endpoint, a
  ``release`` and a ``deliver`` posing as the head node (a guessed token);
* deliveries, with its own (valid) pass, of what only the orchestrator sends (``Submit``,
  ``Cancel``, ``Shutdown``, ``ReaderLost``), of a ``Release`` of a head worker's slots
  guessing its rental ids, of status messages about a head worker, and of results
  holding a handle to a head segment or a ``Submit``.

A call is refused when it raises :class:`PermissionError`, a delivery when the head's
gateway counts its message refused (``info()["refused"]``). One legitimate call of each
kind (its own gateway's routes, a harmless result) must go through: the check that the
forgeries were refused for what they are.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from omni_core.dataplane.serial import encode_frame
from omni_core.dataplane.transport import RESULTS, STATUS
from omni_core.events import (
    Cancel,
    Error,
    LoadFailed,
    ReaderLost,
    Ready,
    Release,
    Segment,
    ShmHandle,
    Shutdown,
    Submit,
)
from omni_core.worker.host import CLIENT

from omni_ray.grants import CONTROL, Peer, node_pass, read_secret
from omni_ray.routes import gateway_name

RENTAL_GUESSES = 64  # rental ids a forged Release names per slot (a counter's first ones)


def forge_from(
    node: str,
    pipeline_id: str,
    head_node: str,
    worker: str,
    segment: str,
    seconds: float = 0.0,
) -> dict[str, Any]:
    """Run the forged calls from ``node`` (not the head) against the head's gateway, once,
    or again and again for ``seconds``. ``worker``: a worker on the head node, whose
    arena is ``segment``. Returns ``{"sent", "refused", "accepted": [names],
    "legit_ok"}``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(_forge).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
    )
    return ray.get(task.remote(pipeline_id, head_node, worker, segment, seconds), timeout=600)


def _forge(
    pipeline_id: str, head_node: str, worker: str, segment: str, seconds: float
) -> dict[str, Any]:
    import ray

    node = ray.get_runtime_context().get_node_id()
    assert node != head_node, "the forger must run on another node than the head"
    head = ray.get_actor(gateway_name(pipeline_id, head_node))
    mine = ray.get_actor(gateway_name(pipeline_id, node))
    secret = read_secret(ray.get(mine.info.remote(), timeout=60)["socket_dir"])
    own = node_pass(node, secret, head_node)  # this node's real pass for the head
    calls, frames = _forgeries(node, secret, head_node, worker, segment)
    out: dict[str, Any] = {"sent": 0, "refused": 0, "accepted": [], "legit_ok": False}
    end = time.monotonic() + seconds
    while True:
        for name, call in calls:
            out["sent"] += 1
            if _refused(call(head)):
                out["refused"] += 1
            else:
                out["accepted"].append(name)
        for name, endpoint, frame in frames:
            out["sent"] += 1
            before = ray.get(head.info.remote(), timeout=60)["refused"]
            ray.get(head.deliver.remote(own, endpoint, [frame]), timeout=60)
            if ray.get(head.info.remote(), timeout=60)["refused"] == before + 1:
                out["refused"] += 1
            else:
                out["accepted"].append(name)
        if time.monotonic() >= end:
            break
    # the legitimate calls: its own gateway's routes, a result for no request
    routes, _ = ray.get(mine.current_routes.remote(node_pass(node, secret, node)), timeout=60)
    before = ray.get(head.info.remote(), timeout=60)["refused"]
    harmless = encode_frame([Error(request_id=f"nobody-{secrets.token_hex(4)}", stage=worker)])
    delivered = ray.get(head.deliver.remote(own, RESULTS, [harmless]), timeout=60)
    after = ray.get(head.info.remote(), timeout=60)["refused"]
    out["legit_ok"] = routes.get(worker) == head_node and delivered and after == before
    return out


def _forgeries(
    node: str, secret: str, head_node: str, worker: str, segment: str
) -> tuple[list[tuple[str, Any]], list[tuple[str, str, bytes]]]:
    """(name, call on the head's gateway) pairs, and (name, endpoint, frame) deliveries."""
    own = node_pass(node, secret, head_node)
    guessed = (CONTROL, secrets.token_hex(32))
    as_head = (head_node, secrets.token_hex(32))
    for_itself = node_pass(node, secret, node)  # good at its own gateway, not the head's
    reroute = {worker: (node, 1 << 40)}
    calls: list[tuple[str, Any]] = [
        ("set_routes with its pass", lambda g: g.set_routes.remote(own, reroute)),
        ("set_routes with a guessed token", lambda g: g.set_routes.remote(guessed, reroute)),
        ("set_routes with no pass", lambda g: g.set_routes.remote(None, reroute)),
        (
            "set_routes with its own gateway's pass",
            lambda g: g.set_routes.remote(for_itself, reroute),
        ),
        ("admit", lambda g: g.admit.remote(own, {"intruder": Peer(token="0" * 64)})),
        ("unlink_segment", lambda g: g.unlink_segment.remote(own, segment)),
        ("close", lambda g: g.close.remote(own)),
        ("close with a guessed token", lambda g: g.close.remote(guessed)),
        ("lend the caller's objects", lambda g: g.lend.remote(own, ["0" * 56], CLIENT)),
        ("create_segment", lambda g: g.create_segment.remote(own, worker, 1 << 20)),
        ("current_routes", lambda g: g.current_routes.remote(own)),
        ("hold on a control endpoint", lambda g: g.hold.remote(own, f"{worker}.ctl", [])),
        ("release posing as the head", lambda g: g.release.remote(as_head, CLIENT, ["0" * 56])),
        (
            "deliver posing as the head",
            lambda g: g.deliver.remote(as_head, f"{worker}.ctl", [encode_frame([Shutdown()])]),
        ),
        ("deliver with no pass", lambda g: g.deliver.remote(None, RESULTS, [b""])),
    ]
    guesses = [(off, r) for off in (0, 4096) for r in range(1, RENTAL_GUESSES + 1)]
    slot = ShmHandle(segment, 0, 16, "|u1", (16,), worker, 1)
    frames: list[tuple[str, str, bytes]] = [
        ("Submit", f"{worker}.data", encode_frame([Submit(request_id="forged", request={})])),
        ("Cancel", f"{worker}.ctl", encode_frame([Cancel(request_id="forged")])),
        ("Shutdown", f"{worker}.ctl", encode_frame([Shutdown()])),
        ("ReaderLost", f"{worker}.ctl", encode_frame([ReaderLost(reader=CLIENT)])),
        (
            "Release guessing rental ids",
            f"{worker}.ctl",
            encode_frame([Release(slots=guesses, segment=segment, reader=CLIENT)]),
        ),
        ("status LoadFailed", STATUS, encode_frame([LoadFailed(stage=worker, pid=1, message="x")])),
        ("status Ready", STATUS, encode_frame([Ready(stage=worker, pid=1, load_s=0.0)])),
        (
            "results with a head segment's handle",
            RESULTS,
            encode_frame([Segment(request_id="forged", stage=worker, device_handles={"x": slot})]),
        ),
        ("results with a Submit", RESULTS, encode_frame([Submit(request_id="f", request={})])),
    ]
    return calls, frames


def _refused(ref: Any) -> bool:
    """Whether the call ``ref`` was refused (it raised :class:`PermissionError`)."""
    import ray

    try:
        ray.get(ref, timeout=60)
    except ray.exceptions.RayTaskError as e:
        return isinstance(e, PermissionError) or isinstance(
            getattr(e, "cause", None), PermissionError
        )
    return False
