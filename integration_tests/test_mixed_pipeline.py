"""The mixed AR + diffusion pipeline end to end: an AR model writes the prompt (streamed
as text), the same model encodes it, the DiT stages paint it; tiny models throughout."""

import io

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

import torch  # noqa: E402
from omni_core import Pipeline  # noqa: E402
from omni_dit.testing import stock_image, stock_pipeline  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

ENCODER_TOKENS = 16


def mixed_config(llm, dit, **top):
    ar = {"model": llm, "threads": 1}
    d = {"model": dit, "threads": 1}
    names = ["intake", "prefill", "decode", "postprocess", "text", "plan", "sample", "vae"]
    names.append("encode")
    kinds = ["ar.intake", "ar.prefill", "ar.decode", "ar.postprocess", "ar.text_encode"]
    kinds += ["dit.plan", "dit.sample", "dit.vae", "dit.encode"]
    stages = []
    for name, kind in zip(names, kinds, strict=True):
        opts = ar if kind.startswith("ar.") else d
        if kind == "ar.text_encode":
            opts = {**ar, "max_tokens": ENCODER_TOKENS}
        if kind == "dit.encode":
            opts = {}
        stages.append({"name": name, "kind": kind, "options": opts})
    stages[3]["client_stream"] = True  # the expanded prompt, as text
    stages[6]["client_stream"] = "previews"
    stages[7]["client_stream"] = True  # the image before encoding, for the parity check
    edges = [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)]
    edges[2]["window"] = {"size": 1}
    return {"heartbeat_interval_s": 0.1, "stages": stages, "edges": edges, **top}


REQUESTS = [
    {
        "prompt": "a red fox",
        "max_tokens": 12,
        "image": {"steps": 4, "width": 64, "height": 64, "preview_every": 2},
    },
    {
        "prompt": "a lighthouse at dusk",
        "max_tokens": 9,
        "image": {"steps": 3, "width": 96, "height": 64, "format": "webp", "guidance": 3.0},
    },
    {
        "prompt": "snow",
        "max_tokens": 5,
        "image": {"steps": 2, "width": 64, "height": 96, "format": "png", "seed": 5},
    },
]


def reference_image(llm, dit, text, image):
    """The same image from one process: the tiny Llama encodes ``text`` (padded like the
    encoder stage pads), diffusers' SD3 pipeline paints it."""
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(llm)
    model = AutoModelForCausalLM.from_pretrained(llm).eval()
    ids = tok(text)["input_ids"][:ENCODER_TOKENS]
    n = max(1, len(ids))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = ids + [pad] * (ENCODER_TOKENS - len(ids))
    with torch.inference_mode():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
    embeds, pooled = hidden, hidden[:, :n].mean(dim=1)
    return stock_image(stock_pipeline(dit), embeds, pooled, image)


def test_mixed_pipeline_several_requests_in_flight(llm, dit, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    with Pipeline(mixed_config(llm, dit)) as pipe:
        handles = [pipe.submit(r) for r in REQUESTS]
        outs = [list(h) for h in handles]
        bad = pipe.generate(
            [
                {"prompt": "x", "max_tokens": 3, "image": {"width": 100}},
                {"prompt": "x", "max_tokens": -1},
            ]
        )
    for events, req in zip(outs, REQUESTS, strict=True):
        assert events[-1].event_type == "completed", events[-1]
        text = "".join(e.payload["text"] for e in events if e.stage == "postprocess")
        assert any(e.stage == "postprocess" for e in events)
        image = req["image"]
        previews = [e.step for e in events if e.stage == "sample"]
        every = image.get("preview_every", 0)
        assert previews == (list(range(every, image["steps"], every)) if every else [])
        (final,) = [e for e in events if e.stage == "encode" and e.event_type == "image"]
        assert final.is_last and final.step == image["steps"]
        fmt = image.get("format", "jpeg")
        pic = Image.open(io.BytesIO(final.arrays["image"]))
        assert pic.format == fmt.upper() and pic.size == (image["width"], image["height"])
        (decoded,) = [e.arrays["image"] for e in events if e.stage == "vae"]
        expected = reference_image(llm, dit, text.strip() or req["prompt"], image)
        assert np.abs(decoded - expected).max() <= 1e-5
    assert bad[0].finish_reason == "error" and "field 'image.width'" in bad[0].error
    assert "'plan'" in bad[0].error
    assert bad[1].finish_reason == "error" and "max_tokens" in bad[1].error


def test_forked_and_spawned_workers_give_the_same_tokens_and_images(
    llm, dit, tmp_path, monkeypatch
):
    """The zygote changes how a worker starts, not what it computes: AR tokens and the
    encoded image bytes are equal with ``backend.start`` zygote and spawn."""
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    seen = {}
    for start in ("zygote", "spawn"):
        with Pipeline(mixed_config(llm, dit, backend={"start": start})) as pipe:
            assert {h["started"] for h in pipe.health().values()} == {
                "forked" if start == "zygote" else "spawned"
            }
            outs = pipe.generate(REQUESTS[:2])
        assert all(o.finish_reason == "completed" for o in outs), [o.error for o in outs]
        seen[start] = [
            (
                [(e.tokens, e.payload.get("text")) for e in o.events if e.stage == "postprocess"],
                [
                    bytes(e.arrays["image"])
                    for e in o.events
                    if e.event_type == "image" and e.stage == "encode"
                ],
                [e.arrays["image"].tobytes() for e in o.events if e.stage == "vae"],
            )
            for o in outs
        ]
    assert seen["zygote"] == seen["spawn"]
    assert all(tokens and images for tokens, images, _ in seen["zygote"])
