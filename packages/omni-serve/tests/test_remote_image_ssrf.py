"""Chat images as an attacker sends them: remote URLs that lead to internal addresses
(directly, by name or through a redirect chain), hosts that trickle or never end, more
parts or bytes than allowed, a client that leaves mid-fetch, and image bombs.

Every host here is on loopback (the tests are offline): a host the test means to be
reachable listens on 127.0.0.2 and only 127.0.0.2/32 is allowed (``--remote-images-allow``),
while the target an attacker aims at listens on 127.0.0.1 and counts its connections."""

from __future__ import annotations

import asyncio
import base64
import http.server
import ipaddress
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from omni_serve.errors import APIError
from omni_serve.media import RemoteImages, address_allowed, fetch_remote

from .conftest import Server, start_server, stop_server

PNG = base64.b64decode(  # 1x1 RGB
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)
ALLOWED = (ipaddress.ip_network("127.0.0.2/32"),)


@dataclass
class Host:
    """A tiny HTTP server: ``routes`` maps a path to a handler; counts connections and
    notes when a client hung up on a trickle."""

    ip: str
    routes: dict[str, Callable[[http.server.BaseHTTPRequestHandler], None]]
    connections: int = 0
    hung_up: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def setup(self) -> None:
                host.connections += 1
                super().setup()

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                host.routes.get(self.path, lambda h: h.send_error(404, "SECRET-404"))(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer((self.ip, 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://{self.ip}:{self.port}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def redirect(to: str) -> Callable[[http.server.BaseHTTPRequestHandler], None]:
    def answer(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(302)
        h.send_header("Location", to)
        h.send_header("Content-Length", "0")
        h.end_headers()

    return answer


def png(h: http.server.BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "image/png")
    h.send_header("Content-Length", str(len(PNG)))
    h.end_headers()
    h.wfile.write(PNG)


def trickle(host: Host, every_s: float) -> Callable[[http.server.BaseHTTPRequestHandler], None]:
    """A byte every ``every_s`` of a body that would take minutes (each read is quick,
    the whole never ends); sets ``host.hung_up`` when the client closes."""

    def answer(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "image/png")
        h.send_header("Content-Length", "1000")
        h.end_headers()
        try:
            for _ in range(1000):
                h.wfile.write(b"x")
                h.wfile.flush()
                time.sleep(every_s)  # the trickle itself: a byte at a time, on purpose
        except OSError:
            host.hung_up.set()

    return answer


@pytest.fixture
def target() -> Iterator[Host]:
    """What an attacker aims at: a host on 127.0.0.1 (internal) that answers an image."""
    host = Host("127.0.0.1", {"/secret": png})
    yield host
    host.close()


@pytest.fixture
def public() -> Iterator[Host]:
    """A host the tests treat as public: on 127.0.0.2, allowed by :data:`ALLOWED`."""
    host = Host("127.0.0.2", {"/cat.png": png})
    yield host
    host.close()


def chat(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, *parts]}]}


def fetch(request: dict, allow=ALLOWED, timeout_s: float = 5.0, max_bytes: int = 1 << 20):
    asyncio.run(fetch_remote(request, RemoteImages(allow, timeout_s, 4), max_bytes))
    return request


def refused(request: dict, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        fetch(request, **kw)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    ("address", "ok"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("127.9.9.9", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("100.64.0.1", False),  # shared (carrier-grade NAT)
        ("169.254.169.254", False),  # cloud metadata
        ("0.0.0.0", False),
        ("224.0.0.1", False),  # multicast: "global" to Python 3.11
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped
        ("::ffff:8.8.8.8", True),
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 of 169.254.169.254
        ("2002:a00:1::", False),  # 6to4 of 10.0.0.1
    ],
)
def test_which_addresses_are_refused(address, ok):
    assert address_allowed(ipaddress.ip_address(address)) is ok
    net = ipaddress.ip_network(address)
    assert address_allowed(ipaddress.ip_address(address), (net,))  # the allow-list opens it


def test_a_redirect_chain_to_loopback_is_refused_at_its_last_hop(public, target):
    public.routes["/a"] = redirect("/b")  # relative, same host: allowed
    public.routes["/b"] = redirect(target.url("/secret"))
    e = refused(chat(public.url("/a")))
    assert e.param == "messages[0].content[1].image_url"
    assert "the address is refused" in e.message
    assert target.url("/secret") not in e.message and "127.0.0.1" not in e.message
    assert target.connections == 0 and public.connections == 2
    # control: with the target's network allowed the same chain reaches it
    out = fetch(chat(public.url("/a")), allow=(*ALLOWED, ipaddress.ip_network("127.0.0.1/32")))
    assert target.connections == 1
    assert out["messages"][0]["content"][1]["image_url"]["url"].endswith(
        base64.b64encode(PNG).decode()
    )


def test_internal_addresses_are_refused_without_connecting(target):
    urls = [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.255.255.1/x.png",
        f"http://localhost:{target.port}/secret",  # by name
        f"http://[::ffff:127.0.0.1]:{target.port}/secret",
        f"http://0.0.0.0:{target.port}/secret",
        target.url("/secret"),
    ]
    t0 = time.monotonic()
    for url in urls:
        e = refused(chat(url), timeout_s=30)
        assert "the address is refused" in e.message, (url, e.message)
    assert time.monotonic() - t0 < 5  # no connect attempt that waits for an answer
    assert target.connections == 0


def test_a_trickling_host_is_cut_at_the_total_deadline(public):
    public.routes["/slow.png"] = trickle(public, 0.2)  # every read well within any per-read limit
    t0 = time.monotonic()
    e = refused(chat(public.url("/slow.png")), timeout_s=1.5)
    took = time.monotonic() - t0
    assert "no complete answer within 1.5 s" in e.message
    assert 1.4 < took < 4, took
    assert public.hung_up.wait(2)  # the connection was closed


def test_generic_errors_never_echo_what_a_host_answered(public):
    e = refused(chat(public.url("/missing.png")))
    assert "HTTP 4xx" in e.message and "SECRET" not in e.message and "404" not in e.message
    public.routes["/loop"] = redirect("/loop")
    assert "more than 3 redirects" in refused(chat(public.url("/loop"))).message
    public.routes["/ftp"] = redirect("ftp://127.0.0.2/x")
    assert "not http(s)" in refused(chat(public.url("/ftp"))).message
    big = chat(public.url("/cat.png"), public.url("/cat.png"))
    e = refused(big, max_bytes=len(PNG) + 10)  # each fits, the two together do not
    assert "over 77 bytes together" in e.message.replace(str(len(PNG) + 10), "77")


# ---- through `omni serve configs/mm_chat.yaml` ----


@pytest.fixture(scope="module")
def mm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("transformers")
    from .test_mm_server import CONFIG

    server = start_server(
        CONFIG,
        tmp_path_factory.mktemp("mm-ssrf"),
        "--allow-remote-images",
        "--remote-images-allow",
        "127.0.0.2/32",
        "--remote-image-timeout",
        "20",
        "--max-chat-images",
        "2",
        "--max-image-bytes",
        "100000",
        "--max-chat-image-pixels",
        "1048576",
    )
    yield server
    stop_server(server)


def post(server: Server, request: dict, timeout: float = 60) -> httpx.Response:
    body = {"model": "mm_chat", "max_tokens": 2, **request}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_server_fetches_allowed_hosts_and_refuses_redirects_inward(mm_server, public, target):
    assert post(mm_server, chat(public.url("/cat.png"))).status_code == 200
    public.routes["/r"] = redirect(target.url("/secret"))
    e = error(post(mm_server, chat(public.url("/r"))))
    assert e["param"] == "messages[0].content[1].image_url" and "refused" in e["message"]
    assert target.connections == 0


def test_server_caps_parts_and_bytes_before_any_fetch(mm_server, public):
    three = chat(*[public.url("/cat.png")] * 3)
    e = error(post(mm_server, three))
    assert e["param"] == "messages" and "3 images" in e["message"]
    inline = "data:image/png;base64," + base64.b64encode(bytes(120_000)).decode()
    e = error(post(mm_server, chat(inline, public.url("/cat.png"))))
    assert e["param"] == "messages" and "--max-image-bytes" in e["message"]
    assert public.connections == 0


def test_a_client_that_leaves_cancels_its_fetch(mm_server, public):
    public.routes["/slow.png"] = trickle(public, 0.1)
    with pytest.raises(httpx.ReadTimeout):
        post(mm_server, chat(public.url("/slow.png")), timeout=1.0)
    left = time.monotonic()
    assert public.hung_up.wait(10), "the fetch went on after its client left"
    assert time.monotonic() - left < 5  # not the 20 s deadline
    assert mm_server.health().status_code == 200


def test_a_png_bomb_is_refused_from_its_header(mm_server):
    from omni_ar.multimodal.testing import png_bomb, synthetic_image

    bomb = png_bomb(4_000, 3_000)  # 36 MB as RGB, 35 KB as PNG
    url = "data:image/png;base64," + base64.b64encode(bomb).decode()
    t0 = time.monotonic()
    e = error(post(mm_server, chat(url)))
    assert time.monotonic() - t0 < 2
    assert e["param"] == "messages[0].content[1].image_url"
    assert "4000x3000 pixels" in e["message"] and "--max-chat-image-pixels" in e["message"]
    # --max-chat-image-pixels (1048576 here) holds; a small one still passes
    wide = "data:image/png;base64," + base64.b64encode(png_bomb(1100, 1000)).decode()
    assert "1100x1000 pixels" in error(post(mm_server, chat(wide)))["message"]
    small = "data:image/png;base64," + base64.b64encode(synthetic_image(0)).decode()
    assert post(mm_server, chat(small)).status_code == 200


def test_fetches_at_once_are_bounded_server_wide(public):
    active, most, lock = [0], [0], threading.Lock()

    def held(h: http.server.BaseHTTPRequestHandler) -> None:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.3)  # a slow host, so that fetches overlap where they may
        with lock:
            active[0] -= 1
        png(h)

    public.routes["/held.png"] = held
    for slots in (1, 3):
        most[0] = 0
        fetcher = RemoteImages(ALLOWED, 5.0, slots)

        async def two_requests(fetcher: RemoteImages = fetcher) -> None:
            reqs = [chat(public.url("/held.png"), public.url("/held.png")) for _ in range(2)]
            await asyncio.gather(*(fetch_remote(r, fetcher, 1 << 20) for r in reqs))

        asyncio.run(two_requests())
        assert most[0] == slots  # 4 fetches: 1 at a time, or 3 (the control)


# ---- URLs that cannot be fetched, the slot wait, DNS, formats, the chat pixel limit ----

BAD_URLS = [
    "http://no-such-host.invalid/x.png",  # does not resolve (socket.gaierror)
    "http://" + "a" * 64 + ".example/x.png",  # a DNS label over 63 characters (UnicodeError)
    "http://127.0.0.2:99999/x.png",  # port out of range
    "http://[::1/x.png",  # an IPv6 host never closed
    "http://\u00e9t\u00e9.example/x.png",  # not ASCII
]


@pytest.mark.parametrize("via", ["part", "redirect"])
def test_bad_urls_are_400s_naming_the_part_without_a_traceback(public, via, caplog):
    from .test_app_inprocess import FakePipe, client_of, image_chat

    mm = FakePipe(intake="ar.mm_intake")
    client = client_of(mm, allow_remote_images=True, remote_images_allow=("127.0.0.2/32",))
    for i, bad in enumerate(BAD_URLS):
        url = bad
        if via == "redirect":  # a hostile host's Location (read as latin-1, then joined)
            public.routes[f"/r{i}"] = redirect(bad)
            url = public.url(f"/r{i}")
        caplog.clear()
        r = client.post("/v1/chat/completions", json=image_chat(url))
        assert r.status_code == 400, (bad, r.text)
        err = r.json()["error"]
        assert err["param"] == "messages[0].content[1].image_url", (bad, err)
        assert "could not fetch the image" in err["message"], (bad, err)
        assert "Traceback" not in r.text and bad not in err["message"]
        assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= 40], bad
    assert not mm.requests


