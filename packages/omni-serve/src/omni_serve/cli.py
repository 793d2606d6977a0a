"""``omni serve CONFIG``: start the pipeline, then serve it over HTTP (entry point
``serve`` of the ``omni.commands`` group, run by the ``omni`` command)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import stat
import sys

from omni_core.cli import add_backend_args
from omni_core.observability.logs import configure_logging

from omni_serve.connections import (
    FD_RESERVE,
    ConnectionLimits,
    connection_cap,
    protocol_class,
    raise_fd_limit,
)
from omni_serve.fair import GIL_SWITCH_S
from omni_serve.keys import ApiKey, KeysFileError, load_keys_file
from omni_serve.settings import (
    BODIES_IN_FLIGHT,
    BODY_WORK_SHARE,
    MAX_BODY_BYTES,
    MAX_CHAT_IMAGE_PIXELS,
    MAX_N,
    MAX_TIMEOUT_S,
    IPNetwork,
    ServeSettings,
    SettingsError,
    networks,
)

log = logging.getLogger("omni.serve")
KEY_ENV = "OMNI_API_KEY"
# after the re-execution without $OMNI_API_KEY: the number of the memfd holding the key
KEY_FD_ENV = "OMNI_SERVE_KEY_FD"
KEY_MEMFD = "omni-api-key"  # the memfd's name (/proc/self/fd/N -> /memfd:omni-api-key)
MAX_CONNECTIONS = 1024
PER_ADDRESS = 64  # --max-connections-per-address with a keys file, unless given


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


def cidrs(text: str) -> tuple[IPNetwork, ...]:
    try:
        return networks(text)
    except SettingsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health's status "
        "(default: $OMNI_API_KEY). Visible to every local user in ps: prefer "
        "$OMNI_API_KEY or --api-key-file",
    )
    key.add_argument(
        "--api-key-file",
        metavar="PATH",
        default=None,
        help="the API key as the first line of a file (keep it mode 0600)",
    )
    key.add_argument(
        "--api-keys-file",
        metavar="PATH",
        default=None,
        help="several named API keys, each with its own limits (max_connections, "
        "max_inflight, max_queued, best_priority), as a .toml or .json file of mode "
        "0600; see docs/security.md",
    )
    p.add_argument(
        "--max-connections-per-address",
        type=positive_int,
        default=None,
        help="connections one client address may hold before a request on them carries "
        f"a valid key; one more is answered 429 and closed (default: {PER_ADDRESS} with "
        "--api-keys-file, else none)",
    )
    p.add_argument(
        "--max-running-requests",
        type=positive_int,
        default=None,
        help="pipeline requests running at once, shared fairly between the keys of "
        "--api-keys-file: past it a request waits (in its key's max_queued), and the key "
        "with the fewest running goes next (default: no cap); see docs/security.md",
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
        "--body-work-share",
        type=float,
        default=BODY_WORK_SHARE,
        help="the share of the server's time one client's heavy body work (parsing big "
        "bodies, reading image headers) may take, paced; past it its next big body waits, "
        f"unread (default: {BODY_WORK_SHARE}; 1: all of it)",
    )
    p.add_argument(
        "--max-body-bytes-in-flight",
        type=positive_int,
        default=None,
        help="bytes of request bodies held at once in the whole server; a body that does "
        "not fit is a 503 with Retry-After (default: "
        f"{BODIES_IN_FLIGHT} x --max-body-bytes)",
    )
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="let chat image parts give http(s) URLs, which the server fetches: public "
        "addresses only, checked at every redirect (default: off, base64 data URLs only)",
    )
    p.add_argument(
        "--remote-images-allow",
        action="append",
        default=[],
        type=cidrs,
        metavar="CIDR[,CIDR...]",
        help="networks remote images may come from although internal (loopback, private, "
        "link-local...; repeatable; default: none)",
    )
    p.add_argument(
        "--remote-image-timeout",
        type=seconds,
        default=10.0,
        help="the whole of one remote image's fetch, redirects and body included (s; default: 10)",
    )
    p.add_argument(
        "--remote-image-concurrency",
        type=positive_int,
        default=8,
        help="remote image fetches at once in the whole server (default: 8)",
    )
    p.add_argument(
        "--max-chat-images",
        type=positive_int,
        default=4,
        help="image parts in one chat request (default: 4)",
    )
    p.add_argument(
        "--max-image-bytes",
        type=positive_int,
        default=10 << 20,
        help="encoded bytes of one chat request's images together, data URLs and fetched "
        "(default: 10485760 = 10 MiB)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=positive_int,
        default=1024 * 1024,
        help="limit of width x height of a generated image (default: 1048576)",
    )
    p.add_argument(
        "--max-chat-image-pixels",
        type=positive_int,
        default=MAX_CHAT_IMAGE_PIXELS,
        help="limit of width x height of a chat image, read from its header before it is "
        f"decoded (default: {MAX_CHAT_IMAGE_PIXELS})",
    )
    p.add_argument(
        "--max-images", type=positive_int, default=4, help="limit of an image request's n"
    )
    p.add_argument(
        "--max-n",
        type=positive_int,
        default=MAX_N,
        help=f"limit of a chat or completion request's n (choices; default: {MAX_N})",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=None,
        help="open connections past which a request is answered 503; at most the open "
        f"file limit (raised to its hard limit at start) less {FD_RESERVE} (default: "
        f"{MAX_CONNECTIONS}, lowered to fit)",
    )
    p.add_argument(
        "--max-header-bytes",
        type=positive_int,
        default=32 << 10,
        help="the largest request head; a bigger one is a 431 (default: 32768)",
    )
    p.add_argument(
        "--header-timeout",
        type=seconds,
        default=10.0,
        help="a request's headers must arrive within this of its first byte, else 408 "
        "and the connection closed (default: 10 s)",
    )
    p.add_argument(
        "--body-timeout",
        type=seconds,
        default=30.0,
        help="a request's body must arrive within this of its headers, else the "
        "connection is closed (default: 30 s)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=seconds,
        default=5.0,
        help="an idle kept-alive connection is closed after this (default: 5 s)",
    )
    add_backend_args(p)
    p.add_argument("--log-level", default=None, help="default: $OMNI_LOG_LEVEL or INFO")
    p.add_argument(
        "--log-format", choices=["text", "json"], default=None, help="default: $OMNI_LOG_FORMAT"
    )
    return p


def reexec_without_key(argv: list[str]) -> None:
    """When ``$OMNI_API_KEY`` is set and this process is ``omni serve ARGV``, execute the
    same command again (same pid) with the key out of its environment: the key goes in an
    anonymous memfd, inherited, whose number is in ``$OMNI_SERVE_KEY_FD``. Taking it out
    of ``os.environ`` is not enough: ``/proc/PID/environ`` shows the environment the
    process was started with. Returns (the key stays in the environment, said on stderr)
    where the command cannot be executed again."""
    key = os.environb.get(KEY_ENV.encode())
    if key is None or sys.argv[1:] != ["serve", *argv]:  # not the command (called in-process)
        return
    fd = os.memfd_create(KEY_MEMFD)
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(key)
        os.set_inheritable(fd, True)
        env = {k: v for k, v in os.environb.items() if k != KEY_ENV.encode()}
        env[KEY_FD_ENV.encode()] = str(fd).encode()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as e:
        os.close(fd)
        print(
            f"omni serve: cannot start again without ${KEY_ENV} in the environment ({e}); "
            f"/proc/{os.getpid()}/environ keeps it: prefer --api-key-file",
            file=sys.stderr,
        )


def key_from_environment() -> str | None:
    """The key ``$OMNI_API_KEY`` gave, taken out of ``os.environ`` so that no worker
    (spawned, or forked from the zygote) inherits it: after :func:`reexec_without_key`,
    read from the memfd ``$OMNI_SERVE_KEY_FD`` names, which is then closed; else the
    variable itself. SettingsError when that fd is not the key's memfd."""
    from_env = os.environ.pop(KEY_ENV, None)
    number = os.environ.pop(KEY_FD_ENV, None)
    if number is None:
        return from_env
    try:
        fd = int(number)
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{KEY_MEMFD} "):
            raise OSError("not the key's memfd")
        with open(fd, "rb") as f:  # closes it
            f.seek(0)  # the writer's offset is shared: at the end
            return os.fsdecode(f.read())
    except (ValueError, OSError) as e:
        raise SettingsError(f"${KEY_FD_ENV}={number!r}: {e}") from None


