"""Chat images at their edges, without a server or a network: the request's checks
(counts and bytes at the limit and one past) with the fetch and the header slot faked, the
base64 decoded piece by piece and only as far as a header reads, the header's budgets of
reads and time on a fake clock, the pixel limit, and the guarded backend on a fake
resolver and connector. The address check with an allow list, the resolver and the
fetches are in ``test_media_fetch.py``."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
import struct
import types
import zlib

import httpcore
import pytest
from omni_serve import media
from omni_serve.errors import APIError
from omni_serve.media import (
    B64_FIRST,
    MAX_HEADER_READS,
    BadBase64,
    GuardedBackend,
    OverBudget,
    RefusedAddress,
    RemoteImages,
    TooBig,
    _b64_pieces,
    _Budget,
    _Budgeted,
    check_images,
    check_pixels,
    image_parts,
    image_size,
    remote_images,
    remote_parts,
)

WHERE = "messages[0].content[1].image_url"


def png(w: int, h: int) -> bytes:
    """A PNG's signature, header and end: enough for its size to be read."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


class Clock:
    """``media.time``: ``monotonic()`` gives ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


# -- the request's image parts -------------------------------------------------------------


def chat(*urls: str, text_first: bool = True) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    if text_first:
        parts.insert(0, {"type": "text", "text": "x"})
    return {"messages": [{"role": "user", "content": parts}]}


def test_image_parts_are_named_by_their_place_and_remote_ones_by_scheme():
    req = {
        "messages": [
            {"role": "system", "content": "plain text"},
            {"role": "user", "content": [{"type": "text", "text": "x"}]},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://a/x.png"}},
                    {"type": "text", "text": "y"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "image_url", "image_url": {"url": "http://b/y.png"}},
                    {"type": "image_url", "image_url": {"url": "ftp://c/z.png"}},
                ],
            },
        ]
    }
    assert [w for w, _ in image_parts(req)] == [
        "messages[2].content[0].image_url",
        "messages[2].content[2].image_url",
        "messages[2].content[3].image_url",
        "messages[2].content[4].image_url",
    ]
    assert [p["url"] for _, p in remote_parts(req)] == ["https://a/x.png", "http://b/y.png"]
    assert image_parts({}) == [] and image_parts({"messages": None}) == []


class Headers:
    """``server.image_headers``: notes who asked for the slot."""

    def __init__(self) -> None:
        self.held: list[str] = []

    def hold(self, name: str) -> str:
        self.held.append(name)
        return f"slot of {name}"


def settings(**kw) -> types.SimpleNamespace:
    base = dict(
        max_chat_images=2,
        max_image_bytes=30,
        allow_remote_images=False,
        max_chat_image_pixels=100,
        remote_images_allow=(),
        remote_image_timeout_s=5.0,
        remote_image_concurrency=2,
    )
    return types.SimpleNamespace(**{**base, **kw})


@pytest.fixture
def checks(monkeypatch):
    """check_images with its fetch, disconnect watch, header slot and client faked; the
    calls each got, in ``log``."""
    log: dict[str, list] = {"fetch": [], "off_loop": []}

    async def until_disconnect(request, work):
        return await work

    async def fetch_remote(preq, fetcher, budget):
        log["fetch"].append((fetcher, budget))
        for _, p in remote_parts(preq):
            p["url"] = data_url(png(2, 3))

    async def off_loop(request, size, work, slot):
        log["off_loop"].append((size, work, slot))
        return work()

    monkeypatch.setattr(media, "until_disconnect", until_disconnect)
    monkeypatch.setattr(media, "fetch_remote", fetch_remote)
    monkeypatch.setattr(media, "off_loop", off_loop)
    monkeypatch.setattr(media, "client_name", lambda request: "address:1.2.3.4")
    server = types.SimpleNamespace(image_headers=Headers())
    request = types.SimpleNamespace(
        app=types.SimpleNamespace(state=types.SimpleNamespace(server=server))
    )
    log["request"] = request  # type: ignore[assignment]
    return log


def run_checks(checks, preq, **kw) -> None:
    asyncio.run(check_images(checks["request"], preq, settings(**kw)))


def test_a_request_without_images_is_not_checked(checks):
    run_checks(checks, {"messages": [{"role": "user", "content": "hi"}]})
    assert checks["off_loop"] == [] and checks["fetch"] == []


def test_image_parts_at_the_limit_pass_one_more_is_a_400_before_anything(checks):
    url = data_url(png(1, 1))
    run_checks(checks, chat(url, url), max_image_bytes=1000)
    with pytest.raises(APIError) as e:
        run_checks(checks, chat(url, url, url), max_image_bytes=1000)
    assert (e.value.status, e.value.param) == (400, "messages")
    assert "3 images, over this server's limit of 2 (--max-chat-images)" in e.value.message
    assert len(checks["off_loop"]) == 1


def test_inline_bytes_at_the_limit_pass_one_more_is_a_400(checks):
    # a data URL of n characters counts n * 3 // 4 bytes: 40 characters are 30 bytes
    at = "data:image/png;base64," + "A" * (40 - len("data:image/png;base64,"))
    run_checks(checks, chat(at))
    assert checks["off_loop"][0][0] == 40  # its size: the URL's characters
    over = at + "A"  # 41 characters: 30 bytes still (41 * 3 // 4)
    run_checks(checks, chat(over))
    with pytest.raises(APIError) as e:
        run_checks(checks, chat(over + "AA"))  # 43: 32 bytes
    assert e.value.param == "messages"
    assert "over 30 bytes together (--max-image-bytes)" in e.value.message
    # remote URLs are not counted here (their bytes are counted as they are fetched)
    run_checks(checks, chat(at, "https://host/" + "x" * 100))


def test_remote_images_are_fetched_only_when_allowed_within_what_inline_ones_left(checks):
    inline = data_url(png(1, 1))  # 96 characters: 72 bytes
    run_checks(checks, chat(inline, "https://h/a.png"), max_image_bytes=1000)
    assert checks["fetch"] == []  # not allowed: left to the intake, which refuses it
    preq = chat(inline, "https://h/a.png")
    run_checks(checks, preq, max_image_bytes=1000, allow_remote_images=True)
    ((fetcher, budget),) = checks["fetch"]
    assert budget == 1000 - len(inline) * 3 // 4 and isinstance(fetcher, RemoteImages)
    assert preq["messages"][0]["content"][2]["image_url"]["url"] == data_url(png(2, 3))
    # the header check: every part's URL counted as it is now, in the client's slot
    size, work, slot = checks["off_loop"][-1]
    assert size == len(inline) + len(data_url(png(2, 3)))
    assert slot == "slot of address:1.2.3.4"
    assert checks["request"].app.state.server.image_headers.held[-1] == "address:1.2.3.4"
    assert work.keywords == {} and work.args[1:] == (100, {"messages[0].content[2].image_url"})
    with pytest.raises(APIError, match="image of 1x1"):  # the check the slot runs
        check_pixels(work.args[0], 0, set())


def test_a_too_large_image_is_found_by_the_check_in_the_slot(checks):
    with pytest.raises(APIError) as e:
        run_checks(checks, chat(data_url(png(11, 10))), max_image_bytes=1000)
    assert e.value.param == WHERE and "11x10 pixels" in e.value.message


def test_the_app_makes_one_remote_fetcher_from_the_settings():
    request = types.SimpleNamespace(app=types.SimpleNamespace(state=types.SimpleNamespace()))
    net = ipaddress.ip_network("10.0.0.0/8")
    s = settings(remote_images_allow=(net,), remote_image_timeout_s=2.5, remote_image_concurrency=3)

    async def twice():
        return remote_images(request, s), remote_images(request, s)  # type: ignore[arg-type]

    first, second = asyncio.run(twice())
    assert first is second is request.app.state.remote_images
    assert (first.allow, first.timeout_s, first.concurrency) == ((net,), 2.5, 3)
    assert first.dns.limit == 3 * media.DNS_LOOKUPS_PER_SLOT == 24
    assert first.slots._value == 3


# -- base64, decoded in pieces and only as far as read ------------------------------------------


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_base64_is_decoded_in_pieces_strictly_padding_only_at_the_very_end(monkeypatch):
    monkeypatch.setattr(media, "B64_PIECE", 8)
    data = b64(b"abcdefghijklmno")  # 20 characters
    assert _b64_pieces(data, 0, 20) == [b"abcdef", b"ghijkl", b"mno"]
    assert _b64_pieces(data, 8, 16) == [b"ghijkl"]
    assert _b64_pieces(data, 4, 4) == []
    padded = b64(b"abcdefg")  # 12 characters, "==" at the end
    assert b"".join(_b64_pieces(padded, 0, 12)) == b"abcdefg"
    for early in (b64(b"abcd"), b64(b"abcde")):  # "YWJjZA==", "YWJjZGU=": then more
        with pytest.raises(binascii.Error, match="padding before the end"):
            _b64_pieces(early + b64(b"ab"), 0, 12)
    with pytest.raises(binascii.Error):
        _b64_pieces("YW*j", 0, 4)  # not base64: refused, not skipped


def test_a_budgeted_stream_decodes_at_least_double_what_it_had_each_time(monkeypatch):
    monkeypatch.setattr(media, "B64_FIRST", 8)
    raw = bytes(range(256)) * 2
    head = "data:image/png;base64,"
    s = _Budgeted(head + b64(raw), float("inf"), len(head))
    assert s.start == s.done == len(head) and s.buf == b""
    assert s.read(1) == raw[:1]
    assert s.done - s.start == 8  # B64_FIRST characters at first: 6 bytes
    assert s.read(6) == raw[1:7]  # 7 bytes are 12 characters; double the 8 is 16
    assert s.done - s.start == 16 and len(s.buf) == 12
    assert s.read(100) == raw[7:107]  # 107 bytes: 144 characters (over double)
    assert s.done - s.start == 144 and len(s.buf) == 108
    assert s.read(0) == b"" and s.tell() == 107
    assert s.read(1) == raw[107:108] and s.done - s.start == 144  # had it: nothing decoded
    assert s.read() == raw[108:]  # the rest
    assert s.done == len(head) + len(b64(raw)) and s.read(5) == b""


def test_a_budgeted_stream_seeks_as_a_file_does():
    raw = bytes(range(200))
    s = _Budgeted(b64(raw), float("inf"))
    assert (s.readable(), s.seekable()) == (True, True)
    assert s.seek(10) == 10 and s.read(2) == raw[10:12]
    assert s.seek(3, io.SEEK_CUR) == 15 and s.read(1) == raw[15:16]
    assert s.seek(-4, io.SEEK_END) == 196 and s.read() == raw[196:]
    assert s.done == len(b64(raw))  # its end: decoded to find it
    with pytest.raises(ValueError, match="negative seek position -1"):
        s.seek(-1)
    with pytest.raises(ValueError, match="negative seek position -3"):
        s.seek(-203, io.SEEK_END)
    buf = bytearray(8)
    s.seek(0)
    assert s.readinto(buf) == 8 and bytes(buf) == raw[:8]
    small = bytearray(b"xxxx")
    s.seek(198)
    assert s.readinto(small) == 2 and small == bytearray(raw[198:200] + b"xx")


def test_bytes_are_read_as_they_are():
    s = _Budgeted(b"\x01\x02\x03", float("inf"))
    assert (s.start, s.done, s.b64) == (0, 0, "")
    assert s.read(2) == b"\x01\x02" and s.read() == b"\x03"


@pytest.mark.parametrize(
    ("data", "start"), [("AAAAA", 0), ("xAAAA", 0), ("data:,AAA", 6), ("data:,AAAAA", 6)]
)
def test_base64_not_a_multiple_of_four_long_is_bad(data, start):
    with pytest.raises(BadBase64, match="not a multiple of 4 characters long"):
        _Budgeted(data, float("inf"), start)


def test_base64_that_is_not_valid_where_it_is_read_is_bad():
    bad = "AAAA" * (B64_FIRST // 4) + "A*AA"
    s = _Budgeted(bad, float("inf"))
    assert s.read(3) == b"\0\0\0"  # the fault is past what the first read decodes
    with pytest.raises(BadBase64):
        s.read()
    with pytest.raises(BadBase64):
        _Budgeted("\u00e9AAA", float("inf")).read(1)  # not ASCII: a ValueError inside


def test_a_header_may_take_2048_reads_not_one_more():
    s = _Budgeted(b"x" * 4096, float("inf"))
    for _ in range(MAX_HEADER_READS):
        s.read(1)
    with pytest.raises(OverBudget, match="over this server's budget of 2048 reads"):
        s.read(1)
    s = _Budgeted(b"x" * 10, float("inf"))
    buf = bytearray(1)
    for _ in range(MAX_HEADER_READS):
        s.readinto(buf)
    with pytest.raises(OverBudget):
        s.readinto(buf)  # readinto counts as a read


def test_a_header_may_take_its_time_up_to_its_deadline_not_past(monkeypatch):
    clock = Clock(5.0)
    monkeypatch.setattr(media, "time", clock)
    s = _Budgeted(b"x" * 10, 5.0)
    assert s.read(1) == b"x"  # at the deadline
    clock.now = 5.001
    with pytest.raises(OverBudget, match=r"^its header took over 1 s to read$"):
        s.read(1)


def test_image_size_reads_the_header_of_bytes_or_base64_within_a_second(monkeypatch):
    raw = png(7, 5)
    assert image_size(raw) == (7, 5)
    url = data_url(raw)
    assert image_size(url, url.index(",") + 1) == (7, 5)
    clock = Clock(100.0)
    monkeypatch.setattr(media, "time", clock)
    seen = []
    real = media._Budgeted

    def budgeted(image, deadline, start=0):
        seen.append(deadline)
        return real(image, deadline, start)

    monkeypatch.setattr(media, "_Budgeted", budgeted)
    assert image_size(raw) == (7, 5)
    assert seen == [101.0]  # HEADER_BUDGET_S from now


def test_only_the_common_formats_are_opened():
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (3, 2)).save(out, format="TIFF")  # Pillow reads TIFF; we do not
    with pytest.raises(Exception, match="cannot identify image file"):
        image_size(out.getvalue())


# -- the pixel limit ----------------------------------------------------------------------


def test_pixels_at_the_limit_pass_one_more_is_a_400_naming_the_part():
    check_pixels([(WHERE, {"url": data_url(png(10, 10))})], 100, set())
    with pytest.raises(APIError) as e:
        check_pixels([(WHERE, {"url": data_url(png(101, 1))})], 100, set())
    assert (e.value.status, e.value.param) == (400, WHERE)
    assert e.value.message == (
        f"field '{WHERE}': image of 101x1 pixels, over this server's limit of 100 "
        "(--max-chat-image-pixels)"
    )


@pytest.mark.parametrize(
    "first",
    [
        data_url(png(1, 1)),
        "data:image/png;base64,A*AA",  # bad base64: left to the intake, the next checked
        data_url(b"not an image"),
        "https://host/x.png",
    ],
)
def test_each_part_is_checked_not_only_the_first(first):
    parts = [("a", {"url": first}), ("b", {"url": data_url(png(20, 20))})]
    with pytest.raises(APIError) as e:
        check_pixels(parts, 100, set())
    assert e.value.param == "b"


def test_a_url_without_a_comma_is_never_read_as_base64():
    """Even one whose every character up to ``;base64`` is valid base64 of an image."""
    head = b64(png(20, 20) + bytes(4000))  # over the first read's 4096 characters
    url = head + ";base64x"  # all but its last character ends as a data URL's head does
    assert len(url) % 4 == 0 and "," not in url
    check_pixels([(WHERE, {"url": url})], 1, {WHERE})


def test_the_first_read_decodes_a_few_kilobytes_only():
    url = data_url(bytes(100_000))
    s = _Budgeted(url, float("inf"), url.index(",") + 1)
    s.read(16)
    assert s.done - s.start == 4096  # B64_FIRST: 3 KB of image
    assert len(s.buf) == 3072


def test_a_read_of_a_multiple_of_three_bytes_decodes_just_its_characters(monkeypatch):
    monkeypatch.setattr(media, "B64_FIRST", 4)
    s = _Budgeted(b64(bytes(range(30))), float("inf"))
    assert s.read(12) == bytes(range(12))
    assert s.done == 16 and len(s.buf) == 12  # 12 bytes: 16 characters, not 20


def test_base64_at_an_odd_start_is_counted_from_its_start():
    # "data:image/jpeg;base64," puts the base64 at 23: its length is counted from there
    s = _Budgeted("x" + b64(b"abc"), float("inf"), 1)
    assert s.read() == b"abc"
    url = data_url(png(4, 3), "image/jpeg")
    assert image_size(url, url.index(",") + 1) == (4, 3)


def test_a_bomb_past_pillows_own_limit_is_over_any_limit():
    bomb = data_url(png(20_000, 20_000))  # past twice Pillow's MAX_IMAGE_PIXELS: it raises
    with pytest.raises(APIError) as e:
        check_pixels([(WHERE, {"url": bomb})], 10**12, set())
    assert f"image of {10**12 + 1}x1 pixels" in e.value.message


@pytest.mark.parametrize(
    "url",
    [
        "https://host/x.png",  # no data URL: never here unless fetched
        "data:image/png," + "A" * 8,  # not base64: the intake names it
        "data:image/png;base64;x," + b64(png(20, 20)),
        "data:image/png;base64," + b64(png(20, 20))[:-2],  # cut: not a multiple of 4
        "data:image/png;base64," + "A*AA" * 4,  # not base64
    ],
)
def test_what_is_not_a_base64_data_url_is_left_to_the_intake(url):
    check_pixels([(WHERE, {"url": url})], 1, {WHERE})


def test_what_is_not_an_image_is_a_400_when_fetched_and_left_when_inline():
    url = data_url(b"<html>not an image</html>", "image/png")
    check_pixels([(WHERE, {"url": url})], 100, set())
    with pytest.raises(APIError) as e:
        check_pixels([(WHERE, {"url": url})], 100, {WHERE})
    assert e.value.param == WHERE
    assert (
        e.value.message
        == f"field '{WHERE}': could not fetch the image: what it answered is not an image"
    )


def test_a_header_over_its_budget_is_a_400(monkeypatch):
    monkeypatch.setattr(media, "MAX_HEADER_READS", 0)
    with pytest.raises(APIError) as e:
        check_pixels([(WHERE, {"url": data_url(png(1, 1))})], 100, set())
    assert e.value.param == WHERE and e.value.message.startswith(
        f"field '{WHERE}': image refused: its header is over this server's budget of 0 reads"
    )


def test_the_fetched_bytes_budget_is_spent_to_zero_not_past():
    b = _Budget(10, 10)
    b.take(4)
    b.take(6)
    assert b.left == 0
    with pytest.raises(TooBig):
        b.take(1)


# -- the guarded backend ---------------------------------------------------------------


class Dns:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.asked: list = []

    async def resolve(self, host, port):
        self.asked.append((host, port))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in self.answer]


class Connector:
    """httpcore's backend: ``refuse`` are the addresses that fail to connect."""

    def __init__(self, refuse=()) -> None:
        self.refuse = set(refuse)
        self.tried: list = []
        self.slept: list = []

    async def connect_tcp(self, host, port, timeout, local_address, socket_options):
        self.tried.append((host, port, timeout, local_address, socket_options))
        if host in self.refuse:
            raise httpcore.ConnectError(f"refused by {host}")
        return f"stream to {host}"

    async def sleep(self, seconds):
        self.slept.append(seconds)


