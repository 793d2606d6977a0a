"""Remote images at their edges, without a network: the address check with an allow
list, the resolver's threads (``getaddrinfo`` faked, held on events), and each fetch's
answers, redirects, failures and deadline on a fake connection pool (the guarded
backend is in ``test_media_edges.py``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import gc
import ipaddress
import logging
import socket
import threading

import httpcore
import pytest
from omni_serve import media
from omni_serve.errors import APIError
from omni_serve.media import (
    MAX_REDIRECTS,
    GuardedBackend,
    RefusedAddress,
    RemoteImages,
    Resolver,
    ResolverBusy,
    TooBig,
    _Budget,
    address_allowed,
    fetch_remote,
)

WHERE = "messages[0].content[1].image_url"


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def chat(*urls: str, text_first: bool = True) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    if text_first:
        parts.insert(0, {"type": "text", "text": "x"})
    return {"messages": [{"role": "user", "content": parts}]}


# -- address checks with an allow list -------------------------------------------------------


def ip(text: str):
    return ipaddress.ip_address(text)


def test_an_allowed_network_lets_in_its_addresses_and_their_ipv6_forms():
    allow = (ipaddress.ip_network("10.0.0.1/32"),)
    assert address_allowed(ip("10.0.0.1"), allow)
    assert address_allowed(ip("::ffff:10.0.0.1"), allow)  # mapped
    assert address_allowed(ip("64:ff9b::a00:1"), allow)  # NAT64 of 10.0.0.1
    assert address_allowed(ip("2002:a00:1::"), allow)  # 6to4 of 10.0.0.1
    assert not address_allowed(ip("10.0.0.2"), allow)
    assert not address_allowed(ip("64:ff9b::a00:2"), allow)
    six = (ipaddress.ip_network("fd00::/64"),)
    assert address_allowed(ip("fd00::5"), six) and not address_allowed(ip("fd01::5"), six)
    # an IPv4 address is never judged by an IPv6 network's bits (nor the reverse)
    assert not address_allowed(ip("0.0.0.1"), (ipaddress.ip_network("::/96"),))
    assert address_allowed(ip("8.8.8.8"))  # not inside ::/96 (NOT_GLOBAL), being IPv4


@pytest.mark.parametrize(
    "address", ["224.0.0.1", "239.255.255.250", "ff02::1", "::ffff:224.0.0.1", "0.0.0.0", "::"]
)
def test_multicast_and_unspecified_addresses_are_refused_although_called_global(address):
    assert not address_allowed(ip(address))


def test_nat64_of_a_public_address_is_judged_by_it_to_its_last_bit():
    assert address_allowed(ip("64:ff9b::808:809"))  # 8.8.8.9
    assert not address_allowed(ip("64:ff9b::7f00:1"))  # 127.0.0.1
    assert media._unwrap(ip("64:ff9b::808:809")) == ip("8.8.8.9")
    assert media._unwrap(ip("64:ff9b::ffff:ffff")) == ip("255.255.255.255")
    assert media._unwrap(ip("2606:4700::1111")) == ip("2606:4700::1111")
    assert media._unwrap(ip("8.8.8.8")) == ip("8.8.8.8")


# -- the resolver ---------------------------------------------------------------------------------


class Lookups:
    """``socket.getaddrinfo`` held until the test lets each host's lookup answer (or fail)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int, int, str]] = []
        self.go: dict[str, threading.Event] = {}
        self.fail: dict[str, BaseException] = {}
        self.lock = threading.Lock()

    def gate(self, host: str) -> threading.Event:
        with self.lock:
            return self.go.setdefault(host, threading.Event())

    def __call__(self, host, port, type=0):  # noqa: A002 - getaddrinfo's keyword
        self.asked.append((host, port, type, threading.current_thread().name))
        assert self.gate(host).wait(10)
        if host in self.fail:
            raise self.fail[host]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"{host}-ip", port))]


