"""A simulated multi-node Ray cluster on this machine, for tests and benchmarks, and a
stand-in for an object reference where a test needs none of Ray."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

OBJECT_STORE_BYTES = 256 << 20  # per node; Ray's default (30% of RAM) is far more
# a custom resource every simulated node offers exactly once: a stage whose placement
# asks for it (see one_per_node) has at most one worker on each node, so the replicas
# of a stage with ``replicas: N`` land on N different nodes
ONE_PER_NODE = "node_slot"


@contextmanager
def simulated_cluster(
    nodes: int = 2,
    num_cpus: int = 8,
    object_store_bytes: int = OBJECT_STORE_BYTES,
    client_port: int | None = None,
) -> Iterator[Any]:
    """A head node and ``nodes - 1`` more on this machine, joined by this process.

    Node ``i`` offers the custom resource ``node_<letter>`` (``node_a`` is the head), so
    a stage lands on a node with ``placement: {resources: {node_b: 1}}``, and every node
    offers :data:`ONE_PER_NODE` once (see :func:`one_per_node`). ``num_cpus`` is
    logical: Ray schedules by it, it is not the cores the machine has. ``client_port``:
    the head also runs a Ray Client server there (``ray://127.0.0.1:<port>``; a Ray
    Client driver must be another process than this one).
    """
    import ray
    from ray.cluster_utils import Cluster

    head: dict[str, Any] = {
        "num_cpus": num_cpus,
        "resources": {"node_a": 100, ONE_PER_NODE: 1},
        "object_store_memory": object_store_bytes,
        "include_dashboard": False,
    }
    if client_port is not None:
        head["ray_client_server_port"] = client_port
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for i in range(1, nodes):
            add_node(cluster, f"node_{chr(ord('a') + i)}", num_cpus, object_store_bytes)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def free_port() -> int:
    """A TCP port free on this machine now (for a Ray Client server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_node(
    cluster: Any, resource: str, num_cpus: int = 8, object_store_bytes: int = OBJECT_STORE_BYTES
) -> Any:
    """Another simulated node offering ``resource`` (and :data:`ONE_PER_NODE` once);
    returns it (for ``remove_node``)."""
    node = cluster.add_node(
        num_cpus=num_cpus,
        resources={resource: 100, ONE_PER_NODE: 1},
        object_store_memory=object_store_bytes,
    )
    cluster.wait_for_nodes()
    return node


def on(resource: str, num_cpus: float = 0.5) -> dict[str, Any]:
    """A stage's ``placement`` for the simulated node offering ``resource``."""
    return {"placement": {"num_cpus": num_cpus, "resources": {resource: 1}}}


def one_per_node(num_cpus: float = 0.5) -> dict[str, Any]:
    """A stage's ``placement`` that takes a node's :data:`ONE_PER_NODE`: with ``replicas``,
    each replica on another node (one that finds no free node waits for one)."""
    return {"placement": {"num_cpus": num_cpus, "resources": {ONE_PER_NODE: 1}}}


def object_store_usage(address: str | None = None) -> dict[str, int]:
    """Objects and bytes in the object stores of every node of the cluster (what ``ray
    memory --stats-only`` reports): ``{"objects", "bytes", "primary_copies",
    "primary_bytes"}`` (a primary copy is one its owner pins)."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    address = address or ray.get_runtime_context().gcs_address
    stats = get_memory_info_reply(get_state_from_address(address)).store_stats
    return {
        "objects": stats.num_local_objects,
        "bytes": stats.object_store_bytes_used,
        # what an owner pins (a copy elsewhere is a cache Ray may evict at will)
        "primary_copies": stats.num_object_store_primary_copies,
        "primary_bytes": stats.object_store_bytes_primary_copy,
    }


def wait_object_store_empty(
    timeout_s: float = 20.0,
    address: str | None = None,
    max_bytes: int | None = None,
    unpinned_bytes: int = 0,
) -> dict[str, int]:
    """The object stores' usage once it is empty (Ray frees objects asynchronously), or
    holds at most ``max_bytes`` (what Ray keeps for itself, such as its mark of a lost
    object), or no primary copy and at most ``unpinned_bytes`` (copies nobody pins, such
    as one a reader pulled of an object whose owner then died: Ray evicts those only
    when it needs the room), or as it is after ``timeout_s``."""
    import time

    end = time.monotonic() + timeout_s
    while True:
        usage = object_store_usage(address)
        done = (
            usage["objects"] == 0
            or (max_bytes is not None and usage["bytes"] <= max_bytes)
            or (usage["primary_copies"] == 0 and usage["bytes"] <= unpinned_bytes)
        )
        if done or time.monotonic() > end:
            return usage
        time.sleep(0.2)


def split_ar_config(
    model: str, far: str = "node_b", window: int = 4, **far_stage: Any
) -> dict[str, Any]:
    """The tiny AR pipeline (omni-ar-stages' kinds) split over the simulated nodes:
    intake -> prefill on ``node_a``, decode -> postprocess on ``far`` (with the stage keys
    ``far_stage``), ``window`` between decode and postprocess."""
    opts = {"model": model, "threads": 1}
    far_keys = {**on(far), **far_stage}
    return {
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": {"model": model}, **on("node_a")},
            {"name": "prefill", "kind": "ar.prefill", "options": opts, **on("node_a")},
            {"name": "decode", "kind": "ar.decode", "options": opts, **far_keys},
            {
                "name": "postprocess",
                "kind": "ar.postprocess",
                "options": {"model": model},
                **far_keys,
            },
        ],
        "edges": [
            {"from": "intake", "to": "prefill"},
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "postprocess", "window": {"size": window}},
        ],
    }


def summary(out: Any, keep: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """An output reduced to what two backends must agree on: per stage in order, each
    event's type, tokens and the payload keys ``keep`` (not pids or times)."""
    assert out.ok, out.error
    events = sorted(out.events, key=lambda e: (e.terminal, e.stage))  # stable sort
    return [
        (e.stage, e.event_type, e.tokens, {k: e.payload[k] for k in keep if k in e.payload})
        for e in events
    ]


class FakeRef:
    """Stands in for a Ray object reference where only its id is read (``hex()``), as
    :class:`~omni_ray.objects.HeldObjects` reads it: no cluster needed."""

    def __init__(self, key: str) -> None:
        self.key = key

    def hex(self) -> str:
        return self.key
