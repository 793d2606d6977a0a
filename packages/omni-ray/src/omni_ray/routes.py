"""Endpoint names on the Ray backend: whose an endpoint is, and who reads its arrays.

Endpoints are named after workers (``WORKER.data``, ``WORKER.ctl``): a stage's name, or
``STAGE#i`` for a replica; the endpoint's kind (``data``, ``ctl``) holds no ``.``, so the
last ``.`` splits an endpoint name, whatever the worker's name holds."""

from __future__ import annotations

from omni_core.dataplane.transport import RESULTS, STATUS
from omni_core.worker.host import CLIENT

DRIVER = "@driver"  # the route owner of the orchestrator's endpoints


def gateway_name(pipeline_id: str, node_id: str) -> str:
    """The Ray actor name of a pipeline's gateway on one node."""
    return f"omni-gw-{pipeline_id}-{node_id}"


def owner_of(endpoint: str) -> str:
    """The route key of an endpoint: its worker, or DRIVER for the orchestrator's."""
    if endpoint in (STATUS, RESULTS):
        return DRIVER
    return endpoint.rsplit(".", 1)[0]


def reader_of(endpoint: str) -> str | None:
    """Who reads the arrays of frames sent to ``endpoint`` (None: frames carry none)."""
    if endpoint == RESULTS:
        return CLIENT
    if endpoint.endswith(".data"):
        return endpoint.rsplit(".", 1)[0]
    return None


def inbox_of(reader: str) -> str:
    """The endpoint that brings ``reader`` its arrays (the inverse of :func:`reader_of`)."""
    return RESULTS if reader == CLIENT else f"{reader}.data"