def test_the_wait_for_a_fetch_slot_is_inside_the_deadline(public):
    public.routes["/slow.png"] = trickle(public, 0.2)
    fetcher = RemoteImages(ALLOWED, 1.5, 1)  # one slot: the second fetch waits for it

    async def two() -> list[BaseException | None]:
        reqs = [chat(public.url("/slow.png")) for _ in range(2)]
        return await asyncio.gather(
            *(fetch_remote(r, fetcher, 1 << 20) for r in reqs), return_exceptions=True
        )

    t0 = time.monotonic()
    errors = asyncio.run(two())
    took = time.monotonic() - t0
    assert all(isinstance(e, APIError) and "within 1.5 s" in e.message for e in errors), errors
    assert took < 2.7, took  # both within one deadline, not one after the other (3 s)


def test_host_names_are_resolved_in_an_executor_of_their_own(public, monkeypatch):
    import socket

    threads: list[str] = []
    real = socket.getaddrinfo

    def recorded(*args, **kw):
        threads.append(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", recorded)
    url = f"http://localhost:{public.port}/cat.png"  # a name: resolved (127.0.0.1: refused)
    assert "the address is refused" in refused(chat(url)).message
    assert threads and all(t.startswith("omni-dns") for t in threads), threads


def test_only_common_image_formats_are_opened():
    from omni_serve.media import check_pixels

    # Pillow would open EPS (Ghostscript renders it) and read its size from the header
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 50 40\n%%EndComments\nshowpage\n"
    url = "data:application/postscript;base64," + base64.b64encode(eps).decode()
    where = "messages[0].content[1].image_url"
    with pytest.raises(APIError) as e:
        check_pixels([(where, {"url": url})], 10, {where})  # fetched: refused here
    assert e.value.param == where and "not an image" in e.value.message, e.value.message
    check_pixels([(where, {"url": url})], 10, set())  # inline: left to the intake
    ok = "data:image/png;base64," + base64.b64encode(PNG).decode()
    check_pixels([(where, {"url": ok})], 10, {where})


def test_chat_images_have_a_pixel_limit_of_their_own():
    import io

    from omni_serve import ServeSettings
    from omni_serve.cli import parser
    from PIL import Image

    from .test_app_inprocess import FakePipe, client_of, image_chat

    assert ServeSettings(model_name="m").max_chat_image_pixels == 16_000_000
    assert parser().parse_args(["x.yaml"]).max_chat_image_pixels == 16_000_000

    def data_url(w: int, h: int) -> str:
        out = io.BytesIO()
        Image.new("RGB", (w, h)).save(out, format="PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()

    mm = FakePipe(intake="ar.mm_intake")
    # a screenshot passes although generated images are held to 1 MP
    client = client_of(mm, max_image_pixels=1 << 20)
    assert client.post("/v1/chat/completions", json=image_chat(data_url(1920, 1080))).is_success
    client = client_of(mm, max_chat_image_pixels=1000)
    r = client.post("/v1/chat/completions", json=image_chat(data_url(40, 30)))
    assert r.status_code == 400 and "40x30 pixels" in r.text, r.text
    assert "--max-chat-image-pixels" in r.json()["error"]["message"]