@pytest.fixture
def lookups(monkeypatch):
    fake = Lookups()
    monkeypatch.setattr(media.socket, "getaddrinfo", fake)
    yield fake
    for e in fake.go.values():
        e.set()


async def settle(until, what: str = "") -> None:
    """Let the loop and the lookup threads run until ``until()`` holds."""
    for _ in range(1000):
        if until():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def test_lookups_of_one_host_share_a_thread_and_a_full_resolver_refuses_at_once(lookups):
    r = Resolver(2)

    async def main():
        a1 = asyncio.ensure_future(r.resolve("a", 80))
        a2 = asyncio.ensure_future(r.resolve("a", 80))
        b = asyncio.ensure_future(r.resolve("b", 443))
        await asyncio.sleep(0)
        assert (r.started, len(r.pending)) == (2, 2)
        with pytest.raises(ResolverBusy):
            await r.resolve("c", 80)  # a third host at the limit of 2
        a3 = asyncio.ensure_future(r.resolve("a", 80))  # one in flight: shared, not refused
        await asyncio.sleep(0)
        lookups.gate("a").set()
        got = await asyncio.gather(a1, a2, a3)
        assert (
            got[0]
            == got[1]
            == got[2]
            == [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("a-ip", 80))]
        )
        await settle(lambda: len(r.pending) == 1, "a's lookup forgotten")
        c = asyncio.ensure_future(r.resolve("c", 80))  # room again
        await asyncio.sleep(0)
        lookups.gate("b").set()
        lookups.gate("c").set()
        await asyncio.gather(b, c)
        await settle(lambda: not r.pending, "every lookup forgotten")

    asyncio.run(main())
    assert sorted(lookups.asked) == [
        ("a", 80, socket.SOCK_STREAM, "omni-dns-1"),
        ("b", 443, socket.SOCK_STREAM, "omni-dns-2"),
        ("c", 80, socket.SOCK_STREAM, "omni-dns-3"),
    ]


def test_a_resolver_of_one_refuses_a_second_host():
    r = Resolver(1)
    r.pending[("x", 1)] = object()  # type: ignore[assignment]

    async def main():
        with pytest.raises(ResolverBusy):
            await r.resolve("y", 1)

    asyncio.run(main())
    assert r.started == 0


def test_a_failed_lookup_raises_its_error_for_every_waiter(lookups):
    r = Resolver(4)
    lookups.fail["bad"] = socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    async def main():
        waiters = asyncio.gather(r.resolve("bad", 80), r.resolve("bad", 80), return_exceptions=True)
        await settle(lambda: ("bad", 80) in r.pending, "the lookup started")
        await asyncio.sleep(0)  # both waiters on it before it answers
        lookups.gate("bad").set()
        got = await waiters
        assert [type(e) for e in got] == [socket.gaierror, socket.gaierror]
        await settle(lambda: not r.pending)

    asyncio.run(main())
    assert len(lookups.asked) == 1


def test_a_waiter_that_gives_up_leaves_the_lookup_to_the_next_and_its_error_unreported(lookups):
    r = Resolver(4)
    lookups.fail["slow"] = OSError(errno.ETIMEDOUT, "no answer")
    reported: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r.resolve("slow", 80), 0.01)
        assert r.started == 1 and ("slow", 80) in r.pending  # still looking it up
        again = asyncio.ensure_future(r.resolve("slow", 80))
        await asyncio.sleep(0)
        assert r.started == 1  # shared
        again.cancel()
        future = r.pending[("slow", 80)]
        lookups.gate("slow").set()
        await settle(future.done, "the lookup answered")
        assert isinstance(future.exception(), OSError)
        del future
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert [c.get("message") for c in reported] == []  # no "exception was never retrieved"


