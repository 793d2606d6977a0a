"""Request bodies: JSON only, bounded in size and depth, and holding only values every
stage can carry. Anything else is a 4xx here, naming the field, before the request
reaches the pipeline (where it would be a 500 or 503 from a serializer).

Refused: a ``Content-Type`` other than ``application/json`` (415), a body over the size
limit (413), bodies that are not UTF-8 JSON, nesting deeper than :data:`MAX_DEPTH`,
integers outside 64 bits, non-finite numbers (``NaN``, ``Infinity`` and ``1e400``, which
Python's ``json`` accepts) and strings with lone surrogates (``"\\ud800"``).

No body holds the event loop: a body of more than :data:`INLINE_BYTES` is parsed and
checked (and turned into the pipeline request) in a worker thread, one at a time, each
client within its fair share of that work (:mod:`omni_serve.fair`: one past it waits
before its next big body is read), and a body of more than :data:`MAX_VALUES` JSON
values is refused before it is parsed, which bounds both the time a parse holds the GIL
(msgspec, ~50 ns a value: a few ms) and the memory it takes (some 100 bytes a value past
the body itself). Such a body is parsed by
msgspec alone: when it is not valid JSON its error (with the byte position) is the
answer, never a second, slower parse by Python's ``json`` for a nicer one.

Bodies held at once are bounded server-wide (:class:`BodyBudget`,
``--max-body-bytes-in-flight``): a body past :data:`INLINE_BYTES` takes its bytes from the
budget before they are read (all of its ``Content-Length`` at once, else as they arrive)
and gives them back once its request is prepared; when the budget has no room the request
is a 503 with ``Retry-After``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from starlette.requests import ClientDisconnect

from omni_serve.errors import APIError, bad_field, printable, server_busy
from omni_serve.fair import body_turn, client_name
from omni_serve.streams import ClientGone

MAX_DEPTH = 64
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1  # what every stage's integers hold
# an upper bound of the JSON values in a body: its commas and opening brackets (those
# in strings too); a chat of 25,000 messages has fewer
MAX_VALUES = 100_000
# a Content-Length of more digits (leading zeros too) is a 400: 2**64 has 20
MAX_LENGTH_DIGITS = 20
INLINE_BYTES = 64 << 10  # smaller bodies are parsed on the event loop (well under 1 ms)
COUNT_PIECE = 64 << 10  # bytes of a body counted at once (_structural)
T = TypeVar("T")


@dataclass
class BodyBudget:
    """Bytes of request bodies held in memory at once in the whole server
    (``--max-body-bytes-in-flight``); taken and given back on the event loop only."""

    limit: int
    used: int = 0

    def take(self, n: int) -> bool:
        """Take ``n`` bytes; False (nothing taken) when that would pass the limit."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


@dataclass
class _Lease:
    """What one body holds of a :class:`BodyBudget`."""

    budget: BodyBudget
    held: int = 0

    def cover(self, size: int) -> None:
        """Hold ``size`` bytes (a body's size, known or so far) when it is past
        :data:`INLINE_BYTES`; a 503 with ``Retry-After`` when the budget has no room."""
        if size <= INLINE_BYTES or size <= self.held:
            return
        if not self.budget.take(size - self.held):
            raise server_busy(
                f"the server holds its limit of {self.budget.limit} bytes of request bodies "
                "(--max-body-bytes-in-flight)"
            )
        self.held = size

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0


def check_content_type(value: str | None) -> None:
    """A body is JSON, and says so: ``application/json`` (UTF-8; parameters allowed). A
    body that does not say (or says a form or text, as a cross-site form post does) is
    refused: no browser page of another origin can post to the API without CORS."""
    if value is None:
        raise APIError(
            415,
            "the request has no Content-Type: send 'Content-Type: application/json'",
            param="Content-Type",
            code="unsupported_media_type",
        )
    media, *params = value.split(";")
    charset = "utf-8"
    for param in params:
        key, _, val = param.partition("=")
        if key.strip().lower() == "charset":
            charset = val.strip().strip('"').lower()
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        shown = printable(value[:100])
        raise APIError(
            415,
            f"Content-Type {shown!r} is not supported: send 'application/json' (UTF-8)",
            param="Content-Type",
            code="unsupported_media_type",
        )


def declared_length(request: Request) -> int | None:
    """The request's ``Content-Length`` (None: not given): 1 to :data:`MAX_LENGTH_DIGITS`
    ASCII digits, else a 400 naming the header (never ``int()`` of thousands of digits,
    past Python's integer digit limit: a 500)."""
    text = request.headers.get("content-length")
    if text is None:
        return None
    if not (0 < len(text) <= MAX_LENGTH_DIGITS and text.isascii() and text.isdigit()):
        raise APIError(
            400,
            f"the Content-Length header is not a length of 1 to {MAX_LENGTH_DIGITS} digits",
            param="Content-Length",
            code="invalid_header",
        )
    return int(text)


