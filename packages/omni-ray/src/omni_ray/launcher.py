"""The ``ray`` backend: stage workers as Ray actors, placed by Ray, on one or many nodes.

The orchestrator (the same control plane as on the local backend) runs in the caller's
process, which must be on a node of the cluster (the head, usually), or, for a Ray Client
address (``ray://``), in an actor on the head node (:mod:`omni_ray.client`;
:mod:`omni_ray.backend` chooses). The launcher joins
the cluster, puts a :class:`~omni_ray.gateway.NodeGateway` on every node (on nodes that
join later too), starts one :class:`~omni_ray.stage_actor.StageActor` per worker (a
stage's, or each replica's, ``STAGE#i``, of a stage with ``replicas``) with its stage's
``placement`` (CPUs, GPUs, custom resources, node labels: each replica is an actor of its
own, so replicas may land on different nodes), and tells the gateways where each worker
lives. Worker deaths and restarts follow the orchestrator's own policy (``max_restarts``,
backoff, replay of idempotent stages); Ray's actor restarts stay off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import uuid
from typing import Any

from omni_core.config import PipelineConfig, split_worker
from omni_core.control.launcher import Launcher, WorkerHandle
from omni_core.control.worker_env import inherited_env
from omni_core.dataplane.serial import encode_json
from omni_core.dataplane.shm import SHM_DIR
from omni_core.errors import StageStartError
from omni_core.worker import WorkerSpec

from omni_ray.channel_auth import ChannelKeys, curve_available
from omni_ray.gateway import NodeGateway
from omni_ray.grants import Grants
from omni_ray.objects import install_reader, uninstall_reader
from omni_ray.routes import gateway_name
from omni_ray.segments import unlink_pipeline_segments
from omni_ray.stage_actor import StageActor

log = logging.getLogger("omni.ray")
# how long the head node's gateway actor may take to start, at least: a Ray worker process
# that imports omni, seconds alone and far more on a loaded node (a stage's ready_timeout_s,
# a few seconds in some configs, bounds the stage's own start, not this)
GATEWAY_START_S = 60.0
NODE_SCAN_S = 1.0  # how often to look for nodes that joined (they get a gateway)
# a delivery blocks while its consumer pushes back, holding one of the gateway's threads:
# at most one per (other node, endpoint) at once, plus control calls
GATEWAY_THREADS = 256


@functools.cache
def actor_class(cls: type) -> Any:
    """``cls`` as a Ray actor class, made once (``ray.remote`` exports the class anew)."""
    import ray

    return ray.remote(cls)


class RayWorker(WorkerHandle):
    """One life of a worker (a stage's, or a replica's) as a Ray actor."""

    def __init__(self, name: str, actor: Any, run_ref: Any, where_ref: Any) -> None:
        self.name = name  # the worker's: its route key
        self.actor = actor
        self.run_ref = run_ref
        self.where_ref: Any = where_ref
        self.node: str | None = None
        self.segment = ""
        self.where = "pending"
        self.ended = False

    def exited(self) -> bool:
        return self.ended

    def reap(self) -> str:
        import ray

        try:
            code = ray.get(self.run_ref, timeout=5)
            reason = f"exited with code {code}"
        except ray.exceptions.ActorDiedError as e:
            cause = "its node died" if "node" in str(e).lower() else "the actor died"
            reason = f"{cause} (Ray: {type(e).__name__})"
        except ray.exceptions.RayError as e:
            reason = f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"
        self._kill()
        return reason

    def stop(self, grace_s: float) -> None:
        import ray

        if self.placed():  # one Ray never placed (its node went away, say) has no work
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                ray.get(self.run_ref, timeout=max(grace_s, 0.001))
        self._kill()

    def placed(self) -> bool:
        """Ray placed the actor and it came up (it may serve, or have served)."""
        import ray

        if self.node is not None:
            return True
        return bool(self.where_ref is None or ray.wait([self.where_ref], timeout=0)[0])

    def kill(self) -> None:
        self._kill()

    def _kill(self) -> None:
        import ray

        self.ended = True
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)


class RayLauncher(Launcher):
    """Starts each worker as a :class:`~omni_ray.stage_actor.StageActor` where its stage's
    ``placement`` lets Ray put it, with a gateway on every node (see the module)."""

    def __init__(self, cfg: PipelineConfig) -> None:
        import ray

        self.cfg = cfg
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            ray.init(
                address=cfg.backend.address,
                namespace=cfg.backend.namespace,
                log_to_driver=True,
                include_dashboard=False,
                configure_logging=False,
            )
        self.pipeline_id = uuid.uuid4().hex[:10]
        # frames between nodes over the gateways' TCP channels ("auto": each node's IP);
        # OMNI_RAY_CHANNELS=0 sends every frame by Ray actor calls instead (nodes that
        # cannot reach each other's ports)
        self.channel_ip = None if os.environ.get("OMNI_RAY_CHANNELS") == "0" else "auto"
        if self.channel_ip is not None and not curve_available():
            log.warning(
                "pyzmq has no CURVE support: no cross-node channels (they would not be "
                "authenticated); every frame between nodes goes by Ray actor calls"
            )
            self.channel_ip = None
        # the channels' CURVE keys, this pipeline's alone: a server and a client pair per
        # node (so a receiver knows which node sent a frame, and no node can pose as
        # another's channels); each gateway gets its own as actor arguments, the other
        # nodes' public keys by calls (through Ray; never on a command line or in an
        # environment)
        self.node_keys: dict[str, ChannelKeys] = {}  # node id -> its gateway's keys
        # who calls a gateway: the passes of this launcher and of each node (Ray names
        # no caller); the master secret stays in this process
        self.grants = Grants()
        self.head_node = ray.get_runtime_context().get_node_id()
        # every worker a stage may have (each replica up to its max): the gateways bind
        # the endpoints of all of them, so a replica the autoscaler adds later is reached
        self.worker_names = cfg.all_workers()
        self.gateways: dict[str, Any] = {}  # node id -> gateway actor
        self.routes: dict[str, tuple[str | None, int]] = {}  # worker -> (node id, version)
        self.version = 0
        self.workers: dict[str, RayWorker] = {}  # the current life of each worker
        self.next_scan = 0.0
        self.health_refs: dict[Any, str] = {}  # gateways' failure() calls in flight -> node
        self._failure: dict[str, str] | None = None
        from ray.exceptions import GetTimeoutError

        wait_s = max(cfg.ready_timeout_s, GATEWAY_START_S)
        try:
            head = self._add_gateway(self.head_node)
            info = ray.get(head.info.remote(), timeout=wait_s)
        except GetTimeoutError as e:
            self._shutdown_ray()
            raise StageStartError(
                f"the head node's gateway (the Ray actor that carries this pipeline's frames) "
                f"did not start within {wait_s:g} s: Ray had no worker process for it in time "
                "(a node short of CPU or memory?)"
            ) from e
        except BaseException:
            self._shutdown_ray()
            raise
        self.socket_dir = info["socket_dir"]
        # the caller's arrays from other nodes (it runs on the head node)
        here = self.grants.node_pass(self.head_node, self.head_node)
        install_reader(self.pipeline_id, head, here)
        self._scan_nodes()

    # ------------------------------------------------------------------ gateways
    def _add_gateway(self, node: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        keys = None
        if self.channel_ip is not None:
            keys = self.node_keys[node] = ChannelKeys.new()
        g = self.grants
        # what it knows of the nodes that may call it, and they of it: the others admit
        # it before it asks them where their channels are (a gateway's
        # channel_addresses() waits for that)
        peers = {n: g.peer(n, node, self.node_keys.get(n)) for n in self.gateways}
        for n, other in self.gateways.items():
            other.admit.remote(g.control(n), {node: g.peer(node, n, keys)})

        gw = (
            actor_class(NodeGateway)
            .options(
                name=gateway_name(self.pipeline_id, node),
                num_cpus=0,
                max_concurrency=GATEWAY_THREADS,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            .remote(
                self.pipeline_id,
                node,
                self.head_node,
                self.worker_names,
                self.channel_ip,
                keys,
                peers,
                g.grant(node),
            )
        )
        if self.routes:
            gw.set_routes.remote(g.control(node), dict(self.routes))
        self.gateways[node] = gw
        return gw

    def _scan_nodes(self) -> None:
        """Give every alive node a gateway; forget those of nodes that went away."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for node in alive - set(self.gateways):
            self._add_gateway(node)
        for node in set(self.gateways) - alive:
            if node != self.head_node:
                del self.gateways[node]
                self.node_keys.pop(node, None)
        if not self.health_refs:  # ask each gateway whether its forwarding still runs
            self.health_refs = {gw.failure.remote(): n for n, gw in self.gateways.items()}
        self.next_scan = time.monotonic() + NODE_SCAN_S

    def _check_gateways(self) -> None:
        import ray

        done, _ = ray.wait(list(self.health_refs), num_returns=len(self.health_refs), timeout=0)
        for ref in done:
            node = self.health_refs.pop(ref)
            try:
                failure = ray.get(ref)
            except ray.exceptions.RayError as e:
                if node != self.head_node:
                    continue  # its node went away: the next scan forgets it
                failure = {"part": "the head node's gateway", "error": f"{type(e).__name__}"}
            if failure is not None and self._failure is None:
                self._failure = failure

    def failure(self) -> dict[str, str] | None:
        return self._failure

    def _set_route(self, worker: str, node: str | None) -> None:
        self.version += 1
        self.routes[worker] = (node, self.version)
        for node, gw in self.gateways.items():
            gw.set_routes.remote(self.grants.control(node), {worker: self.routes[worker]})

    # ------------------------------------------------------------------ Launcher
    def spawn(self, worker: str) -> WorkerHandle:
        """Start worker ``worker`` (a stage's name, or ``STAGE#i``): an actor with its
        stage's placement and ``extra_env``; its replica's ``devices`` entry is resolved
        in the actor, against the GPUs Ray gave it."""
        stage, _ = split_worker(worker)
        st = self.cfg.stage(stage)
        pl = st.placement
        spec = WorkerSpec(stage=stage, worker=worker, config=self.cfg, socket_dir="", arena="")
        options: dict[str, Any] = {
            "num_cpus": pl.num_cpus,
            "num_gpus": pl.num_gpus,
            "max_concurrency": 4,
            "max_restarts": 0,
            "name": f"omni-{self.pipeline_id}-{worker}-{uuid.uuid4().hex[:6]}",
        }
        if pl.resources:
            options["resources"] = dict(pl.resources)
        if pl.node_labels:
            options["label_selector"] = dict(pl.node_labels)
        env = inherited_env("OMNI_")
        env.update(st.extra_env)
        if env:
            options["runtime_env"] = {"env_vars": env}
        actor = (
            actor_class(StageActor)
            .options(**options)
            .remote(
                encode_json(spec),
                self.pipeline_id,
                self.cfg.shm_pool_bytes,
                self.cfg.ready_timeout_s,
            )
        )
        w = RayWorker(worker, actor, actor.run.remote(), actor.where.remote())
        self.workers[worker] = w
        if worker in self.routes and self.routes[worker][0] is not None:
            self._set_route(worker, None)  # senders' frames wait until it is placed
        return w

    def tick(self) -> None:
        import ray

        if time.monotonic() >= self.next_scan:
            self._scan_nodes()
        if self.health_refs:
            self._check_gateways()
        pending = {w.where_ref: w for w in self.workers.values() if w.where_ref is not None}
        if pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in done:
                w = pending[ref]
                w.where_ref = None
                try:
                    info = ray.get(ref)
                except ray.exceptions.RayError:
                    continue  # it died before it was placed: run_ref says so
                w.node, w.pid, w.segment = info["node"], info["pid"], info["segment"]
                w.where = f"node {w.node[:12]}"
                if w.node not in self.gateways:
                    self._scan_nodes()
                self._set_route(w.name, w.node)
        running = {w.run_ref: w for w in self.workers.values() if not w.ended}
        if running:
            done, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
            for ref in done:
                w = running[ref]
                w.ended = True
                if self.routes.get(w.name, (None, 0))[0] == w.node:
                    self._set_route(w.name, None)

    def waiting(self, worker: str) -> str:
        w = self.workers.get(worker)
        if w is None or w.node is not None:
            return ""
        import ray

        pl = self.cfg.stage(split_worker(worker)[0]).placement
        asks = {"CPU": pl.num_cpus, "GPU": pl.num_gpus, **pl.resources}
        have = ray.cluster_resources()
        missing = {k: v for k, v in asks.items() if v and have.get(k, 0) < v}
        labels = f" and node labels {pl.node_labels}" if pl.node_labels else ""
        if missing:
            return (
                f"Ray has not placed its actor: it asks for {missing}{labels}, which no node "
                f"of the cluster offers (cluster resources: {have})"
            )
        return f"Ray has not placed its actor (it asks for {asks}{labels})"

    def unlink_segment(self, handle: WorkerHandle) -> None:
        w = handle
        assert isinstance(w, RayWorker)
        if not w.segment:
            return
        gw = self.gateways.get(w.node or "")
        if gw is not None:
            gw.unlink_segment.remote(self.grants.control(w.node or ""), w.segment)
        else:  # its node is gone; on this host (a simulated node) the file may remain
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, w.segment))

    def close(self) -> None:
        import ray

        uninstall_reader(self.pipeline_id)
        closing = [gw.close.remote(self.grants.control(n)) for n, gw in self.gateways.items()]
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.get(closing, timeout=10)
        for gw in self.gateways.values():
            with contextlib.suppress(Exception):
                ray.kill(gw, no_restart=True)
        # segments of gateways that died with their node, if that node was this host
        unlink_pipeline_segments(self.pipeline_id)
        self._shutdown_ray()

    def _shutdown_ray(self) -> None:
        import ray

        if self.owns_ray:
            ray.shutdown()