def test_a_lookup_left_by_a_closed_loop_is_not_shared_with_the_next_loop(lookups, monkeypatch):
    r = Resolver(4)
    crashed: list = []
    monkeypatch.setattr(threading, "excepthook", crashed.append)

    async def give_up():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r.resolve("h", 80), 0.01)

    asyncio.run(give_up())  # its loop closes with the lookup in flight
    first = r.pending[("h", 80)]

    async def again():
        task = asyncio.ensure_future(r.resolve("h", 80))
        await asyncio.sleep(0)
        assert r.started == 2 and r.pending[("h", 80)] is not first  # a lookup of its own
        second = r.pending[("h", 80)]
        lookups.gate("h").set()
        assert await task == [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("h-ip", 80))]
        await settle(lambda: not r.pending, "both forgotten")
        return second

    asyncio.run(again())
    for t in threading.enumerate():
        if t.name.startswith("omni-dns-"):
            t.join(5)
    assert crashed == []  # the closed loop's answer was dropped quietly
    assert not first.done()


def test_a_lookup_that_ends_after_a_newer_one_began_leaves_the_newer_one(lookups):
    r = Resolver(4)
    threads = []
    real_thread = threading.Thread

    def noting(*a, **kw):
        t = real_thread(*a, **kw)
        threads.append(t)
        return t

    async def old():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r.resolve("h", 80), 0.01)

    asyncio.run(old())

    async def new():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(media.threading, "Thread", noting)
            task = asyncio.ensure_future(r.resolve("h", 80))
            await asyncio.sleep(0)
        newer = r.pending[("h", 80)]
        # let the first lookup answer alone: the second waits on a gate of its own
        lookups.go["h"].set()
        await settle(lambda: len(lookups.asked) == 2, "both asked")
        threads[0].join(5)
        await settle(task.done)
        return newer

    asyncio.run(new())
    assert not r.pending


def test_settle_leaves_a_future_already_done():
    loop = asyncio.new_event_loop()
    try:
        f = loop.create_future()
        f.cancel()
        media._settle(f, [1], None)
        assert f.cancelled()
        g = loop.create_future()
        media._settle(g, None, OSError("x"))
        assert isinstance(g.exception(), OSError)
        h = loop.create_future()
        media._settle(h, [2], None)
        assert h.result() == [2]
        media._retrieve(f)  # a cancelled one: nothing to mark
    finally:
        loop.close()


# -- fetches on a fake connection pool -------------------------------------------------------------


class Answer:
    def __init__(
        self, status=200, headers=(), chunks=(), hang=False, error=None, cleanup_steps=0
    ) -> None:
        self.status = status
        self.headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        self.chunks = list(chunks)
        self.read = 0
        self.hang = hang
        self.error = error
        self.cleanup_steps = cleanup_steps  # loop turns a hung answer takes to close

    async def aiter_stream(self):
        for c in self.chunks:
            self.read += 1
            yield c


def image(raw: bytes = b"IMG", mime: str = "image/png") -> Answer:
    return Answer(200, [("Content-Type", mime), ("Content-Length", str(len(raw)))], [raw])


def moved(to: str, status: int = 302) -> Answer:
    return Answer(status, [("Location", to)])


class Pool:
    def __init__(self, answers: dict[str, Answer]) -> None:
        self.answers = answers
        self.asked: list = []
        self.cancelled: list[str] = []

    @contextlib.asynccontextmanager
    async def stream(self, method, url, headers, extensions):
        self.asked.append((method, url, headers, extensions))
        a = self.answers[url]
        if a.error is not None:
            raise a.error
        if a.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                for _ in range(a.cleanup_steps):  # (its connection closing)
                    await asyncio.sleep(0)
                self.cancelled.append(url)
                raise
        yield a


def get(pool: Pool, url: str, budget: int = 1000, timeout_s: float = 5.0):
    return asyncio.run(media._get(pool, WHERE, url, _Budget(budget, budget), timeout_s))


