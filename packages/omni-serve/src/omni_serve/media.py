"""Chat images on the server: the limits every image part meets before the pipeline sees
it, and remote images (``--allow-remote-images``).

Before any fetch a request's image parts are counted (``--max-chat-images``) and its data
URLs' bytes summed (``--max-image-bytes``, all the request's images together). Each http(s)
URL is then fetched by the server and passed on as a base64 data URL, so no stage ever
touches the network: one redirect hop at a time (at most :data:`MAX_REDIRECTS`), every
host resolved and every address checked at connect time by :class:`GuardedBackend`, which
connects to the very address it checked (the TLS name and ``Host`` stay the URL's), so a
DNS answer cannot change between the check and the connection. Loopback, private,
link-local, site-local, shared, multicast, unspecified, reserved and documentation
addresses, Teredo and the other ranges of :data:`NOT_GLOBAL` (IPv4-mapped, NAT64 and 6to4
IPv6 forms unwrapped) are refused unless ``--remote-images-allow`` names their network.
Each fetch has one total deadline (``--remote-image-timeout``), at most
``--remote-image-concurrency`` run at once in the whole server, and a request's fetches
end with it (a client that goes away cancels them); the wait for a free fetch is inside
that deadline, and host names are resolved by a :class:`Resolver` of their own (daemon
threads, a bounded number of lookups outstanding), so lookups that hang can neither
starve the event loop's default thread pool nor hold the later fetches' lookups. Every
hop's URL is checked before it is requested. Errors say which part and what kind of
failure, never what a host answered. The request's body is no longer held against the
server's body budget while its images are fetched. Last, each image's format (PNG, JPEG,
WebP, GIF or BMP only, :data:`~omni_core.media.IMAGE_INPUT_FORMATS`: Pillow never runs a
decoder such as EPS's Ghostscript) and size are read from its header, off the event loop
in a slot of their own (never the body parsers'; a client's time in both is held to its
fair share, :mod:`omni_serve.fair`), decoding no more of its base64 than the header takes,
within a budget of reads (:data:`MAX_HEADER_READS`: a PNG of a million empty chunks is
parsed chunk by chunk in Python) and of time (:data:`HEADER_BUDGET_S`), and its size held
to ``--max-chat-image-pixels``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import io
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

from fastapi import Request
from omni_core.media import IMAGE_INPUT_FORMATS

from omni_serve.body import off_loop
from omni_serve.errors import APIError, bad_field, server_busy
from omni_serve.fair import client_name
from omni_serve.openai_api import REMOTE
from omni_serve.settings import IPNetwork, ServeSettings
from omni_serve.streams import until_disconnect

log = logging.getLogger("omni.serve")

MAX_REDIRECTS = 3
# reads Pillow may make of one image while it reads the header (a PNG chunk takes two or
# three, a JPEG marker one or two; a common image takes 4 to 40); past it, a 400
MAX_HEADER_READS = 2048
HEADER_BUDGET_S = 1.0  # the wall time one image's header may take to read
DNS_LOOKUPS_PER_SLOT = 8  # host name lookups outstanding at once, per fetch slot
REDIRECTS = {301, 302, 303, 307, 308}
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Not globally reachable, yet ``is_global`` (on some Python version) calls them global:
# refused besides what the address's own flags say, before and after unwrapping.
NOT_GLOBAL: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "100.64.0.0/10",  # shared address space (carrier-grade NAT)
        "192.88.99.0/24",  # 6to4 relay anycast (deprecated, RFC 7526): a local relay
        "::/96",  # IPv4-compatible (deprecated, RFC 4291), :: and ::1 included
        "::ffff:0:0:0/96",  # IPv4-translated (SIIT)
        "64:ff9b:1::/48",  # local-use NAT64 (RFC 8215)
        "2001::/32",  # Teredo: the host behind it is not the address checked
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation (RFC 9637)
        "fec0::/10",  # site-local (deprecated, RFC 3879): routed inside a site alone
    )
)


class RefusedAddress(Exception):
    """A remote image's host resolves to no address the server may connect to."""


class TooBig(Exception):
    """The request's images are over ``--max-image-bytes`` together."""


class ResolverBusy(Exception):
    """The :class:`Resolver` has its limit of lookups outstanding."""


class OverBudget(Exception):
    """An image's header took more reads or time than its budget; says which."""


