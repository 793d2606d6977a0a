"""``omni serve CONFIG``: start the pipeline, then serve it over HTTP (entry point
``serve`` of the ``omni.commands`` group, run by the ``omni`` command)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys

from omni_core.cli import add_backend_args
from omni_core.logs import configure_logging

from omni_serve.settings import MAX_BODY_BYTES, MAX_TIMEOUT_S, ServeSettings, SettingsError

log = logging.getLogger("omni.serve")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(
            f"expected seconds in (0, {MAX_TIMEOUT_S:g}], got {text!r}"
        )
    return value


def parser() -> argparse.ArgumentParser:
    """The command line of ``omni serve`` (``omni serve --help`` prints it)."""
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
        "--request-timeout",
        type=seconds,
        default=None,
        help="the longest a request may run (s); a body's timeout_s may lower it, never "
        "raise it (default: the config's request_timeout_s)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=positive_int,
        default=None,
        help="open requests past which a new one is refused with 429 and Retry-After "
        "(default: the config's max_queued_requests)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name to answer besides localhost, 127.0.0.1 and [::1] (any port; "
        "repeatable; '*': any Host). Bound to a loopback address the server answers only "
        "those (a DNS-rebinding defence); bound elsewhere it checks only when given",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="an origin (https://app.example) whose pages may call the API (repeatable; "
        "default: none, no CORS headers)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=MAX_BODY_BYTES,
        help="request body limit, images as data URLs included; a bigger body is a 413 "
        f"(default: {MAX_BODY_BYTES} = 20 MiB)",
    )
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="let chat image parts give http(s) URLs, which the server fetches (up to "
        "--max-body-bytes each): any URL the server can reach, internal ones included "
        "(default: off, base64 data URLs only)",
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=4096, help="limit of a request's max_tokens"
    )
    p.add_argument(
        "--max-image-pixels", type=positive_int, default=1024 * 1024, help="limit of width x height"
    )
    p.add_argument(
        "--max-images", type=positive_int, default=4, help="limit of an image request's n"
    )
    add_backend_args(p)
    p.add_argument("--log-level", default=None, help="default: $OMNI_LOG_LEVEL or INFO")
    p.add_argument(
        "--log-format", choices=["text", "json"], default=None, help="default: $OMNI_LOG_FORMAT"
    )
    return p


def settings_of(args: argparse.Namespace, model_name: str) -> ServeSettings:
    """The server's settings from the command line (SettingsError when one cannot work)."""
    from omni_serve.middleware import allowed_hosts

    return ServeSettings(
        model_name=args.served_model_name or model_name,
        api_key=args.api_key,  # "" (an empty --api-key or OMNI_API_KEY) is refused
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_tokens=args.max_tokens,
        max_image_pixels=args.max_image_pixels,
        max_images=args.max_images,
        allowed_hosts=allowed_hosts(args.host, args.allowed_host),
        cors_origins=tuple(args.cors_origin),
        allow_remote_images=args.allow_remote_images,
    )


def main(argv: list[str]) -> int:
    """``omni serve`` with ``argv`` (the words after ``serve``): load the config, start
    the pipeline, bind the socket, serve until interrupted; the exit status (2: a config,
    setting or address that cannot work, said on stderr)."""
    args = parser().parse_args(argv)
    configure_logging(args.log_level or os.environ.get("OMNI_LOG_LEVEL") or "INFO", args.log_format)
    # the workers inherit the format (they configure logging from the environment)
    if args.log_format:
        os.environ["OMNI_LOG_FORMAT"] = args.log_format

    import msgspec
    import uvicorn
    from omni_core import Pipeline
    from omni_core.config import ConfigError, load_config

    from omni_serve.app import create_app, endpoints

    try:
        cfg = load_config(args.config).with_backend(args.backend, args.address)
    except ConfigError as e:
        print(f"omni serve: {e}", file=sys.stderr)
        return 2
    if args.max_queued_requests is not None:
        cfg = msgspec.structs.replace(cfg, max_queued_requests=args.max_queued_requests)
    if not cfg.mrs.enabled:
        print(
            "omni serve: the pipeline has mrs.enabled: false (every stage in the caller's "
            "process, one request at a time); serving needs mrs.enabled: true",
            file=sys.stderr,
        )
        return 2
    try:
        settings = settings_of(args, cfg.name)
    except SettingsError as e:
        print(f"omni serve: {e}", file=sys.stderr)
        return 2
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
        hosts = settings.allowed_hosts
        log.info(
            "serving pipeline %r as model %r on http://%s:%d (%s)%s; Host: %s",
            cfg.name,
            settings.model_name,
            shown,
            port,
            ", ".join(endpoints(pipe)) or "no OpenAI endpoint",
            "" if settings.api_key else "; no API key",
            "any" if hosts is None else ", ".join(hosts),
        )
        print(f"omni serve: listening on http://{shown}:{port}", file=sys.stderr, flush=True)
        config = uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    return 0
