"""Limits applied before work (issue 47 item 1): a prompt's, a chat's and a negative
prompt's characters capped where the body is parsed, from the stages' own token limits,
before anything is tokenized; image headers read in a slot of their own within a budget
of reads and time; remote fetches holding no body budget while they wait; and a resolver
whose hung lookups cannot hold the later fetches' lookups."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest
from omni_core.config import load_config
from omni_core.events import ImageProgress
from omni_serve import media
from omni_serve.errors import APIError
from omni_serve.limits import CHARS_PER_TOKEN, prompt_limits
from omni_serve.media import (
    HEADER_BUDGET_S,
    MAX_HEADER_READS,
    RemoteImages,
    Resolver,
    ResolverBusy,
    check_pixels,
    fetch_remote,
)

from .test_app_inprocess import FakePipe, client_of, image_chat
from .test_remote_image_ssrf import ALLOWED, PNG, Host, chat, png

CONFIGS = Path(__file__).parents[3] / "configs"
TOKENS = 4  # the stages' token limit in these tests
CHARS = TOKENS * CHARS_PER_TOKEN  # 128 characters
WHERE = "messages[0].content[1].image_url"


def stage(name: str, kind: str, **options: Any) -> SimpleNamespace:
    return SimpleNamespace(name=name, kind=kind, options={"model": "m", **options})


def text_pipe(**options: Any) -> FakePipe:
    """A text pipeline whose intake takes prompts of :data:`TOKENS` tokens."""
    pipe = FakePipe()
    pipe.config.stages[0] = stage("intake", "ar.intake", max_prompt_tokens=TOKENS, **options)
    return pipe


def image_pipe() -> FakePipe:
    """An image pipeline: ar.text_encode (the source) -> dit.text_encode -> dit.plan,
    both encoders cut at :data:`TOKENS` tokens; every request answers an image."""
    pipe = FakePipe()
    pipe.config.stages = [
        stage("text", "ar.text_encode", max_tokens=TOKENS),
        stage("encode", "dit.text_encode", max_sequence_length=TOKENS),
        stage("plan", "dit.plan"),
    ]
    pipe.config.edges = [
        SimpleNamespace(source="text", target="encode"),
        SimpleNamespace(source="encode", target="plan"),
    ]

    def final(rid: str) -> list[ImageProgress]:
        ev = ImageProgress(request_id=rid, stage="plan", is_last=True, payload={"width": 1})
        ev.arrays = {"image": b"png"}  # as the runtime hands them to the caller
        return [ev]

    pipe.script = final  # type: ignore[assignment]
    return pipe


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return str(err["message"])


# ---- the character caps ----


def test_the_caps_come_from_the_configs_stage_options():
    pytest.importorskip("omni_dit", reason="the DiT configs need omni-dit-stages")
    mixed = load_config(CONFIGS / "mixed_ar_dit.yaml")
    limits = prompt_limits(mixed.stages, mixed.edges)
    # the prompt goes to the AR intake (2048 tokens), the negative prompt to the text
    # encoder (16 tokens), not the other way round
    assert limits.prompt is not None and limits.negative_prompt is not None
    assert (limits.prompt.chars, limits.prompt.stage) == (2048 * CHARS_PER_TOKEN, "intake")
    assert (limits.negative_prompt.chars, limits.negative_prompt.stage) == (512, "text")
    dit = load_config(CONFIGS / "dit_image.yaml")
    limits = prompt_limits(dit.stages, dit.edges)
    assert limits.prompt is not None and limits.prompt.chars == 16 * CHARS_PER_TOKEN
    sd3 = load_config(CONFIGS / "sd3_image.yaml")  # max_sequence_length: 256 T5 tokens
    limits = prompt_limits(sd3.stages, sd3.edges)
    assert limits.prompt is not None and limits.prompt.chars == 256 * CHARS_PER_TOKEN
    # unset: the most dit.text_encode takes, 512
    unset = [msgspec.structs.replace(sd3.stages[0], options={"model": "m"})]
    limits = prompt_limits(unset, [])
    assert limits.prompt is not None and limits.prompt.chars == 512 * CHARS_PER_TOKEN


def test_a_prompt_at_the_cap_passes_and_one_past_is_a_400():
    pipe = text_pipe()
    client = client_of(pipe)
    assert client.post("/v1/completions", json={"prompt": "a" * CHARS}).is_success
    assert client.post("/v1/completions", json={"prompt": ["é" * CHARS]}).is_success
    assert len(pipe.requests) == 2
    says = refused(client.post("/v1/completions", json={"prompt": "a" * (CHARS + 1)}), "prompt")
    assert f"{CHARS + 1} characters" in says and f"limit of {CHARS}" in says, says
    assert "max_prompt_tokens of stage 'intake'" in says, says
    refused(client.post("/v1/completions", json={"prompt": ["é" * (CHARS + 1)]}), "prompt")
    assert len(pipe.requests) == 2


def test_each_message_and_the_whole_chat_are_capped():
    pipe = text_pipe()
    client = client_of(pipe)

    def post(*texts: str | list[str]) -> httpx.Response:
        messages = [
            {
                "role": "user",
                "content": t if isinstance(t, str) else [{"type": "text", "text": p} for p in t],
            }
            for t in texts
        ]
        return client.post("/v1/chat/completions", json={"messages": messages})

    half = CHARS // 2
    assert post("a" * CHARS).is_success
    assert post(["a" * half, "b" * half]).is_success  # text parts count together
    assert post("a" * half, "b" * half).is_success  # the whole chat, at the cap
    assert len(pipe.requests) == 3
    refused(post("a" * (CHARS + 1)), "messages[0].content")
    refused(post("a", ["a" * half, "b" * (half + 1)]), "messages[1].content")
    says = refused(post("a" * half, "b" * (half + 1)), "messages")
    assert f"{CHARS + 1} characters" in says, says
    assert len(pipe.requests) == 3


def test_image_prompts_are_capped_by_the_encoders():
    pytest.importorskip("omni_dit", reason="the DiT stages need omni-dit-stages")
    pipe = image_pipe()
    client = client_of(pipe)
    path = "/v1/images/generations"
    ok = client.post(path, json={"prompt": "a" * CHARS, "negative_prompt": "b" * CHARS})
    assert ok.is_success, ok.text
    assert len(pipe.requests) == 1
    says = refused(client.post(path, json={"prompt": "a" * (CHARS + 1)}), "prompt")
    assert "max_tokens of stage 'text'" in says, says
    body = {"prompt": "a", "negative_prompt": "b" * (CHARS + 1)}
    says = refused(client.post(path, json=body), "negative_prompt")
    assert "stage 'text'" in says or "stage 'encode'" in says, says
    assert len(pipe.requests) == 1


def test_a_19_mb_prompt_is_refused_fast_and_never_reaches_the_pipeline():
    pipe = FakePipe()  # the intake's default: 2048 tokens
    client = client_of(pipe)
    body = b'{"prompt": "' + b"a" * (19 << 20) + b'"}'
    t0 = time.monotonic()
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    took = time.monotonic() - t0
    refused(r, "prompt")
    assert not pipe.requests
    assert took < 2.0, took  # the tokenizer would spend seconds on it


# ---- image headers ----


def png_with_chunks(empty: int, full: int = 0) -> bytes:
    """A 1x1 PNG with ``empty`` empty and ``full`` one-byte private chunks before IDAT."""

    def chunk(cid: bytes, data: bytes = b"") -> bytes:
        crc = zlib.crc32(cid + data)
        return struct.pack(">I", len(data)) + cid + data + struct.pack(">I", crc)

    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
    body = chunk(b"ruBy") * empty + chunk(b"ruBy", b"x") * full
    idat = chunk(b"IDAT", zlib.compress(b"\0\0\0\0"))
    return b"\x89PNG\r\n\x1a\n" + ihdr + body + idat + chunk(b"IEND")


def reads_of(raw: bytes) -> int:
    """How many reads Pillow makes of ``raw`` to open it."""
    from PIL import Image

    class Counting(io.BytesIO):
        reads = 0

        def read(self, size: int | None = -1) -> bytes:
            self.reads += 1
            return super().read(size)

    stream = Counting(raw)
    with Image.open(stream, formats=["PNG"]):
        return stream.reads


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def test_a_header_at_its_read_budget_passes_and_one_past_is_a_400():
    at, past = png_with_chunks((MAX_HEADER_READS - 6) // 2), png_with_chunks(1020, 1)
    assert (reads_of(at), reads_of(past)) == (MAX_HEADER_READS, MAX_HEADER_READS + 1)
    check_pixels([(WHERE, {"url": data_url(at)})], 10, set())
    with pytest.raises(APIError) as e:
        check_pixels([(WHERE, {"url": data_url(past)})], 10, set())
    assert e.value.param == WHERE and f"{MAX_HEADER_READS} reads" in e.value.message


def test_a_header_past_its_time_budget_is_a_400(monkeypatch):
    ticks = iter(range(0, 1000, 1))  # each read a second later than the one before
    monkeypatch.setattr(media.time, "monotonic", lambda: float(next(ticks)))
    raw = png_with_chunks(int(HEADER_BUDGET_S) + 2)
    with pytest.raises(APIError) as e:
        check_pixels([(WHERE, {"url": data_url(raw)})], 10, set())
    assert e.value.param == WHERE and f"over {HEADER_BUDGET_S:g} s" in e.value.message


def test_a_png_chunk_bomb_is_refused_within_its_budget():
    mm = FakePipe(intake="ar.mm_intake")
    client = client_of(mm)
    bomb = data_url(png_with_chunks(800_000))  # 9.6 MB: Pillow alone takes seconds
    t0 = time.monotonic()
    r = client.post("/v1/chat/completions", json=image_chat(bomb))
    took = time.monotonic() - t0
    assert f"{MAX_HEADER_READS} reads" in refused(r, WHERE)
    assert took < 2 * HEADER_BUDGET_S, took
    assert not mm.requests


def test_image_headers_do_not_hold_the_body_parsing_slot(monkeypatch):
    """While an image's header is being read (held here), a big body is still parsed."""
    mm = FakePipe(intake="ar.mm_intake")
    reading, release = threading.Event(), threading.Event()
    real = media.image_size

    def slow(image: bytes | str, start: int = 0) -> tuple[int, int]:
        reading.set()
        release.wait(10)
        return real(image, start)

    monkeypatch.setattr(media, "image_size", slow)
    image = image_chat(data_url(PNG + b"\0" * 60_000))  # over 64 KiB: read off the loop
    big = {"prompt": "hi", "stop": "y" * 70_000}  # over 64 KiB: parsed off the loop
    answers: list[httpx.Response] = []
    with client_of(mm) as client:
        t = threading.Thread(
            target=lambda: answers.append(client.post("/v1/chat/completions", json=image))
        )
        t.start()
        try:
            assert reading.wait(10)
            t0 = time.monotonic()
            assert client.post("/v1/completions", json=big).is_success
            assert time.monotonic() - t0 < 5  # it never waited for the header's slot
            assert not answers  # the image request is still in its header check
        finally:
            release.set()
            t.join(15)
    assert answers and answers[0].is_success, answers