class BadBase64(Exception):
    """An image's base64, where its header was read, is not valid base64."""


class Resolver:
    """Host names resolved (``socket.getaddrinfo``) in daemon threads of its own: a
    lookup cannot be cancelled, so one that hangs holds its own thread (never a pool's, nor
    the interpreter's exit) until its name server answers; lookups of the same host and
    port in flight share one thread; with ``limit`` outstanding a new one is refused at
    once (:class:`ResolverBusy`) rather than queued behind those that hang."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.pending: dict[tuple[str, int], asyncio.Future[Any]] = {}
        self.started = 0

    async def resolve(self, host: str, port: int) -> list[Any]:
        """``getaddrinfo(host, port)`` for a stream socket; its OSError or UnicodeError
        as raised; a cancelled wait leaves the lookup to finish on its own."""
        loop = asyncio.get_running_loop()
        key = (host, port)
        with self.lock:
            future = self.pending.get(key)
            if future is None or future.get_loop() is not loop:
                if len(self.pending) >= self.limit:
                    raise ResolverBusy
                future = loop.create_future()
                future.add_done_callback(_retrieve)
                self.pending[key] = future
                self.started += 1
                name = f"omni-dns-{self.started}"
                threading.Thread(
                    target=self._lookup, args=(key, future), name=name, daemon=True
                ).start()
        return await asyncio.shield(future)  # type: ignore[no-any-return]

    def _lookup(self, key: tuple[str, int], future: asyncio.Future[Any]) -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = socket.getaddrinfo(*key, type=socket.SOCK_STREAM)
        except BaseException as e:  # handed to the waiters
            error = e
        with self.lock:
            if self.pending.get(key) is future:
                del self.pending[key]
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            future.get_loop().call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a lookup's error as seen (every waiter may have gone at its deadline)."""
    if not future.cancelled():
        future.exception()


def _unwrap(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one stands for (mapped, NAT64, 6to4), else ``ip``."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if ip.sixtofour is not None:
            return ip.sixtofour
    return ip


def address_allowed(ip: IPAddress, allow: Sequence[IPNetwork] = ()) -> bool:
    """Whether a remote image may be fetched from ``ip``: a public unicast address (none
    of :data:`NOT_GLOBAL`, an IPv6 form of an IPv4 address judged by that address), or one
    inside a network of ``allow`` (``--remote-images-allow``)."""
    if any(a.version == n.version and a in n for a in (ip, _unwrap(ip)) for n in allow):
        return True
    inner = _unwrap(ip)
    if any(a.version == n.version and a in n for a in (ip, inner) for n in NOT_GLOBAL):
        return False
    internal = (
        inner.is_private
        or inner.is_loopback
        or inner.is_link_local
        or inner.is_multicast
        or inner.is_unspecified
        or inner.is_reserved
        or not inner.is_global
    )
    return not internal


class GuardedBackend:
    """An httpcore network backend that resolves each host itself (in ``dns``) and
    connects only to an address :func:`address_allowed` passes: the address checked is
    the address connected to. A name that cannot be resolved (or encoded: a label over
    63 characters) is an ``httpcore.ConnectError``."""

    def __init__(self, allow: Sequence[IPNetwork], dns: Resolver) -> None:
        import httpcore

        self.allow = tuple(allow)
        self.dns = dns
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> Any:
        import httpcore

        try:
            infos = await self.dns.resolve(host, port)
        except (OSError, UnicodeError) as e:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {e}") from None
        ips = dict.fromkeys(ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos)
        good = [ip for ip in ips if address_allowed(ip, self.allow)]
        if not good:
            raise RefusedAddress(f"{host} resolves to no allowed address")
        error: Exception = httpcore.ConnectError(f"cannot connect to {host}")
        for ip in good:
            try:
                return await self.inner.connect_tcp(
                    str(ip), port, timeout, local_address, socket_options
                )
            except httpcore.ConnectError as e:
                error = e
        raise error

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> Any:
        raise RefusedAddress("unix sockets are never connected to")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


@dataclass
class RemoteImages:
    """The server's fetching of remote images: its limits, the semaphore that bounds
    the fetches running at once across all requests, and the :class:`Resolver` their
    host names are resolved by (:data:`DNS_LOOKUPS_PER_SLOT` lookups outstanding per
    fetch slot)."""

    allow: tuple[IPNetwork, ...]
    timeout_s: float
    concurrency: int
    slots: asyncio.Semaphore = field(init=False)
    dns: Resolver = field(init=False)

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.concurrency)
        self.dns = Resolver(DNS_LOOKUPS_PER_SLOT * self.concurrency)