def test_a_get_asks_for_an_image_within_its_timeouts_and_reads_its_type():
    pool = Pool({"http://h/a": image(b"abc", "Image/PNG; charset=x")})
    assert get(pool, "http://h/a", timeout_s=2.5) == ("image/png", b"abc")
    ((method, url, headers, ext),) = pool.asked
    assert (method, url) == ("GET", "http://h/a")
    assert headers == [(b"Accept", b"image/*"), (b"User-Agent", b"omni-serve")]
    assert ext == {"timeout": {"connect": 2.5, "read": 2.5, "write": 2.5, "pool": 2.5}}
    pool = Pool({"http://h/a": image(b"abc", "text/html")})
    assert get(pool, "http://h/a") == ("application/octet-stream", b"abc")
    pool = Pool({"http://h/a": Answer(200, [], [b"a", b"b"])})
    assert get(pool, "http://h/a") == ("application/octet-stream", b"ab")


def test_redirects_are_followed_one_hop_at_a_time_up_to_three():
    chain = {f"http://h/{i}": moved(f"/{i + 1}", s) for i, s in enumerate([301, 307, 308])}
    pool = Pool({**chain, "http://h/3": image()})
    assert get(pool, "http://h/0") == ("image/png", b"IMG")
    assert [a[1] for a in pool.asked] == ["http://h/0", "http://h/1", "http://h/2", "http://h/3"]
    pool = Pool({**chain, "http://h/3": moved("/4", 303), "http://h/4": image()})
    with pytest.raises(APIError) as e:
        get(pool, "http://h/0")
    assert (
        e.value.message
        == f"field '{WHERE}': could not fetch the image: more than {MAX_REDIRECTS} redirects"
    )
    assert len(pool.asked) == MAX_REDIRECTS + 1


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        (Answer(302), "HTTP 3xx"),  # a redirect without a Location
        (Answer(304, [("Location", "/x")]), "HTTP 3xx"),  # not a redirect
        (Answer(404), "HTTP 4xx"),
        (Answer(201), "HTTP 2xx"),
        (Answer(503), "HTTP 5xx"),
        (Answer(499), "HTTP 4xx"),
        (moved("http://[::1"), "a redirect to a URL that is not valid"),
        (moved("ftp://h/x"), "a redirect to a URL that is not http(s)"),
        (moved("https:///x"), "not a valid http(s) URL (no host)"),
        (moved("http://h:99999/x"), "not a valid http(s) URL"),
        (moved("http://\u00e9t\u00e9.example/x"), "not a valid http(s) URL"),
    ],
)
def test_an_answer_that_is_no_image_is_a_400_saying_what_kind(answer, kind):
    pool = Pool({"http://h/a": answer, "http://h/x": image()})
    with pytest.raises(APIError) as e:
        get(pool, "http://h/a")
    assert (e.value.status, e.value.param) == (400, WHERE)
    assert e.value.message == f"field '{WHERE}': could not fetch the image: {kind}"


def test_a_body_is_held_to_the_budget_by_its_length_before_it_is_read_and_as_it_is():
    at = image(b"x" * 10)
    assert get(Pool({"http://h/a": at}), "http://h/a", budget=10)[1] == b"x" * 10
    over = image(b"x" * 11)
    with pytest.raises(TooBig):
        get(Pool({"http://h/a": over}), "http://h/a", budget=10)
    assert over.read == 0  # refused from its Content-Length
    lying = Answer(200, [("Content-Length", "+5")], [b"x" * 6, b"y" * 6])
    with pytest.raises(TooBig):
        get(Pool({"http://h/a": lying}), "http://h/a", budget=10)
    assert lying.read == 2
    unsaid = Answer(200, [], [b"x" * 10])
    assert get(Pool({"http://h/a": unsaid}), "http://h/a", budget=10)[1] == b"x" * 10


def fetcher(timeout_s: float = 5.0, concurrency: int = 2) -> RemoteImages:
    return RemoteImages((), timeout_s, concurrency)


def fetch(pool: Pool, url: str, f: RemoteImages | None = None, budget: int = 1000) -> str:
    async def main():
        return await media._fetch(pool, f or fetcher(), WHERE, url, _Budget(budget, budget))

    return asyncio.run(main())


