"""The DiT stages end to end, against diffusers' own StableDiffusion3Pipeline.

One pipeline serves most tests (a worker start imports torch and diffusers for seconds);
its vae stage also streams its decoded image to the caller, so parity is checked on the
image before encoding.
"""

import io

import numpy as np
import pytest
import torch
from omni_core import Pipeline
from omni_dit.testing import dit_config, stock_pipeline
from omni_dit.testing import stock_image as reference
from omni_testing.encoders import hash_conditioning
from PIL import Image

REQUESTS = [
    {"prompt": "a red fox in the snow", "image": {"width": 64, "height": 64, "steps": 6}},
    {
        "prompt": "a lighthouse",
        "image": {"width": 96, "height": 64, "steps": 4, "seed": 7, "guidance": 4.0},
    },
    {"prompt": "a cat", "image": {"width": 64, "height": 96, "steps": 5, "seed": 3}},
    {"prompt": "a dog", "image": {"width": 64, "height": 64, "steps": 6}},
    {"prompt": "a tree", "image": {"width": 64, "height": 64, "steps": 6}},
]


def stock_image(model, request, width=32):
    """diffusers' pipeline from the same parts, embeddings given, on one thread like the
    stages (another thread count may change float rounding)."""
    torch.set_num_threads(1)
    embeds, pooled = hash_conditioning(request["prompt"], width, 8)
    embeds, pooled = torch.from_numpy(embeds)[None], torch.from_numpy(pooled)[None]
    return reference(stock_pipeline(model, width), embeds, pooled, request["image"])


@pytest.fixture(scope="module")
def expected(tiny_dit):
    return [stock_image(tiny_dit, r) for r in REQUESTS]


def config(model, enabled=True):
    cfg = dit_config(model, enabled=enabled, sample={"max_batch_size": 4})
    cfg["stages"][3]["client_stream"] = True  # vae: the image before encoding, too
    return cfg


@pytest.fixture(scope="module")
def pipe(tiny_dit):
    with Pipeline(config(tiny_dit)) as p:
        yield p


def decoded(out):
    (ev,) = out.by_stage("vae")
    return ev.arrays["image"]


def encoded(out):
    (ev,) = out.by_stage("encode")
    return ev.arrays["image"]


def test_decoded_image_equals_diffusers_pipeline(pipe, expected):
    """Requests in flight together; alike ones share a forward pass (within 1e-5)."""
    outs = pipe.generate(REQUESTS)
    for out, exp in zip(outs, expected, strict=True):
        assert out.ok, out.error
        image = decoded(out)
        assert image.shape == exp.shape and image.dtype == np.float32
        assert np.abs(image - exp).max() <= 1e-5
    assert len({decoded(o).tobytes() for o in outs}) == len(outs)


def test_one_at_a_time_is_bit_exact(pipe, expected):
    for req, exp in zip(REQUESTS[:2], expected, strict=False):
        out = pipe.generate([req])[0]
        assert np.array_equal(decoded(out), exp)


def test_same_bytes_across_runs_and_with_mrs_disabled(pipe, tiny_dit):
    """Encoded bytes are reproducible: across runs, and with mrs.enabled false."""
    requests = [
        {"prompt": "a fox", "image": {"width": 64, "height": 64, "steps": 3, "format": f}}
        for f in ("jpeg", "webp", "png")
    ]
    # one at a time: a micro-batch's floats may differ from a lone request's in the last
    # bit (matrix kernels block by batch size), so bytes are compared unbatched
    runs = [[encoded(pipe.generate([r])[0]) for r in requests] for _ in range(2)]
    with Pipeline(config(tiny_dit, enabled=False)) as inline:
        runs.append([encoded(o) for o in inline.generate(requests)])
    assert runs[0] == runs[1], "two runs differ"
    assert runs[0] == runs[2], "mrs.enabled false differs"
    for data, fmt in zip(runs[0], ("JPEG", "WEBP", "PNG"), strict=True):
        img = Image.open(io.BytesIO(data))
        assert img.format == fmt and img.size == (64, 64)


