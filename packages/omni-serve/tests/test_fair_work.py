"""Each client's fair share of the heavy body work (``omni_serve.fair``), and what that
work costs: a client at its share goes on and one past it waits, before its next big body
is read, just until enough of its work is paid off, while another client's big body is
read at once and its own small bodies never wait; a client's big bodies sent at once
pass one at a time, spaced by its share; the body parsing slot and the image header slot count to
one share; the connection's body deadline is held while the
server holds a body back; an image's header check decodes no more of its base64 than
the header takes (a chunk bomb's megabytes are never decoded)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
import threading
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from omni_serve import body as body_module
from omni_serve import connections, media
from omni_serve.body import COUNT_PIECE, INLINE_BYTES, _structural
from omni_serve.errors import APIError
from omni_serve.fair import (
    BODY_HELD,
    BURST_S,
    PARSE_S_PER_BYTE,
    SHARE,
    FairSlot,
    WorkShares,
    body_turn,
)
from omni_serve.keys import ApiKey
from omni_serve.media import B64_FIRST, B64_PIECE, MAX_HEADER_READS, BadBase64, check_pixels
from omni_serve.settings import ServeSettings

from .test_app_inprocess import FakePipe, client_of
from .test_limits_before_work import WHERE, data_url, png_with_chunks, reads_of
from .test_remote_image_ssrf import PNG

ALLOWANCE = BURST_S  # the seconds of heavy work a client may owe and go on
PAY_S = BURST_S / SHARE  # how long that takes to pay off
KEYS = {name: f"{name}-{'k' * 40}" for name in ("a", "b")}
BIG = {"prompt": "hi", "stop": "y" * 70_000}  # over INLINE_BYTES: parsed in the slot


class Clock:
    """A clock that sleeps by moving on, noting each wait."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def test_a_client_at_its_share_goes_on_and_one_past_waits_until_it_is_paid_off():
    clock = Clock()
    shares = WorkShares(clock=clock, sleep=clock.sleep)

    async def run() -> None:
        shares.add("key:a", ALLOWANCE)  # exactly what it may owe, ending at 1000
        await shares.turn("key:a")
        assert clock.waits == []
        clock.now += 0.5  # pays off 0.5 x SHARE of it
        shares.add("key:a", 0.5 * SHARE + 0.01)  # one past it
        await shares.turn("key:b")  # another client: at once
        assert clock.waits == []
        await shares.turn("key:a")  # until 0.01 s of work more is paid off
        assert clock.waits == [pytest.approx(0.01 / SHARE)]
        assert shares.owed_s("key:a", clock.now) == pytest.approx(ALLOWANCE)
        await shares.turn("key:a")  # at its share again: at once
        assert len(clock.waits) == 1
        assert shares.gave_back == {}  # nothing of the wait left behind

    asyncio.run(run())


def test_work_is_paid_off_at_the_share_and_never_saved_up():
    """A client idle for a long time may still owe only ``BURST_S`` before it waits:
    the time it did no work is not credit for a longer burst later."""
    clock = Clock()
    shares = WorkShares(clock=clock, sleep=clock.sleep)
    shares.add("key:a", 0.001)
    clock.now += 3600
    assert shares.owed_s("key:a", clock.now) == 0
    shares.add("key:a", ALLOWANCE)
    assert shares.wait_s("key:a") == 0
    shares.add("key:a", 0.001)
    assert shares.wait_s("key:a") == pytest.approx(0.001 / SHARE)


def test_both_slots_count_to_one_share():
    """Time in the image header slot makes the same client wait for the parsing slot
    (and is counted even though the work raised)."""
    clock = Clock()
    shares = WorkShares(clock=clock, sleep=clock.sleep)
    parsing, headers = FairSlot(shares), FairSlot(shares)

    async def run() -> None:
        with pytest.raises(RuntimeError):
            async with headers.hold("key:a"):
                clock.now += ALLOWANCE + 0.01  # a bomb's header read past the share
                raise RuntimeError("refused")
        async with parsing.hold("key:b"):  # another client: at once
            pass
        assert clock.waits == []
        async with parsing.hold("key:a"):
            pass
        # it owed ALLOWANCE + 0.01 at the end of its read: it waits to pay off 0.01
        assert clock.waits == [pytest.approx(0.01 / SHARE)]

    asyncio.run(run())


