"""The HTTP app: OpenAI endpoints over one running :class:`omni_core.Pipeline`, the web
page, ``/health``, ``/metrics`` and the page's live stage view.

This module only wires the parts together: the routes (``omni_serve.routes``), the API
key (``auth``), request bodies (``body``), SSE (``sse``), errors (``errors``,
``handlers``), the request id and ``Host`` check (``middleware``), each key's share
(``shares``).

Every request is one pipeline request per answer (``n`` images: ``n`` requests) read with
``Pipeline.astream``. A request ends in the pipeline however its HTTP side ends: a client
that goes away (streaming or not) cancels it at once, so nothing runs for a gone client.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from omni_core import Pipeline

from omni_serve import handlers
from omni_serve.middleware import RequestContext
from omni_serve.routes import images, operations, speech, text, tokenize
from omni_serve.server import Server, endpoints
from omni_serve.settings import ServeSettings
from omni_serve.shares import ClientShares

__all__ = ["ServeSettings", "create_app", "endpoints"]


def create_app(pipe: Pipeline, settings: ServeSettings) -> FastAPI:
    """The ASGI app serving ``pipe`` (started, and closed, by the caller)."""
    app = FastAPI(title="omni serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server = Server(pipe, settings)
    routers = (text.router, tokenize.router, images.router, speech.router)
    routers = (*routers, operations.guarded, operations.public)
    for router in routers:
        app.include_router(router)
    handlers.install(app)
    # inside CORS and the request id: a 429 over a key's share carries both
    app.add_middleware(ClientShares, shares=server.shares)
    if settings.cors_origins:  # none: no CORS headers at all (browsers: same origin only)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    app.add_middleware(RequestContext, allowed=settings.allowed_hosts)  # the outermost
    return app
