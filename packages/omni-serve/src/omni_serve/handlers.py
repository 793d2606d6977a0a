"""How an exception becomes an answer: every error body is OpenAI-shaped and carries the
request id; a 5xx never carries an exception's text (that is logged, with the id)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_serve.errors import APIError
from omni_serve.middleware import request_id_of, started_at
from omni_serve.server import server_of
from omni_serve.streams import ClientGone

log = logging.getLogger("omni.serve")


def _endpoint(request: Request) -> str | None:
    """The matched route's path (an endpoint of the HTTP metrics), if any."""
    return getattr(request.scope.get("route"), "path", None)


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    rid = request_id_of(request)
    endpoint = _endpoint(request)
    where = endpoint or request.url.path
    log.info("%s: %d %s", where, exc.status, exc.message, extra={"request_id": rid})
    if endpoint is not None:
        server_of(request).observe(endpoint, exc.status, started_at(request))
    return JSONResponse(exc.body(rid), status_code=exc.status, headers=exc.headers)


async def client_gone(request: Request, exc: Exception) -> Response:
    server = server_of(request)
    server.metrics.disconnects.inc()
    endpoint = _endpoint(request)
    if endpoint is not None:
        server.observe(endpoint, 499, started_at(request))
    return Response(status_code=499)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    e = APIError(exc.status_code, str(exc.detail), code=code)
    headers = dict(exc.headers or {})
    return JSONResponse(e.body(request_id_of(request)), exc.status_code, headers=headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    """Anything unforeseen: logged with its traceback, answered without it. (This runs
    outside the request-id middleware, so it sets ``X-Request-Id`` itself.)"""
    rid = request_id_of(request)
    log.exception(
        "internal error on %s %s", request.method, request.url.path, extra={"request_id": rid}
    )
    e = APIError(500, f"internal server error; request id {rid}", type="server_error")
    return JSONResponse(e.body(rid), status_code=500, headers={"X-Request-Id": rid})


def install(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