def test_clients_gone_are_swept():
    clock = Clock()
    shares = WorkShares(clock=clock, sleep=clock.sleep)
    for i in range(64):
        shares.add(f"address:10.0.0.{i}", 0.001)
    clock.now += 0.001 / SHARE  # all 64 paid off
    shares.add("address:10.0.1.1", 0.001)  # the 65th
    assert list(shares.paid_at) == ["address:10.0.1.1"]


def test_big_bodies_sent_at_once_pass_the_gate_one_at_a_time_as_the_share_has_room():
    """Four big bodies of one client at once: each is counted (by its size) from the
    time it passes the gate, so past the client's burst the next waits until the share
    has room for it, rather than all passing before any is parsed; another client's
    passes meanwhile. Once a body's block ends its estimate is taken back: what counts
    is its parse, as timed."""
    clock = Clock()
    shares = WorkShares(clock=clock, sleep=clock.sleep)
    size = int(0.6 * BURST_S / PARSE_S_PER_BYTE)  # each counted as 0.6 of the burst
    passed: list[tuple[str, float]] = []
    request = {host: SimpleNamespace(client=SimpleNamespace(host=host), scope={}) for host in "ab"}

    async def body(host: str) -> None:
        async with body_turn(request[host], shares, size):  # type: ignore[arg-type]
            passed.append((host, clock.now))
            await asyncio.sleep(0)  # the others try to pass meanwhile

    async def run() -> None:
        await asyncio.gather(body("a"), body("a"), body("a"), body("b"))

    asyncio.run(run())
    ahead = 0.6 * BURST_S
    # a's first two pass at once (0.6, then 1.2 of the burst owed); its third waits
    # until 0.2 of the burst is paid off (no earlier: the first two hold their estimates)
    third = 1000.0 + (2 * ahead - BURST_S) / SHARE
    assert [t for host, t in passed if host == "a"] == [1000.0, 1000.0, pytest.approx(third)]
    assert clock.waits == [pytest.approx(third - 1000.0)]  # a's third alone waited: not b
    # every estimate taken back: nothing was parsed, so nothing is owed
    assert shares.owed_s("address:a", clock.now) == 0
    # a parse timed in the slot stays counted
    shares.add("address:a", 0.01)
    assert shares.owed_s("address:a", clock.now) == pytest.approx(0.01)


def test_a_bodys_own_estimate_never_holds_its_parse():
    """A client exactly at its share reads its big body, and then its parse goes on at
    once: the estimate counted while the body was read is taken back before the slot."""
    clock = Clock()
    shares = WorkShares(clock=clock, sleep=clock.sleep)
    request = SimpleNamespace(client=SimpleNamespace(host="a"), scope={})
    shares.add("address:a", BURST_S)

    async def run() -> None:
        async with body_turn(request, shares, 8 << 20):  # type: ignore[arg-type]
            assert shares.owed_s("address:a", clock.now) > BURST_S  # read meanwhile
        async with FairSlot(shares).hold("address:a"):  # its parse
            clock.now += 0.001
        assert clock.waits == []

    asyncio.run(run())


def test_a_waiting_body_goes_on_once_an_estimate_is_given_back():
    """B waits for A's estimate (twice the burst: a body of no Content-Length counts at
    the body limit); A's read ends first and gives it back, and B goes on then, not
    after the wait the estimate alone made (its timer here never fires); nothing of the
    wait is left behind."""
    clock = Clock()

    async def sleep(seconds: float) -> None:  # a timer that never fires
        clock.waits.append(seconds)
        await asyncio.Event().wait()

    shares = WorkShares(clock=clock, sleep=sleep)
    request = SimpleNamespace(client=SimpleNamespace(host="a"), scope={})
    size = int(2 * BURST_S / PARSE_S_PER_BYTE)
    passed: list[tuple[str, float]] = []

    async def body(name: str, reads: int) -> None:
        async with body_turn(request, shares, size):  # type: ignore[arg-type]
            passed.append((name, clock.now))
            for _ in range(reads):
                await asyncio.sleep(0)

    async def run() -> None:
        await asyncio.wait_for(asyncio.gather(body("A", 1), body("B", 0)), 5)

    asyncio.run(run())
    assert passed == [("A", 1000.0), ("B", 1000.0)]
    assert clock.waits == [pytest.approx(BURST_S / SHARE)]  # what B would have waited
    assert shares.gave_back == {}


def test_a_refund_is_never_credit():
    clock = Clock()
    shares = WorkShares(clock=clock, sleep=clock.sleep)
    shares.add("key:a", 0.01)
    clock.now += 1.0  # paid off
    shares.refund("key:a", 0.01)
    shares.add("key:a", BURST_S)
    assert shares.wait_s("key:a") == 0
    shares.add("key:a", 0.001)
    assert shares.wait_s("key:a") == pytest.approx(0.001 / SHARE)


