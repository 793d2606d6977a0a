"""``omni serve CONFIG``: start the pipeline, then serve it over HTTP (entry point
``serve`` of the ``omni.commands`` group, run by the ``omni`` command)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from omni_core.cli import add_backend_args
from omni_core.logs import configure_logging

log = logging.getLogger("omni.serve")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni serve",
        description="Serve a pipeline over an OpenAI-compatible HTTP API, with a web page "
        "(/), Prometheus metrics (/metrics) and health (/health).",
    )
    p.add_argument("config", help="pipeline YAML file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one; default 8000)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OMNI_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $OMNI_API_KEY)",
    )
    p.add_argument("--served-model-name", help="the model id clients use (default: config name)")
    p.add_argument(
        "--request-timeout", type=float, default=None, help="default per-request timeout (s)"
    )
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit")
    p.add_argument("--max-tokens", type=int, default=4096, help="limit of a request's max_tokens")
    p.add_argument(
        "--max-image-pixels", type=int, default=1024 * 1024, help="limit of width x height"
    )
    p.add_argument("--max-images", type=int, default=4, help="limit of an image request's n")
    add_backend_args(p)
    p.add_argument("--log-level", default=None, help="default: $OMNI_LOG_LEVEL or INFO")
    p.add_argument(
        "--log-format", choices=["text", "json"], default=None, help="default: $OMNI_LOG_FORMAT"
    )
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_level or os.environ.get("OMNI_LOG_LEVEL") or "INFO", args.log_format)
    # the workers inherit the format (they configure logging from the environment)
    if args.log_format:
        os.environ["OMNI_LOG_FORMAT"] = args.log_format

    import uvicorn
    from omni_core import Pipeline
    from omni_core.config import ConfigError, load_config

    from omni_serve.app import ServeSettings, create_app, endpoints

    try:
        cfg = load_config(args.config).with_backend(args.backend, args.address)
    except ConfigError as e:
        print(f"omni serve: {e}", file=sys.stderr)
        return 2
    if not cfg.mrs.enabled:
        print(
            "omni serve: the pipeline has mrs.enabled: false (every stage in the caller's "
            "process, one request at a time); serving needs mrs.enabled: true",
            file=sys.stderr,
        )
        return 2
    settings = ServeSettings(
        model_name=args.served_model_name or cfg.name,
        api_key=args.api_key or None,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_tokens=args.max_tokens,
        max_image_pixels=args.max_image_pixels,
        max_images=args.max_images,
    )
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"omni serve: cannot bind {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    sock.listen(2048)  # connections made before uvicorn runs wait in the backlog
    host, port = sock.getsockname()[:2]
    with Pipeline(cfg) as pipe:
        app = create_app(pipe, settings)
        shown = f"[{host}]" if ":" in host else host
        log.info(
            "serving pipeline %r as model %r on http://%s:%d (%s)%s",
            cfg.name,
            settings.model_name,
            shown,
            port,
            ", ".join(endpoints(pipe)) or "no OpenAI endpoint",
            "" if settings.api_key else "; no API key",
        )
        print(f"omni serve: listening on http://{shown}:{port}", file=sys.stderr, flush=True)
        config = uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    return 0