# ---- remote images: the body budget, the resolver ----


@pytest.fixture
def public() -> Iterator[Host]:
    host = Host("127.0.0.2", {"/cat.png": png})
    yield host
    host.close()


def test_the_body_budget_is_given_back_while_images_are_fetched(public):
    mm = FakePipe(intake="ar.mm_intake")
    client = client_of(mm, allow_remote_images=True, remote_images_allow=("127.0.0.2/32",))
    server = client.app.state.server  # type: ignore[attr-defined]
    held: list[int] = []

    def seen(h: Any) -> None:
        held.append(server.bodies.used)
        png(h)

    public.routes["/seen.png"] = seen
    body = image_chat(public.url("/seen.png"))
    body["stop"] = "y" * 100_000  # a body over 64 KiB: counted
    r = client.post("/v1/chat/completions", json=body)
    assert r.is_success, r.text
    assert held == [0]


@pytest.fixture
def hung(monkeypatch) -> Iterator[threading.Event]:
    """``getaddrinfo`` of names ending ``.hang.test`` blocks until the event is set."""
    real, release = socket.getaddrinfo, threading.Event()

    def lookup(host: str, *args: Any, **kw: Any) -> Any:
        if str(host).endswith(".hang.test"):
            release.wait(30)
            raise socket.gaierror("no answer")
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    yield release
    release.set()