def api_key_of(args: argparse.Namespace) -> str | None:
    """The API key: ``--api-key``, else ``--api-key-file``'s first line, else
    ``$OMNI_API_KEY`` (:func:`key_from_environment`). SettingsError when the file cannot
    be read."""
    from_env = key_from_environment()
    if args.api_key is not None:
        return str(args.api_key)
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                mode = os.fstat(f.fileno()).st_mode
                key = f.readline(4096).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise SettingsError(f"--api-key-file {args.api_key_file}: {e}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(
                "--api-key-file %s is mode %o: other users may read the key; chmod 600 it",
                args.api_key_file,
                stat.S_IMODE(mode),
            )
        return key
    return from_env


def api_keys_of(args: argparse.Namespace) -> tuple[ApiKey, ...]:
    """The keys of ``--api-keys-file`` (none without it); SettingsError names what is
    wrong with the file. ``$OMNI_API_KEY`` is then ignored (said in the log)."""
    if args.api_keys_file is None:
        return ()
    if key_from_environment() is not None:
        log.warning("$%s is ignored: --api-keys-file gives the keys", KEY_ENV)
    try:
        return load_keys_file(args.api_keys_file)
    except KeysFileError as e:
        raise SettingsError(f"--api-keys-file {e}") from None


def settings_of(
    args: argparse.Namespace, model_name: str, fd_limit: int | None = None
) -> ServeSettings:
    """The server's settings from the command line (SettingsError when one cannot work);
    ``--max-connections`` fitted to the open file limit ``fd_limit`` (None: not checked)."""
    from omni_serve.middleware import allowed_hosts

    max_connections = args.max_connections or MAX_CONNECTIONS
    if fd_limit is not None:
        try:
            max_connections = connection_cap(args.max_connections, MAX_CONNECTIONS, fd_limit)
        except ValueError as e:
            raise SettingsError(str(e)) from None
    keys = api_keys_of(args)
    per_address = args.max_connections_per_address or (PER_ADDRESS if keys else None)
    return ServeSettings(
        model_name=args.served_model_name or model_name,
        # "" (an empty flag, file or variable) is refused
        api_key=None if keys else api_key_of(args),
        api_keys=keys,
        max_connections_per_address=per_address,
        max_running_requests=args.max_running_requests,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
        body_work_share=args.body_work_share,
        max_image_pixels=args.max_image_pixels,
        max_chat_image_pixels=args.max_chat_image_pixels,
        max_images=args.max_images,
        max_n=args.max_n,
        allowed_hosts=allowed_hosts(args.host, args.allowed_host),
        cors_origins=tuple(args.cors_origin),
        allow_remote_images=args.allow_remote_images,
        remote_images_allow=tuple(n for spec in args.remote_images_allow for n in spec),
        remote_image_timeout_s=args.remote_image_timeout,
        remote_image_concurrency=args.remote_image_concurrency,
        max_chat_images=args.max_chat_images,
        max_image_bytes=args.max_image_bytes,
        max_connections=max_connections,
        max_header_bytes=args.max_header_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
    )