def test_a_fetch_is_a_data_url_of_what_it_answered_fetched_in_a_slot():
    f = fetcher(concurrency=1)
    held = []
    pool = Pool({"http://h/a": image(b"\x89PNG")})
    real = pool.stream

    def stream(*a, **kw):
        held.append(f.slots.locked())
        return real(*a, **kw)

    pool.stream = stream  # type: ignore[method-assign]
    assert fetch(pool, "http://h/a", f) == "data:image/png;base64," + b64(b"\x89PNG")
    assert held == [True] and not f.slots.locked()


@pytest.mark.parametrize(
    ("error", "status", "said"),
    [
        (RefusedAddress("x"), 400, "the address is refused (loopback, private"),
        (TooBig(), 400, "the request's images are over 1000 bytes together (--max-image-bytes)"),
        (httpcore.ConnectError("SECRET"), 400, "the connection failed"),
        (httpcore.ReadTimeout("SECRET"), 400, "the connection failed"),
        (httpcore.RemoteProtocolError("SECRET"), 400, "the connection failed"),
        (httpcore.UnsupportedProtocol("SECRET"), 400, "a redirect to a URL that is not http(s)"),
    ],
)
def test_each_failure_of_a_fetch_is_a_400_of_its_kind_never_what_the_host_said(
    error, status, said, caplog
):
    pool = Pool({"http://h/a": Answer(error=error)})
    with caplog.at_level(logging.INFO, logger="omni.serve"), pytest.raises(APIError) as e:
        fetch(pool, "http://h/a")
    assert (e.value.status, e.value.param) == (status, WHERE)
    assert e.value.message.startswith(f"field '{WHERE}': could not fetch the image: {said}")
    assert "SECRET" not in e.value.message
    if said == "the connection failed":
        assert [r.getMessage() for r in caplog.records] == [
            f"remote image at {WHERE}: {type(error).__name__}: SECRET"
        ]


def test_a_full_resolver_is_a_503():
    pool = Pool({"http://h/a": Answer(error=ResolverBusy())})
    with pytest.raises(APIError) as e:
        fetch(pool, "http://h/a")
    assert e.value.status == 503
    assert e.value.message.startswith(
        f"could not fetch the image at {WHERE}: the server's host name lookups are all busy"
    )


def test_a_fetch_that_takes_too_long_is_cut_at_its_deadline():
    pool = Pool({"http://h/a": Answer(hang=True)})
    with pytest.raises(APIError) as e:
        fetch(pool, "http://h/a", fetcher(timeout_s=0.05))
    assert e.value.message == (
        f"field '{WHERE}': could not fetch the image: no complete answer within 0.05 s "
        "(--remote-image-timeout)"
    )
    assert pool.cancelled == ["http://h/a"]


class FakeConnectionPool:
    """httpcore.AsyncConnectionPool for fetch_remote: the fake :class:`Pool` given."""

    made: list[dict] = []
    pool: Pool

    def __init__(self, **kw) -> None:
        FakeConnectionPool.made.append(kw)

    async def __aenter__(self) -> Pool:
        return FakeConnectionPool.pool

    async def __aexit__(self, *exc) -> None:
        return None


@pytest.fixture
def connection_pool(monkeypatch):
    FakeConnectionPool.made = []
    monkeypatch.setattr(httpcore, "AsyncConnectionPool", FakeConnectionPool)
    return FakeConnectionPool


