"""The stage actor: one Ray actor per worker life (a stage's, or one replica's of a stage
with ``replicas``), running the same worker loop as a local process
(:func:`omni_core.worker.serve`) on whichever node Ray placed it."""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
from omni_core.observability.logs import configure_logging
from omni_core.worker import WorkerSpec, serve
from omni_core.worker.devices import worker_devices

from omni_ray.grants import node_pass, read_secret
from omni_ray.objects import install_reader, install_writer
from omni_ray.routes import gateway_name


class StageActor:
    """Run as a Ray actor with ``max_concurrency > 1``: :meth:`run` holds one thread for
    the worker's life while :meth:`where` answers."""

    def __init__(self, spec: bytes, pipeline_id: str, pool_bytes: int, wait_s: float) -> None:
        import ray

        self.spec = msgspec.json.decode(spec, type=WorkerSpec)
        # the worker's name (``STAGE#i`` for a replica) is its identity on the data plane:
        # its endpoints, its segment, the producer name of its arrays
        worker = self.spec.worker or self.spec.stage
        self.node_id = ray.get_runtime_context().get_node_id()
        # the orchestrator makes a gateway on every node as it appears; wait for ours
        deadline = time.monotonic() + wait_s
        while True:
            try:
                gw = ray.get_actor(gateway_name(pipeline_id, self.node_id))
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"no omni gateway on node {self.node_id} after {wait_s:.0f}s"
                    ) from None
                time.sleep(0.1)
        info = ray.get(gw.info.remote())
        self.spec.socket_dir = info["socket_dir"]
        self.spec.bind_dir = info["bind_dir"]
        # this node's secret, in its gateway's private directory: what this worker's
        # calls to the gateways prove they come from this node with (omni_ray.grants)
        secret = read_secret(info["socket_dir"])
        here = node_pass(self.node_id, secret, self.node_id)
        # arrays from other nodes, through the object store
        install_reader(pipeline_id, gw, here, worker)
        self.writer = install_writer(pipeline_id, worker, self.node_id, gw, secret)
        self.spec.arena = ray.get(gw.create_segment.remote(here, worker, pool_bytes))
        # `devices` (the replica's entry) keeps its meaning inside the node: an index into
        # the GPUs Ray gave this actor
        devices = worker_devices(self.spec.config, worker)
        if devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = devices  # before the stage imports torch
        self.spec.devices = devices

    def where(self) -> dict[str, Any]:
        return {"node": self.node_id, "pid": os.getpid(), "segment": self.spec.arena}

    def objects_put(self) -> int:
        """Arrays this worker put into the object store itself (for readers elsewhere)."""
        return self.writer.puts

    def run(self) -> int:
        configure_logging()
        return serve(self.spec)
