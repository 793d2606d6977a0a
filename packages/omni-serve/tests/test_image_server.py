"""/v1/images/generations over the mixed pipeline on tiny models (the Llama writes the
prompt, the tiny SD3 paints it), driven by the real ``openai`` client."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest

pytest.importorskip(
    "diffusers", reason="needs the DiT family (omni-dit-stages); runs in the workspace"
)
from PIL import Image  # noqa: E402


@pytest.fixture(scope="module")
def client(image_server):
    return openai.OpenAI(base_url=f"{image_server.url}/v1", api_key="unused", max_retries=0)


def decode(b64: str) -> Image.Image:
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    img.load()
    return img


def test_image_and_its_stream_with_previews(client):
    full = client.images.generate(
        model="tiny_mixed", prompt="a red fox", size="64x64", response_format="b64_json"
    )
    (item,) = full.data
    img = decode(item.b64_json)
    assert img.size == (64, 64) and img.format == "JPEG"  # the pipeline's default format
    assert item.revised_prompt  # the AR stages' expanded prompt

    events = list(client.images.generate(model="tiny_mixed", prompt="a red fox", stream=True))
    types = [e.type for e in events]
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    assert types[-1] == "image_generation.completed"
    # a preview after every step but the last (previews may be dropped under backpressure)
    assert 1 <= len(partials) <= 3
    assert [p.partial_image_index for p in partials] == list(range(len(partials)))
    steps = [p.step for p in partials]
    assert steps == sorted(set(steps)) and steps[-1] <= 3
    assert all(decode(p.b64_json).size == (8, 8) for p in partials)  # 1/8 of the image
    text = "".join(e.delta for e in events if e.type == "omni.text.delta")
    assert text == item.revised_prompt  # the same request, streamed
    done = events[-1]
    assert done.b64_json == item.b64_json  # the same image, bit for bit
    assert done.size == "64x64" and done.output_format == "jpeg"


def test_n_images_formats_and_partial_limit(client):
    out = client.images.generate(
        model="tiny_mixed", prompt="snow", n=2, size="64x96", output_format="png"
    )
    a, b = (decode(d.b64_json) for d in out.data)
    assert a.format == b.format == "PNG" and a.size == b.size == (64, 96)
    assert a.tobytes() != b.tobytes()  # seeds 0 and 1
    events = list(
        client.images.generate(model="tiny_mixed", prompt="snow", stream=True, partial_images=1)
    )
    assert [e.type for e in events if e.type.startswith("image_")] == [
        "image_generation.partial_image",
        "image_generation.completed",
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"size": "big"}, "size"),
        ({"size": "4096x4096"}, "size"),  # over the server's pixel limit
        ({"n": 3}, "n"),  # over --max-images 2
        ({"response_format": "url"}, "response_format"),
        ({"output_format": "gif"}, "output_format"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_image_requests_name_the_field(image_server, body, param):
    for stream in (False, True):
        r = httpx.post(
            f"{image_server.url}/v1/images/generations",
            json={"prompt": "x", "stream": stream, **body},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert "Traceback" not in r.text


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"size": "96x40"}, "size", "field 'image.height': 40 is not a positive multiple of 16"),
        ({"steps": 0}, "steps", "field 'image.steps': expected 1..100, got 0"),
        # passed through to plan, which knows the model (SD3 here) has no use for it
        ({"true_cfg_scale": 2.0}, "true_cfg_scale", "true_cfg_scale is for Flux"),
    ],
)
def test_fields_the_plan_stage_rejects(client, image_server, body, param, message):
    """The model's own limits are checked by the plan stage: a 400 naming the field; in a
    stream that has already sent the expanded prompt's text, an SSE error event."""
    r = httpx.post(
        f"{image_server.url}/v1/images/generations", json={"prompt": "x", **body}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert message in r.json()["error"]["message"]
    with pytest.raises(openai.APIError, match=message.replace("(", r"\(")):
        list(client.images.generate(model="tiny_mixed", prompt="x", stream=True, extra_body=body))
    assert client.images.generate(model="tiny_mixed", prompt="ok").data  # still serving