def test_fetch_remote_replaces_each_remote_url_in_place_with_one_pool(connection_pool):
    connection_pool.pool = Pool(
        {"http://h/a": image(b"A"), "https://h/b": image(b"B", "image/gif")}
    )
    req = chat("http://h/a", data_url(b"x"), "https://h/b")
    f = RemoteImages((ipaddress.ip_network("10.0.0.0/8"),), 5.0, 2)
    asyncio.run(fetch_remote(req, f, 1000))
    urls = [p["image_url"]["url"] for p in req["messages"][0]["content"][1:]]
    assert urls == ["data:image/png;base64,QQ==", data_url(b"x"), "data:image/gif;base64,Qg=="]
    ((kw),) = connection_pool.made
    assert kw["max_connections"] == 2
    backend = kw["network_backend"]
    assert isinstance(backend, GuardedBackend) and backend.allow == f.allow and backend.dns is f.dns


def test_the_images_of_a_request_share_one_budget(connection_pool):
    connection_pool.pool = Pool({"http://h/a": image(b"x" * 6), "http://h/b": image(b"y" * 6)})
    with pytest.raises(APIError) as e:
        asyncio.run(fetch_remote(chat("http://h/a", "http://h/b"), fetcher(), 10))
    assert "over 10 bytes together" in e.value.message
    req = chat("http://h/a", "http://h/b")
    asyncio.run(fetch_remote(req, fetcher(), 12))  # at the limit
    assert req["messages"][0]["content"][2]["image_url"]["url"] == data_url(b"y" * 6)


def test_one_failed_fetch_cancels_the_others(connection_pool):
    connection_pool.pool = Pool({"http://h/slow": Answer(hang=True), "http://h/bad": Answer(404)})
    req = chat("http://h/slow", "http://h/bad")
    with pytest.raises(APIError, match="HTTP 4xx"):
        asyncio.run(fetch_remote(req, fetcher(), 1000))
    assert connection_pool.pool.cancelled == ["http://h/slow"]
    assert req["messages"][0]["content"][1]["image_url"]["url"] == "http://h/slow"  # untouched


def test_the_others_are_cancelled_and_ended_before_the_400_is_raised(connection_pool):
    """The fetches left when one fails are cancelled at once (not left to their 30 s
    deadline) and have ended by the time the 400 reaches the caller: nothing of the
    request still runs behind its answer."""
    import time

    slow = Answer(hang=True, cleanup_steps=3)
    connection_pool.pool = Pool({"http://h/bad": Answer(404), "http://h/slow": slow})

    async def main() -> tuple[list[str], float]:
        t0 = time.monotonic()
        with pytest.raises(APIError, match="HTTP 4xx"):
            await fetch_remote(chat("http://h/bad", "http://h/slow"), fetcher(30.0), 1000)
        return list(connection_pool.pool.cancelled), time.monotonic() - t0

    seen, took = asyncio.run(main())
    assert seen == ["http://h/slow"]  # seen as the 400 came, not at the loop's close
    assert took < 10, took  # the deadline is 30 s


def test_a_hung_lookup_does_not_hold_the_interpreters_exit():
    """A name server that never answers holds its lookup's thread, never the process:
    the server exits on time with a lookup still hanging."""
    import subprocess
    import sys

    code = (
        "import asyncio, threading\n"
        "from omni_serve import media\n"
        "media.socket.getaddrinfo = lambda *a, **k: threading.Event().wait()\n"
        "async def main():\n"
        "    r = media.Resolver(4)\n"
        "    try:\n"
        "        await asyncio.wait_for(r.resolve('hangs.example', 80), 0.2)\n"
        "    except TimeoutError:\n"
        "        print('gave up', flush=True)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == "gave up\n", out.stderr[-2000:]


def test_the_url_checks_refuse_what_httpcore_cannot_request():
    media._check_url(WHERE, "https://h:443/x")
    for url, kind in [
        ("http://h:99999/", "not a valid http(s) URL"),
        ("http://\u00e9.example/", "not a valid http(s) URL"),
        ("file:///etc/passwd", "a redirect to a URL that is not http(s)"),
        ("https:///x", "not a valid http(s) URL (no host)"),
    ]:
        with pytest.raises(APIError) as e:
            media._check_url(WHERE, url)
        assert e.value.message == f"field '{WHERE}': could not fetch the image: {kind}", url