def guarded(answer, refuse=(), allow=()) -> tuple[GuardedBackend, Connector]:
    g = GuardedBackend(allow, Dns(answer))  # type: ignore[arg-type]
    g.inner = Connector(refuse)  # type: ignore[assignment]
    return g, g.inner  # type: ignore[return-value]


def test_the_backend_connects_to_the_first_allowed_address_that_answers():
    g, c = guarded(["10.0.0.1", "8.8.8.8", "8.8.8.8", "1.1.1.1"], refuse={"8.8.8.8"})
    got = asyncio.run(g.connect_tcp("h", 443, 3.0, "0.0.0.0", ["opt"]))
    assert got == "stream to 1.1.1.1"
    assert c.tried == [
        ("8.8.8.8", 443, 3.0, "0.0.0.0", ["opt"]),  # once, though given twice
        ("1.1.1.1", 443, 3.0, "0.0.0.0", ["opt"]),
    ]  # 10.0.0.1 never
    assert g.dns.asked == [("h", 443)]  # type: ignore[attr-defined]


def test_the_backend_raises_the_last_connect_error_when_none_answers():
    g, _ = guarded(["8.8.8.8", "1.1.1.1"], refuse={"8.8.8.8", "1.1.1.1"})
    with pytest.raises(httpcore.ConnectError, match="refused by 1.1.1.1"):
        asyncio.run(g.connect_tcp("h", 80))