def test_a_client_past_its_share_waits_unread_while_another_is_served(monkeypatch):
    """Key a, past its share, waits before its big body is read (its bytes unread), while
    key b's big body is read and answered, and a's small bodies are never held; once the
    window forgets a's work its body is read and answered. At its share, a waits not."""
    reads: list[str] = []
    real = body_module.read_body

    async def read_body(request: Any, limit: int, lease: Any = None) -> bytearray:
        if int(request.headers.get("content-length", 0)) > INLINE_BYTES:
            reads.append(request.headers["authorization"][7])  # the key's name
        return await real(request, limit, lease)

    monkeypatch.setattr(body_module, "read_body", read_body)
    waiting, release = threading.Event(), threading.Event()
    keys = tuple(ApiKey(name, key) for name, key in KEYS.items())
    answers: list[httpx.Response] = []
    with client_of(FakePipe(), api_keys=keys) as client:
        server = client.app.state.server  # type: ignore[attr-defined]

        async def sleep(seconds: float) -> None:
            waiting.set()
            await asyncio.to_thread(release.wait, 10)
            server.work.paid_at.pop("key:a", None)  # a's work is paid off

        server.work.sleep = sleep

        def post(key: str, body: dict[str, Any]) -> httpx.Response:
            auth = {"Authorization": f"Bearer {KEYS[key]}"}
            return client.post("/v1/completions", json=body, headers=auth)

        server.work.add("key:a", ALLOWANCE)  # at its share
        assert post("a", BIG).is_success and not waiting.is_set()
        assert reads == ["a"] and server.work.owed_s("key:a", server.work.clock()) > ALLOWANCE
        t = threading.Thread(target=lambda: answers.append(post("a", BIG)))
        t.start()
        try:
            assert waiting.wait(10)
            assert post("b", BIG).is_success  # served while a waits
            assert post("a", {"prompt": "hi"}).is_success  # a small body never waits
            assert reads == ["a", "b"] and not answers  # a's big body: still unread
        finally:
            release.set()
            t.join(15)
    assert answers and answers[0].is_success, answers
    assert reads == ["a", "b", "a"]


# ---- what the heavy work costs ----


@pytest.fixture
def decoded(monkeypatch) -> list[int]:
    """The base64 characters each header check decodes, piece by piece."""
    out: list[int] = []
    real = media._b64_pieces

    def counting(data: str, start: int, end: int) -> list[bytes]:
        out.append(end - start)
        return real(data, start, end)

    monkeypatch.setattr(media, "_b64_pieces", counting)
    return out