async def read_body(request: Request, limit: int, lease: _Lease | None = None) -> bytearray:
    """The raw body, at most ``limit`` bytes (else 413, read no further); not copied
    into ``bytes`` (20 MiB: a few ms of the event loop). With a ``lease`` its bytes are
    taken from the server's budget before they are read (else 503)."""
    too_big = APIError(
        413,
        f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)",
        code="body_too_large",
    )
    length = declared_length(request)
    if length is not None:
        if length > limit:
            raise too_big
        if lease is not None:
            lease.cover(length)
    body = bytearray(length or 0)  # a known length: allocated once, never grown (copied)
    n = 0
    try:
        async for chunk in request.stream():
            end = n + len(chunk)
            if end > limit:
                raise too_big
            if lease is not None:
                lease.cover(end)
            body[n:end] = chunk
            n = end
    except ClientDisconnect:  # gone, or closed by the server's body deadline
        raise ClientGone from None
    del body[n:]
    return body


def parse_json(raw: bytes | bytearray) -> Any:
    """``raw`` as JSON, every value checked (:func:`check_values`); a 413 past
    :data:`MAX_VALUES` values, before parsing."""
    values = _structural(raw)
    if values > MAX_VALUES:
        raise APIError(
            413,
            f"the request body has more than {MAX_VALUES} JSON values (counted by its "
            "commas and brackets), this server's limit",
            code="body_too_large",
        )
    try:
        value = msgspec.json.decode(raw)  # the fast path; the errors are said below
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError as e:
        if len(raw) > INLINE_BYTES:  # no second parse of a big body (the GIL): msgspec's words
            raise APIError(
                400,
                f"the request body is not valid JSON (NaN, Infinity and lone surrogates "
                f"are not JSON either): {e}",
            ) from None
        value = _parse_slowly(raw)
    check_values(value)
    return value


def _structural(raw: bytes | bytearray) -> int:
    """The commas and opening brackets of ``raw``, in one pass of pieces that stay in
    the cache (three ``count`` calls take three passes; one ``translate`` a copy of it)."""
    n = 0
    for i in range(0, len(raw), COUNT_PIECE):
        piece = raw[i : i + COUNT_PIECE]
        n += len(piece) - len(piece.translate(None, b",[{"))
    return n


def _too_deep() -> APIError:
    return APIError(400, f"the request body is nested deeper than {MAX_DEPTH} levels", param="body")


def _parse_slowly(raw: bytes | bytearray) -> Any:
    """``raw`` with Python's ``json``, for its error messages (and values such as
    ``NaN`` or lone surrogates, which :func:`check_values` names)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8: {e.reason}") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    return value


@contextlib.asynccontextmanager
async def json_body(request: Request, limit: int) -> AsyncIterator[bytearray]:
    """The request's raw JSON body, its content type and size checked, its bytes held
    against the server's :class:`BodyBudget` until the block ends (parse it there with
    :func:`parse_json` inside :func:`off_loop`). A body that may be big (past
    :data:`INLINE_BYTES`, or of no ``Content-Length``) is read once its client is within
    its share of the heavy body work (:mod:`omni_serve.fair`): until then it waits unread."""
    check_content_type(request.headers.get("content-type"))
    server = request.app.state.server
    length = declared_length(request)
    big = length is None or length > INLINE_BYTES
    turn = body_turn(request, server.work, min(limit, length or limit)) if big else None
    lease = _Lease(server.bodies)
    try:
        async with turn or contextlib.nullcontext():
            raw = await read_body(request, limit, lease)
        yield raw
    finally:
        lease.release()


async def off_loop(
    request: Request,
    size: int,
    work: Callable[[], T],
    slot: contextlib.AbstractAsyncContextManager[Any] | None = None,
) -> T:
    """``work()`` (parsing and checking a body of ``size`` bytes) where it cannot stall
    the server: inline when small, else in a worker thread, one at a time per ``slot``
    (default: the server's body parsing slot; their GIL holds then add up to no more than
    one parse's), its time counted to the client's fair share (:mod:`omni_serve.fair`)."""
    if size <= INLINE_BYTES:
        return work()
    async with slot or request.app.state.server.parsing.hold(client_name(request)):
        return await asyncio.to_thread(work)


def _name(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    key = printable(key)
    return f"{path}.{key}" if path else key


def _problem(value: Any) -> str | None:
    """Why one scalar cannot travel (None: it can)."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return "not valid Unicode (a lone surrogate such as \\ud800)"
    elif isinstance(value, bool):
        return None
    elif isinstance(value, int):
        if not INT_MIN <= value <= INT_MAX:
            return f"an integer outside {INT_MIN}..{INT_MAX}: integers must fit in 64 bits"
    elif isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a finite number"
    return None


def check_values(value: Any, rename: dict[str, str] | None = None) -> None:
    """A 400 naming the first field (``messages[0].content``) that is nested deeper than
    :data:`MAX_DEPTH`, or holds an integer past 64 bits, a non-finite number or a lone
    surrogate. ``rename`` maps field names to the ones to report (pipeline -> request)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_DEPTH:
                top = path.split(".")[0].split("[")[0] or "body"
                raise _bad((rename or {}).get(top, top), f"nested deeper than {MAX_DEPTH} levels")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for k, v in pairs:
                if isinstance(k, str) and (why := _problem(k)) is not None:
                    raise _bad(_name(path, k), f"a key that is {why}", rename)
                stack.append((v, _name(path, k), depth + 1))
        elif (why := _problem(item)) is not None:
            raise _bad(path or "body", why, rename)


def _bad(param: str, message: str, rename: dict[str, str] | None = None) -> APIError:
    return bad_field((rename or {}).get(param, param), message)