def test_hung_lookups_cannot_starve_later_fetches(public, hung):
    fetcher = RemoteImages(ALLOWED, 0.5, 2)  # two fetch slots

    async def run() -> None:
        for i in range(4):  # more hung lookups than fetch slots, each cut at its deadline
            with pytest.raises(APIError) as e:
                await fetch_remote(chat(f"http://h{i}.hang.test/x.png"), fetcher, 1 << 20)
            assert "within 0.5 s" in e.value.message
        t0 = time.monotonic()
        request = chat(public.url("/cat.png"))
        await fetch_remote(request, fetcher, 1 << 20)
        assert request["messages"][0]["content"][1]["image_url"]["url"].startswith("data:")
        assert time.monotonic() - t0 < 0.5

    asyncio.run(run())


def test_the_resolver_bounds_its_outstanding_lookups(hung):
    resolver = Resolver(2)

    async def run() -> None:
        waits = [asyncio.ensure_future(resolver.resolve(f"{h}.hang.test", 80)) for h in "aab"]
        await asyncio.sleep(0.1)
        assert resolver.started == 2  # one thread for both lookups of a
        t0 = time.monotonic()
        with pytest.raises(ResolverBusy):  # full: refused at once, not queued
            await resolver.resolve("c.hang.test", 80)
        assert time.monotonic() - t0 < 0.1
        names = [t for t in threading.enumerate() if t.name.startswith("omni-dns")]
        assert names and all(t.daemon for t in names)
        hung.set()  # the name server answers at last: room again
        for w in waits:
            with pytest.raises(OSError):
                await w
        assert not resolver.pending
        assert await resolver.resolve("127.0.0.2", 80)

    asyncio.run(run())


def test_a_full_resolver_is_a_503_with_retry_after(hung):
    fetcher = RemoteImages(ALLOWED, 0.3, 1)  # 8 lookups outstanding at most

    async def run() -> APIError:
        for i in range(media.DNS_LOOKUPS_PER_SLOT):
            with pytest.raises(APIError):
                await fetch_remote(chat(f"http://h{i}.hang.test/x.png"), fetcher, 1 << 20)
        with pytest.raises(APIError) as e:
            await fetch_remote(chat("http://late.hang.test/x.png"), fetcher, 1 << 20)
        return e.value

    e = asyncio.run(run())
    assert e.status == 503 and e.headers == {"Retry-After": "1"}, e.message
    assert "lookups are all busy" in e.message