def test_an_address_with_a_scope_is_judged_without_it_and_an_allowed_network_lets_it_in():
    g, c = guarded(["fe80::1%eth0"])
    with pytest.raises(RefusedAddress, match="^h resolves to no allowed address$"):
        asyncio.run(g.connect_tcp("h", 80))
    assert c.tried == []
    g, c = guarded(["fe80::1%eth0"], allow=[ipaddress.ip_network("fe80::/64")])
    assert asyncio.run(g.connect_tcp("h", 80)) == "stream to fe80::1"
    assert g.allow == (ipaddress.ip_network("fe80::/64"),)


@pytest.mark.parametrize(
    "error", [socket.gaierror(-2, "not known"), UnicodeError("label empty or too long")]
)
def test_a_name_that_cannot_be_resolved_is_a_connect_error(error):
    g, c = guarded(error)
    with pytest.raises(httpcore.ConnectError) as e:
        asyncio.run(g.connect_tcp("bad.host", 80))
    assert str(e.value).startswith("cannot resolve 'bad.host': ") and c.tried == []


def test_the_backend_never_connects_to_a_unix_socket_and_sleeps_as_its_inner_one():
    g, c = guarded([])
    with pytest.raises(RefusedAddress, match="unix sockets"):
        asyncio.run(g.connect_unix_socket("/run/docker.sock"))
    asyncio.run(g.sleep(0.5))
    assert c.slept == [0.5]
