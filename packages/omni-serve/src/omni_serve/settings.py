"""What ``omni serve`` lets an operator set (the defaults are the safe ones), checked once
at startup: a setting that cannot work is an error there, never a quiet default."""

from __future__ import annotations

import functools
import ipaddress
import math
from dataclasses import dataclass, field

from omni_serve.fair import SHARE as BODY_WORK_SHARE
from omni_serve.keys import SINGLE_KEY_NAME, ApiKey

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a timeout past a week is a mistake, not a wish
# room for a chat with a few images as base64 data URLs (4/3 of their encoded size)
MAX_BODY_BYTES = 20 << 20
BODIES_IN_FLIGHT = 4  # the default server-wide budget of bodies: this many of the largest
MAX_CHAT_IMAGE_PIXELS = 16_000_000  # as the multimodal intake's max_image_pixels
MAX_N = 16  # choices of one text request (n)


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class SettingsError(ValueError):
    """A setting ``omni serve`` cannot start with."""


def networks(spec: str) -> tuple[IPNetwork, ...]:
    """``CIDR[,CIDR...]`` (``--remote-images-allow``) as networks; SettingsError names a
    bad one."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise SettingsError(f"expected a CIDR network (10.0.0.0/8), got {item!r}") from None
    return tuple(out)


def check_timeout(value: float | None, what: str) -> None:
    """``value`` is None or a finite number of seconds in (0, MAX_TIMEOUT_S]."""
    if value is None:
        return
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise SettingsError(f"{what}: expected 0 < seconds <= {MAX_TIMEOUT_S:g}, got {value}")


@dataclass
class ServeSettings:
    """The server's settings; ``ServeSettings(...)`` refuses ones that cannot work."""

    model_name: str
    """The model name the OpenAI endpoints answer to and ``/v1/models`` lists."""
    api_key: str | None = field(default=None, repr=False)
    """Every endpoint but ``/health`` (and the page) needs it as ``Authorization:
    Bearer KEY``; None: no key (or ``api_keys``). It is the one key named ``default``,
    with no limits of its own."""
    api_keys: tuple[ApiKey, ...] = field(default=(), repr=False)
    """Several named keys, each with its share (``--api-keys-file``; see
    ``omni_serve.keys``); not with ``api_key``."""
    max_connections_per_address: int | None = None
    """Connections one address may hold before a key is known on them (past it: 429 and
    closed, see ``omni_serve.shares``); None: no cap."""
    max_running_requests: int | None = None
    """Pipeline requests running at once, shared fairly between the keys of
    ``api_keys`` (past it a request waits its key's turn, see ``omni_serve.shares``);
    None: no cap."""
    request_timeout_s: float | None = None
    """The cap of a request's timeout: a body's ``timeout_s`` may lower it, never raise
    it (None: the pipeline config's ``request_timeout_s``)."""
    max_body_bytes: int = MAX_BODY_BYTES
    """The largest request body."""
    max_body_bytes_in_flight: int | None = None
    """Bytes of request bodies held at once in the whole server (past it: 503 with
    ``Retry-After``); None: ``BODIES_IN_FLIGHT`` x ``max_body_bytes``."""
    body_work_share: float = BODY_WORK_SHARE
    """The share of the server's time one client's heavy body work (parsing big bodies,
    reading image headers) may take, paced: past ``omni_serve.fair.BURST_S`` seconds of
    it owed, the client's next big body waits, unread (``omni_serve.fair``)."""
    max_image_pixels: int = 1024 * 1024
    """The largest image (width x height) an image request may ask for (``size``)."""
    max_chat_image_pixels: int = MAX_CHAT_IMAGE_PIXELS
    """The largest chat image (width x height, read from its header)."""
    max_images: int = 4
    """The most images one image request may ask for (``n``)."""
    max_n: int = MAX_N
    """The most choices one chat or completion request may ask for (``n``: that many
    pipeline requests, each counted against the client's share)."""
    allowed_hosts: tuple[str, ...] | None = None
    """``Host`` header names answered (any port); None: every ``Host`` (see
    ``omni_serve.middleware``)."""
    cors_origins: tuple[str, ...] = ()
    """Origins a browser may call from (none: no CORS headers at all)."""
    allow_remote_images: bool = False
    """Chat image parts with http(s) URLs are fetched by the server (off: only data
    URLs)."""
    remote_images_allow: tuple[IPNetwork | str, ...] = ()
    """Networks remote images may come from although they are internal (loopback,
    private, link-local...: refused otherwise); CIDR strings are parsed."""
    remote_image_timeout_s: float = 10.0
    """The whole of one remote image's fetch (connect, redirects, body)."""
    remote_image_concurrency: int = 8
    """Remote image fetches running at once in the whole server (the others wait)."""
    max_chat_images: int = 4
    """Image parts in one chat request."""
    max_image_bytes: int = 10 << 20
    """Encoded bytes of one chat request's images together (data URLs and fetched)."""
    max_connections: int = 1024
    """Open connections (and requests) past which uvicorn answers 503."""
    max_header_bytes: int = 32 << 10
    """The largest request head (request line and headers); past it: 431."""
    header_timeout_s: float = 10.0
    """A request's head must arrive within this of its first byte (else 408, closed)."""
    body_timeout_s: float = 30.0
    """A request's body must arrive within this of its head (else the connection is
    closed): 20 MiB needs some 700 KB/s."""
    keep_alive_timeout_s: float = 5.0
    """An idle kept-alive connection is closed after this."""

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise SettingsError(
                "the API key is empty (an empty --api-key or OMNI_API_KEY would leave the "
                "server open while looking guarded): set a key, or unset OMNI_API_KEY"
            )
        if self.api_key is not None and self.api_keys:
            raise SettingsError("one key (--api-key, --api-key-file) or a keys file, not both")
        if self.max_connections_per_address is not None and self.max_connections_per_address < 1:
            raise SettingsError("max_connections_per_address: expected a positive number")
        if self.max_running_requests is not None:
            if self.max_running_requests < 1:
                raise SettingsError("max_running_requests: expected a positive number")
            if not self.api_keys:
                raise SettingsError(
                    "--max-running-requests shares the running requests between the keys "
                    "of --api-keys-file: give one"
                )
        check_timeout(self.request_timeout_s, "--request-timeout")
        check_timeout(self.header_timeout_s, "--header-timeout")
        check_timeout(self.body_timeout_s, "--body-timeout")
        check_timeout(self.keep_alive_timeout_s, "--keep-alive-timeout")
        check_timeout(self.remote_image_timeout_s, "--remote-image-timeout")
        self.remote_images_allow = tuple(
            n
            for item in self.remote_images_allow
            for n in (networks(item) if isinstance(item, str) else (item,))
        )
        if not 0 < self.body_work_share <= 1:
            raise ValueError(f"--body-work-share {self.body_work_share}: expected (0, 1]")
        if self.max_body_bytes_in_flight is None:
            self.max_body_bytes_in_flight = BODIES_IN_FLIGHT * self.max_body_bytes
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise SettingsError(
                f"--max-body-bytes-in-flight ({self.max_body_bytes_in_flight}) is below "
                f"--max-body-bytes ({self.max_body_bytes}): no body of the largest size "
                "could ever be read"
            )
        for name in (
            "remote_image_concurrency",
            "max_chat_images",
            "max_image_bytes",
            "max_body_bytes",
            "max_image_pixels",
            "max_chat_image_pixels",
            "max_images",
            "max_n",
            "max_connections",
            "max_header_bytes",
        ):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name}: expected a positive number")

    @functools.cached_property
    def keys(self) -> tuple[ApiKey, ...]:
        """The keys a request may carry (none: the server is open)."""
        if self.api_key is not None:
            return (ApiKey(SINGLE_KEY_NAME, self.api_key),)
        return self.api_keys
