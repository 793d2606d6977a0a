"""``omni serve configs/mm_chat.yaml --allow-remote-images``: an http(s) image URL is
fetched by the server and reaches the model as the same image in a data URL would (a
server of its own: the default, refusing such URLs, is test_mm_server's)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from .conftest import Server, start_server, stop_server
from .test_mm_server import CONFIG, ask, data_url

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def remote_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("mm-remote")
    # the image host is on loopback, which only an allow-list opens (test_remote_image_ssrf)
    server = start_server(
        CONFIG, where, "--allow-remote-images", "--remote-images-allow", "127.0.0.1/32"
    )
    yield server
    stop_server(server)


def test_remote_images_when_allowed(remote_server, image_host):
    url, _ = image_host  # cat.png: synthetic_image(0)
    client = openai.OpenAI(base_url=f"{remote_server.url}/v1", api_key="unused", max_retries=0)
    kw = {"model": "mm_chat", "max_tokens": 8, "temperature": 0}
    fetched = client.chat.completions.create(messages=ask(f"{url}/cat.png"), **kw)
    inline = client.chat.completions.create(messages=ask(data_url(0)), **kw)
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    assert fetched.usage == inline.usage
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=ask(f"{url}/missing.png"), **kw)
    assert e.value.body["param"] == "messages[0].content[1].image_url"
    assert "could not fetch the image: HTTP 4xx" in e.value.body["message"]