def remote_images(request: Request, settings: ServeSettings) -> RemoteImages:
    """The app's :class:`RemoteImages` (made on first use, on the server's loop)."""
    state = request.app.state
    fetcher = getattr(state, "remote_images", None)
    if fetcher is None:
        fetcher = RemoteImages(
            settings.remote_images_allow,
            settings.remote_image_timeout_s,
            settings.remote_image_concurrency,
        )
        state.remote_images = fetcher
    return fetcher


def image_parts(request: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(``messages[i].content[j].image_url``, the part's ``image_url``) of each image
    part of a pipeline request."""
    out = []
    for i, m in enumerate(request.get("messages") or []):
        if isinstance(m["content"], list):
            for j, part in enumerate(m["content"]):
                if part["type"] == "image_url":
                    out.append((f"messages[{i}].content[{j}].image_url", part["image_url"]))
    return out


def remote_parts(request: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """:func:`image_parts` whose URL is http(s)."""
    return [(w, p) for w, p in image_parts(request) if p["url"].startswith(REMOTE)]


async def check_images(request: Request, preq: dict[str, Any], settings: ServeSettings) -> None:
    """Every check of a chat request's images (see the module), in place: remote URLs
    become data URLs; a 400 names the first part that fails. The client going away
    cancels the fetches (:class:`~omni_serve.streams.ClientGone`)."""
    parts = image_parts(preq)
    if not parts:
        return
    if len(parts) > settings.max_chat_images:
        raise bad_field(
            "messages",
            f"{len(parts)} images, over this server's limit of {settings.max_chat_images} "
            "(--max-chat-images)",
        )
    inline = sum(len(p["url"]) * 3 // 4 for _, p in parts if not p["url"].startswith(REMOTE))
    if inline > settings.max_image_bytes:
        raise bad_field(
            "messages",
            f"the request's images are over {settings.max_image_bytes} bytes together "
            "(--max-image-bytes)",
        )
    fetched = {where for where, _ in remote_parts(preq)}
    if settings.allow_remote_images and fetched:
        fetcher = remote_images(request, settings)
        budget = settings.max_image_bytes - inline
        await until_disconnect(request, fetch_remote(preq, fetcher, budget))
    size = sum(len(p["url"]) for _, p in parts)
    check = functools.partial(check_pixels, parts, settings.max_chat_image_pixels, fetched)
    slot = request.app.state.server.image_headers.hold(client_name(request))
    await off_loop(request, size, check, slot)


B64_PIECE = 1 << 18  # base64 characters decoded at once (a multiple of 4): about 1 ms
B64_FIRST = 1 << 12  # base64 characters decoded for a header's first read (3 KB of image)


def _b64_pieces(data: str, start: int, end: int) -> list[bytes]:
    """``data[start:end]`` (both multiples of 4) decoded strictly (padding only at the
    very end of ``data``), :data:`B64_PIECE` characters at a time: one call over
    megabytes holds the GIL for tens of ms, and every other request's thread waits
    behind it; between pieces they run."""
    out = []
    for i in range(start, end, B64_PIECE):
        j = min(i + B64_PIECE, end)
        if j < len(data) and data[j - 1] == "=":
            raise binascii.Error("base64 padding before the end")
        out.append(binascii.a2b_base64(data[i:j], strict_mode=True))
    return out


class _Budgeted(io.RawIOBase):
    """An image for Pillow to read its header from, refused (:class:`OverBudget`) past
    :data:`MAX_HEADER_READS` reads or its ``deadline`` (``time.monotonic()``). Given
    base64 (a data URL's), it decodes only as far as Pillow reads (a header is some
    kilobytes at the start of megabytes), the decoded part at least doubling each time:
    a chunk bomb costs what its header budget allows, never the decoding of the rest.
    The base64 is ``image[start:]`` (a data URL's past its comma: never copied); where it
    is read it must be valid, else :class:`BadBase64`."""

    def __init__(self, image: bytes | str, deadline: float, start: int = 0) -> None:
        super().__init__()
        self.reads = 0
        self.deadline = deadline
        self.pos = 0
        self.b64 = image if isinstance(image, str) else ""
        self.start = self.done = start if self.b64 else 0  # where it begins, is decoded to
        self.buf = bytearray() if isinstance(image, str) else bytearray(image)
        if (len(self.b64) - start) % 4:
            raise BadBase64("not a multiple of 4 characters long")

    def _have(self, end: int | None) -> None:
        """Decode until ``buf`` holds ``end`` bytes (None: all) or the base64 ends."""
        size = len(self.b64)
        if self.done == size or end is not None and end <= len(self.buf):
            return
        need = size - self.start if end is None else -(-end // 3) * 4  # characters for `end`
        more = max(need, 2 * (self.done - self.start), B64_FIRST)  # at least doubling
        upto = min(size, self.start + more)
        try:
            self.buf += b"".join(_b64_pieces(self.b64, self.done, upto))
        except (binascii.Error, ValueError) as e:  # ValueError: not ASCII
            raise BadBase64(str(e)) from None
        self.done = upto

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            self._have(None)
            offset += len(self.buf)
        elif whence == io.SEEK_CUR:
            offset += self.pos
        if offset < 0:
            raise ValueError(f"negative seek position {offset}")
        self.pos = offset
        return offset

    def read(self, size: int | None = -1) -> bytes:
        self.reads += 1
        if self.reads > MAX_HEADER_READS:
            raise OverBudget(
                f"its header is over this server's budget of {MAX_HEADER_READS} reads "
                "(chunks or markers before the pixels)"
            )
        if time.monotonic() > self.deadline:
            raise OverBudget(f"its header took over {HEADER_BUDGET_S:g} s to read")
        end = None if size is None or size < 0 else self.pos + size
        self._have(end)
        out = bytes(self.buf[self.pos : end])
        self.pos += len(out)
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def image_size(image: bytes | str, start: int = 0) -> tuple[int, int]:
    """(width, height) of an image of :data:`~omni_core.media.IMAGE_INPUT_FORMATS` (its
    bytes, or their base64 as ``image[start:]``: decoded only as far as the header goes)
    from its header, within :data:`MAX_HEADER_READS` reads and :data:`HEADER_BUDGET_S`
    (:class:`OverBudget` past them); Pillow's error where it is not such an image,
    :class:`BadBase64` where the base64 read is not valid."""
    from PIL import Image

    stream = _Budgeted(image, time.monotonic() + HEADER_BUDGET_S, start)
    with Image.open(stream, formats=IMAGE_INPUT_FORMATS) as img:
        return img.size


def check_pixels(
    parts: list[tuple[str, dict[str, Any]]], max_pixels: int, fetched: set[str]
) -> None:
    """Each data URL image's width x height, from its header, at most ``max_pixels``
    (``--max-chat-image-pixels``); nothing but the header is decoded (of the base64 too),
    and only the formats of :data:`~omni_core.media.IMAGE_INPUT_FORMATS` are opened. A
    ``fetched`` part that is none of them is refused here; an inline one is left to the
    intake, which names what is wrong with it (its base64 too). A header over its budget
    (:func:`image_size`) is a 400."""
    from PIL import Image

    for where, part in parts:
        url = part["url"]
        comma = url.find(",")  # the end of its head; its base64 is never copied
        if comma < 0 or not url.endswith(";base64", 0, comma):
            continue  # the intake names what is wrong with it
        try:
            w, h = image_size(url, comma + 1)
        except BadBase64:
            continue
        except OverBudget as e:
            raise bad_field(where, f"image refused: {e}") from None
        except Image.DecompressionBombError:
            w, h = max_pixels + 1, 1
        except Exception:  # not an image
            if where in fetched:
                raise _failed(where, "what it answered is not an image") from None
            continue  # the intake answers "cannot decode image"
        if w * h > max_pixels:
            raise bad_field(
                where,
                f"image of {w}x{h} pixels, over this server's limit of {max_pixels} "
                "(--max-chat-image-pixels)",
            )


@dataclass
class _Budget:
    left: int  # bytes the request's fetched images may still take
    limit: int

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise TooBig


async def fetch_remote(request: dict[str, Any], fetcher: RemoteImages, max_bytes: int) -> None:
    """Replace, in place, each http(s) image URL of ``request`` by a data URL of what it
    answers; the fetched images take at most ``max_bytes`` together. A URL that cannot
    be fetched is a 400 naming the part and the kind of failure only; the others are
    cancelled then, as all are when this is."""
    import httpcore

    parts = remote_parts(request)
    budget = _Budget(max_bytes, max_bytes)
    async with httpcore.AsyncConnectionPool(
        network_backend=GuardedBackend(fetcher.allow, fetcher.dns),  # type: ignore[arg-type]
        max_connections=len(parts),
    ) as pool:
        tasks = [
            asyncio.ensure_future(_fetch(pool, fetcher, where, p["url"], budget))
            for where, p in parts
        ]
        try:
            urls = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    for (_, part), url in zip(parts, urls, strict=True):
        part["url"] = url


def _failed(where: str, kind: str) -> APIError:
    return bad_field(where, f"could not fetch the image: {kind}")


def _check_url(where: str, url: str) -> None:
    """A 400 naming ``where`` unless ``url`` (the part's, or a redirect's) is an http(s)
    URL with a host that httpcore can request: ASCII, a port in range, brackets closed."""
    import httpcore

    try:
        parts = urlsplit(url)
        _ = parts.port  # ValueError when out of range
        httpcore.URL(url)  # TypeError for non-ASCII
    except (ValueError, TypeError, UnicodeError):
        raise _failed(where, "not a valid http(s) URL") from None
    if parts.scheme not in ("http", "https"):
        raise _failed(where, "a redirect to a URL that is not http(s)")
    if not parts.hostname:
        raise _failed(where, "not a valid http(s) URL (no host)")


async def _fetch(pool: Any, fetcher: RemoteImages, where: str, url: str, budget: _Budget) -> str:
    """One part's fetch, its wait for a slot included in its deadline."""
    import httpcore

    try:
        async with asyncio.timeout(fetcher.timeout_s):
            async with fetcher.slots:
                mime, data = await _get(pool, where, url, budget, fetcher.timeout_s)
    except TimeoutError:
        raise _failed(
            where, f"no complete answer within {fetcher.timeout_s:g} s (--remote-image-timeout)"
        ) from None
    except ResolverBusy:
        raise server_busy(
            f"could not fetch the image at {where}: the server's host name lookups are all busy"
        ) from None
    except RefusedAddress:
        raise _failed(
            where,
            "the address is refused (loopback, private, link-local or another internal "
            "address; an operator can allow networks with --remote-images-allow)",
        ) from None
    except TooBig:
        raise _failed(
            where,
            f"the request's images are over {budget.limit} bytes together (--max-image-bytes)",
        ) from None
    except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError) as e:
        log.info("remote image at %s: %s: %s", where, type(e).__name__, e)
        raise _failed(where, "the connection failed") from None
    except httpcore.UnsupportedProtocol:
        raise _failed(where, "a redirect to a URL that is not http(s)") from None
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def _get(
    pool: Any, where: str, url: str, budget: _Budget, timeout_s: float
) -> tuple[str, bytes]:
    """(MIME type, body) of ``url``, redirects followed one hop at a time."""
    timeouts = {"connect": timeout_s, "read": timeout_s, "write": timeout_s, "pool": timeout_s}
    for _ in range(MAX_REDIRECTS + 1):
        _check_url(where, url)
        headers = [(b"Accept", b"image/*"), (b"User-Agent", b"omni-serve")]
        async with pool.stream("GET", url, headers=headers, extensions={"timeout": timeouts}) as r:
            got = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in r.headers}
            if r.status in REDIRECTS and "location" in got:
                try:
                    url = urljoin(url, got["location"])
                except ValueError:  # a broken IPv6 host ("http://[::1")
                    raise _failed(where, "a redirect to a URL that is not valid") from None
                continue
            if r.status != 200:
                raise _failed(where, f"HTTP {r.status // 100}xx")
            length = got.get("content-length", "")
            if length.isdigit() and int(length) > budget.left:
                raise TooBig  # before a byte of the body is read
            data = bytearray()
            async for chunk in r.aiter_stream():
                budget.take(len(chunk))
                data += chunk
            mime = got.get("content-type", "").split(";")[0].strip().lower()
            return (mime if mime.startswith("image/") else "application/octet-stream"), bytes(data)
    raise _failed(where, f"more than {MAX_REDIRECTS} redirects")
