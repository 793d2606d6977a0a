"""The operator's endpoints: ``/v1/models``, ``/v1/omni/stats`` (the page's live view) and
``/metrics`` behind the API key; ``/health`` (its status; the detail with the key) and the
page (``/``) open. The page gets a Content-Security-Policy: it loads nothing but itself
and this server's API, and no other site may frame it."""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from omni_core.control.supervisor import stage_health
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from omni_serve.auth import has_api_key, require_api_key
from omni_serve.middleware import started_at
from omni_serve.server import ServerDep

guarded = APIRouter(dependencies=[Depends(require_api_key)])
public = APIRouter()

STAT_KEYS = ("queue_depth", "inflight", "enqueue_per_s", "dequeue_per_s", "completed")
HEALTH_KEYS = ("state", "healthy", "restarts", "pid", "exit")


@guarded.get("/v1/models")
async def models(request: Request, server: ServerDep) -> Response:
    server.observe("/v1/models", 200, started_at(request))
    return JSONResponse({"object": "list", "data": [server.model_card()]})


@guarded.get("/v1/omni/stats")
async def stats(request: Request, server: ServerDep) -> Response:
    """The page's live view: per stage state, queue depth, in-flight and rates."""
    m = server.pipe.metrics()
    health = server.pipe.health()
    rows = [
        {
            "name": name,
            "state": health[name]["state"],
            **{k: st.get(k, 0) for k in (*STAT_KEYS, "errors", "dropped", "restarts")},
        }
        for name, st in m["stages"].items()
    ]
    body: dict[str, Any] = {"stages": rows, "in_flight": m["in_flight"], "counts": m["counts"]}
    server.observe("/v1/omni/stats", 200, started_at(request))
    return JSONResponse(body)


@guarded.get("/metrics")
async def prometheus(request: Request, server: ServerDep) -> Response:
    out = Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)
    server.observe("/metrics", 200, started_at(request))
    return out


@public.get("/health")
async def health(request: Request, server: ServerDep) -> Response:
    """200 while every stage serves and the runtime has not failed: status ``ok`` when
    every worker is ready, ``degraded`` when a replica of a replicated stage is down but
    another of its replicas serves (``stages_summary`` says which). A stage none of whose
    workers serves (starting, restarting, dead) is 503 ``unhealthy``, and so is a failed
    runtime (status ``failed``, with the failure: ``{"part", "error"}``). ``stages`` is
    per worker: a replicated stage's replicas are ``STAGE#i``. Without the API key (where
    the server has one) the answer is the status alone: pids, exit reasons and a
    failure's text are the operator's."""
    workers = server.pipe.health()
    stages = {name: {k: h.get(k) for k in HEALTH_KEYS} for name, h in workers.items()}
    summary = stage_health(workers)
    failure = server.pipe.failure
    serving = failure is None and all(s["state"] != "failed" for s in summary.values())
    whole = serving and all(s["state"] == "ok" for s in summary.values())
    status = (
        "failed"
        if failure is not None
        else "ok"
        if whole
        else "degraded"
        if serving
        else "unhealthy"
    )
    code = 200 if serving else 503
    if not has_api_key(request):
        return JSONResponse({"status": status}, status_code=code)
    body: dict[str, Any] = {"status": status, "stages": stages, "stages_summary": summary}
    zygote = getattr(server.pipe, "zygote", lambda: None)()
    if zygote is not None:  # how workers (re)start: a restart waits less with it ready
        body["zygote"] = {k: zygote.get(k) for k in ("start", "state", "restarts")}
    if failure is not None:
        body["failure"] = {"part": failure.get("part"), "error": failure.get("error")}
    return JSONResponse(body, status_code=code)


@functools.cache
def page() -> str:
    return resources.files("omni_serve").joinpath("static/index.html").read_text()


def _hashes(tag: str, html: str) -> str:
    """CSP sources of the inline ``<tag>`` blocks of ``html``: their SHA-256s."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    digests = (base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() for b in blocks)
    return " ".join(f"'sha256-{d}'" for d in digests)


@functools.cache
def page_headers() -> dict[str, str]:
    """The page runs its own inline script and style (no other), talks to this server
    only, shows images from data URLs, plays audio from the blobs it makes and may be
    framed by no site (clickjacking)."""
    html = page()
    csp = (
        f"default-src 'none'; script-src {_hashes('script', html)}; "
        f"style-src {_hashes('style', html)}; img-src data:; media-src blob:; "
        "connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return {
        "Content-Security-Policy": csp,
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }


@public.get("/", response_class=HTMLResponse)
async def index() -> HTMLResponse:
    # static HTML holding no data: everything it fetches needs the API key
    return HTMLResponse(page(), headers=page_headers())