def test_a_header_check_decodes_only_what_the_header_takes(decoded):
    check_pixels([(WHERE, {"url": data_url(PNG + bytes(3 << 20))})], 10, set())
    assert sum(decoded) == B64_FIRST  # of 4 MB of base64
    # a header at its read budget passes, one past is refused: each decodes at most
    # twice the base64 of the header at the budget (a 6 MB chunk bomb included)
    at = png_with_chunks((MAX_HEADER_READS - 6) // 2)
    assert reads_of(at) == MAX_HEADER_READS
    most = 2 * len(base64.b64encode(at))
    decoded.clear()
    check_pixels([(WHERE, {"url": data_url(at + bytes(3 << 20))})], 10, set())
    assert sum(decoded) <= most
    decoded.clear()
    bomb = data_url(png_with_chunks(500_000))
    with pytest.raises(APIError) as e:
        check_pixels([(WHERE, {"url": bomb})], 10, set())
    assert f"{MAX_HEADER_READS} reads" in e.value.message
    assert sum(decoded) <= most < len(bomb) // 100


@pytest.mark.parametrize(
    "n",
    [
        0,
        3,
        *(B64_FIRST * 3 // 4 + d for d in (0, 1)),
        *(B64_PIECE * 3 // 4 + d for d in (0, 1)),
        3 * B64_PIECE,
    ],
)
def test_an_image_read_through_its_base64_is_its_bytes(n: int):
    """Decoded as it is read (the first read: B64_FIRST characters, then at least twice
    as many each time), at a piece's size and one past it."""
    raw = bytes(range(256)) * (n // 256) + bytes(n % 256)
    url = data_url(raw)
    stream = media._Budgeted(url, math.inf, url.index(",") + 1)
    first = stream.read(7)
    assert first + stream.read() == raw
    stream.seek(0)
    assert stream.read(n + 1) == raw and stream.seek(0, 2) == n and stream.read(1) == b""


@pytest.mark.parametrize(
    "data",
    [
        "QUJD" * (B64_PIECE // 4) + bad  # past the first piece
        for bad in ("ab!d", "abc", "ab=d", "QQ==QUJD")
    ]
    + ["QUJD" * (B64_PIECE // 4 - 1) + "QQ==" + "QUJD"],  # padding at a piece's end
)
def test_base64_that_one_call_refuses_is_refused_where_it_is_read(data: str):
    with pytest.raises((binascii.Error, ValueError)):
        base64.b64decode(data, validate=True)
    with pytest.raises(BadBase64):
        media._Budgeted(data, math.inf).read()


def test_base64_broken_where_the_header_is_not_read_is_left_to_the_intake():
    tail_broken = data_url(PNG + bytes(3 << 20))[:-4] + "!!!!"
    head_broken = "data:image/png;base64,!!!!" + data_url(PNG)[22:]
    check_pixels([(WHERE, {"url": tail_broken})], 10, set())  # its header is fine
    check_pixels([(WHERE, {"url": head_broken})], 10, set())  # the intake names it


@pytest.mark.parametrize("at", [0, COUNT_PIECE - 2, COUNT_PIECE - 1, 3 * COUNT_PIECE + 5])
def test_commas_and_brackets_are_counted_across_pieces(at: int):
    raw = bytearray(b"x" * (4 * COUNT_PIECE))
    raw[at : at + 3] = b",[{"
    assert _structural(raw) == _structural(bytes(raw)) == 3
    assert _structural(b"") == 0


# ---- the body deadline while the server holds a body back ----


def test_a_body_held_by_the_server_has_no_deadline_meanwhile():
    """The connection's body deadline stops while the server holds the body unread and
    starts again, whole, when it reads it; a body not awaited (or done) is untouched."""
    armed: list[float] = []
    handles: list[SimpleNamespace] = []

    def call_later(delay: float, _callback: Any) -> SimpleNamespace:
        armed.append(delay)
        handles.append(SimpleNamespace(cancelled=False))
        handles[-1].cancel = lambda h=handles[-1]: setattr(h, "cancelled", True)
        return handles[-1]

    guard = connections._Guard()
    guard.limits = connections.ConnectionLimits(1.0, 7.0, 100)  # type: ignore[misc]
    guard.loop = SimpleNamespace(call_later=call_later)  # type: ignore[assignment]
    guard.transport = SimpleNamespace(is_closing=lambda: False)  # type: ignore[assignment]
    guard._phase = "body"
    guard._arm(7.0)
    guard._body_held(True)
    assert handles[0].cancelled and guard._timer is None
    guard._body_held(False)
    assert armed == [7.0, 7.0] and guard._timer is handles[1] and not handles[1].cancelled
    guard._phase = "busy"  # the body arrived: nothing to hold
    guard._disarm()
    guard._body_held(True)
    guard._body_held(False)
    assert len(armed) == 2


def test_body_turn_holds_the_deadline_only_while_it_waits():
    clock = Clock()
    shares = WorkShares(clock=clock, sleep=clock.sleep)
    told: list[bool] = []
    request = SimpleNamespace(client=None, scope={BODY_HELD: told.append})

    async def run() -> None:
        shares.add("address:?", ALLOWANCE)  # at its share: read at once
        async with body_turn(request, shares, 0):  # type: ignore[arg-type]
            assert told == [] and clock.waits == []
        shares.add("address:?", 0.01)  # one past
        async with body_turn(request, shares, 0):  # type: ignore[arg-type]
            assert told == [True, False] and clock.waits == [pytest.approx(0.01 / SHARE)]

    asyncio.run(run())


@pytest.mark.parametrize("share", [0.0, -0.1, 1.01])
def test_a_body_work_share_out_of_range_is_refused(share: float):
    with pytest.raises(ValueError, match="--body-work-share"):
        ServeSettings(model_name="fake", body_work_share=share)


@pytest.mark.parametrize("share", [0.001, 0.5, 1.0])
def test_the_body_work_share_is_the_servers(share: float):
    """``--body-work-share`` (at its edges too) is what the server holds clients to."""
    with client_of(FakePipe(), body_work_share=share) as client:
        work = client.app.state.server.work  # type: ignore[attr-defined]
        assert work.share == share
        work.add("key:a", work.burst_s)  # at its share: goes on
        assert work.wait_s("key:a") == 0
        work.add("key:a", 0.01)  # one past
        assert work.wait_s("key:a") > 0
