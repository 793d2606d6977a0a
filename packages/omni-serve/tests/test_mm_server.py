"""Images in chat over HTTP: ``omni serve configs/mm_chat.yaml`` (the tiny Llava, built
offline into the server's cache; the media-free prefill -> decode handoff) driven by the
real ``openai`` client with image data URLs."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from .conftest import Server, start_server, stop_server

pytest.importorskip("transformers")

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "mm_chat.yaml"


@pytest.fixture(scope="module")
def mm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(CONFIG, tmp_path_factory.mktemp("mm-server"))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(mm_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mm_server.url}/v1", api_key="unused", max_retries=0)


def data_url(seed: int) -> str:
    from omni_ar.multimodal.testing import synthetic_image

    return "data:image/png;base64," + base64.b64encode(synthetic_image(seed)).decode()


def ask(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "the quick "},
                {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                {"type": "text", "text": " fox"},
            ],
        }
    ]


def test_a_chat_with_an_image_streams_text(client):
    kw = {
        "model": "mm_chat",
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    chunks = list(client.chat.completions.create(messages=ask(data_url(0)), stream=True, **kw))
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(deltas) > 1  # streamed, not one piece
    whole = client.chat.completions.create(messages=ask(data_url(0)), **kw)
    assert "".join(deltas) == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens > 16  # the image's placeholders are in the prompt
    other = client.chat.completions.create(messages=ask(data_url(3)), **kw)
    assert other.choices[0].message.content != whole.choices[0].message.content  # it saw it


@pytest.mark.parametrize(
    ("url", "param", "says"),
    [
        ("data:image/png;base64,@@@", "messages[0].content[1]", "invalid base64"),
        ("data:image/png;base64,aGVsbG8=", "messages[0].content[1]", "cannot decode image"),
        (
            "https://example.com/cat.png",
            "messages[0].content[1].image_url",
            "--allow-remote-images",
        ),
        ("/etc/hostname", "messages[0].content[1].image_url", "data URL"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_images_are_400s_naming_the_part(client, url, param, says, stream):
    with pytest.raises(openai.BadRequestError) as e:
        out = client.chat.completions.create(
            model="mm_chat", messages=ask(url), max_tokens=4, stream=stream
        )
        list(out) if stream else None
    assert e.value.body["param"] == param, e.value.body
    assert says in e.value.body["message"]
    assert "identify" not in e.value.body["message"]  # Pillow's own words stay in the log


def test_image_chat_logprobs_and_top_logprobs(client):
    """The multimodal decode gives each token's logprob and its alternatives too."""
    out = client.chat.completions.create(
        model="mm_chat",
        messages=ask(data_url(1)),
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4)
        assert c.top_logprobs[1].logprob <= c.top_logprobs[0].logprob


@pytest.fixture(scope="module")
def qwen_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """``omni serve configs/mm_chat_qwen.yaml``: the same stages on the tiny Qwen2.5-VL."""
    config = CONFIG.with_name("mm_chat_qwen.yaml")
    server = start_server(config, tmp_path_factory.mktemp("mm-qwen-server"))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    stop_server(server)


def test_an_m_rope_model_answers_about_images_of_two_sizes(qwen_client):
    """Two images of other sizes and aspect ratios in one chat (dynamic resolution): the
    answer streams, equals the whole one, and changes with the image."""
    from omni_ar.multimodal.testing import synthetic_image

    def url(seed: int, w: int, h: int) -> str:
        return "data:image/png;base64," + base64.b64encode(synthetic_image(seed, w, h)).decode()

    def two(a: str) -> list[dict]:
        msgs = ask(a)
        msgs[0]["content"].append({"type": "image_url", "image_url": {"url": url(9, 40, 90)}})
        return msgs

    kw = {"model": "mm_chat_qwen", "max_tokens": 10, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    chunks = client_chunks = list(
        qwen_client.chat.completions.create(messages=two(url(0, 96, 64)), stream=True, **kw)
    )
    text = "".join(c.choices[0].delta.content or "" for c in client_chunks if c.choices)
    whole = qwen_client.chat.completions.create(messages=two(url(0, 96, 64)), **kw)
    assert len(chunks) > 2 and text == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 10
    other = qwen_client.chat.completions.create(messages=two(url(4, 96, 64)), **kw)
    assert other.choices[0].message.content != whole.choices[0].message.content