def test_previews_every_k_steps_in_order_then_final_image(pipe):
    req = {"prompt": "a fox", "image": {"width": 64, "height": 64, "steps": 7, "preview_every": 2}}
    out = pipe.generate([req])[0]
    assert out.ok, out.error
    previews = out.by_stage("sample")
    assert [e.step for e in previews] == [2, 4, 6]
    for e in previews:
        assert e.event_type == "image" and not e.is_last
        assert e.arrays["preview"].shape == (8, 8, 3) and e.arrays["preview"].dtype == np.uint8
        assert e.payload["steps"] == 7
    # vae streams to the caller on a path of its own: only its place among others varies
    assert [e.stage for e in out.events if e.stage != "vae"] == ["sample"] * 3 + ["encode"]
    final = out.by_stage("encode")[0]
    assert final.is_last and final.step == 7 and final.payload["media_type"] == "image/jpeg"
    assert Image.open(io.BytesIO(final.arrays["image"])).size == (64, 64)


def test_previews_of_a_shared_batch_go_each_to_its_request_at_its_own_steps(pipe):
    """Three alike requests in flight together, previews every 2 steps, every 3 and none:
    each gets its own steps' previews, and each preview is the one its request makes
    alone (within one level: a batch's floats may differ in the last bit)."""
    reqs = [
        {
            "prompt": p,
            "image": {"width": 64, "height": 64, "steps": 7, "preview_every": k, "seed": s},
        }
        for p, k, s in (("a fox", 2, 1), ("a lighthouse at night", 3, 5), ("a cat", 0, 9))
    ]
    # a request of another size ahead holds sample while the three queue behind it, so
    # they are taken as one batch
    blocker = {"prompt": "a tree", "image": {"width": 96, "height": 64, "steps": 40}}
    together = pipe.generate([blocker, *reqs])[1:]
    alone = [pipe.generate([r])[0] for r in reqs]
    for out, solo, want in zip(together, alone, ([2, 4, 6], [3, 6], []), strict=True):
        assert out.ok and solo.ok, (out.error, solo.error)
        previews = out.by_stage("sample")
        assert [e.step for e in previews] == want
        for got, ref in zip(previews, solo.by_stage("sample"), strict=True):
            diff = got.arrays["preview"].astype(int) - ref.arrays["preview"].astype(int)
            assert np.abs(diff).max() <= 1, got.step
    first = [o.by_stage("sample")[0].arrays["preview"] for o in together[:2]]
    assert np.abs(first[0].astype(int) - first[1].astype(int)).max() > 1  # two pictures


def test_cancel_mid_sampling_stops_the_loop(pipe):
    slow = {"prompt": "fox", "image": {"width": 64, "height": 64, "steps": 100, "preview_every": 1}}
    h = pipe.submit(slow)
    seen = []
    for ev in h:
        seen.append(ev)
        if ev.event_type == "image" and ev.step == 3:
            pipe.cancel(h.request_id)
    assert seen[-1].event_type == "cancelled"
    assert max(e.step for e in seen if e.event_type == "image") < 100
    ok = pipe.generate([REQUESTS[0]])[0]  # the stage goes on with the next request
    assert ok.ok, ok.error
    assert pipe.metrics()["stages"]["sample"]["shm_slots_in_use"] == 0


BAD = [
    ({"width": 100}, "image.width"),
    ({"height": 0}, "image.height"),
    ({"steps": 0}, "image.steps"),
    ({"width": 2048, "height": 2048}, "image.width"),
    ({"format": "gif"}, "image.format"),
    ({"quality": 0}, "image.quality"),
    ({"guidance": "high"}, "image.guidance"),
    ({"preview_every": -1}, "image.preview_every"),
    ({"sizes": 3}, "image.sizes"),
    ("big", "image"),
]


def test_bad_image_fields_end_only_their_request(pipe):
    good = {"prompt": "y", "image": {"steps": 2, "width": 64, "height": 64}}
    outs = pipe.generate([{"prompt": "x", "image": image} for image, _ in BAD] + [good])
    for out, (_, field) in zip(outs, BAD, strict=False):
        assert out.finish_reason == "error"
        assert f"field '{field}'" in out.error and "'plan'" in out.error, out.error
    assert outs[-1].ok, outs[-1].error


def test_conditioning_width_mismatch_is_an_error_naming_it(tiny_dit):
    cfg = dit_config(tiny_dit, enabled=False)
    cfg["stages"][0]["options"]["width"] = 16
    with Pipeline(cfg) as inline:
        out = inline.generate([{"prompt": "x", "image": {"steps": 2}}])[0]
    assert out.finish_reason == "error" and "joint_attention_dim" in out.error