def key_summary(settings: ServeSettings) -> str:
    """The keys as the start's log line says them: their names, never the keys."""
    if settings.api_keys:
        return f"; API keys {', '.join(k.name for k in settings.api_keys)}"
    return "" if settings.api_key else "; no API key"


def main(argv: list[str]) -> int:
    """``omni serve`` with ``argv`` (the words after ``serve``): load the config, start
    the pipeline, bind the socket, serve until interrupted; the exit status (2: a config,
    setting or address that cannot work, said on stderr)."""
    args = parser().parse_args(argv)
    reexec_without_key(argv)
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
        # before the pipeline starts: its workers inherit the raised limit
        settings = settings_of(args, cfg.name, raise_fd_limit())
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
    sys.setswitchinterval(GIL_SWITCH_S)  # the event loop waits less for a body's thread
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
            key_summary(settings),
            "any" if hosts is None else ", ".join(hosts),
        )
        print(f"omni serve: listening on http://{shown}:{port}", file=sys.stderr, flush=True)
        limits = ConnectionLimits(
            settings.header_timeout_s, settings.body_timeout_s, settings.max_header_bytes
        )
        config = uvicorn.Config(
            app,
            http=protocol_class(limits, app.state.server.shares),  # type: ignore[arg-type]
            limit_concurrency=settings.max_connections,
            timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        uvicorn.Server(config).run(sockets=[sock])
    return 0
