"""The shipped real-checkpoint configs, run on the tiny complete checkpoints: the model
directory comes from the environment as a user gives it, and the staged image equals
diffusers' own pipeline loaded from that directory."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from omni_ar.models import packaged_model_ready
from omni_core import Pipeline, load_config
from omni_dit.embedded import build_tiny_flux, build_tiny_sd3_full
from omni_dit.testing import checkpoint_image, checkpoint_pipeline
from PIL import Image

SMOLLM2_MISSING = not packaged_model_ready("smollm2")
if SMOLLM2_MISSING and os.environ.get("CI"):
    raise RuntimeError("CI needs the packaged model: run `hatch run setup` first")


@pytest.fixture(scope="module")
def sd3_full(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sd3-full")
    build_tiny_sd3_full(path)
    return str(path)


def run_config(name, requests, **env):
    """The config as a user runs it (variables from the environment), its vae stage also
    streaming the decoded image for the comparison."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cfg = load_config(f"configs/{name}.yaml")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    cfg.stage("vae").client_stream = True
    with Pipeline(cfg) as pipe:
        return cfg, pipe.generate(requests)


def image_fields(cfg, request):
    """The request's image fields over the config's defaults, as plan reads them."""
    return {**cfg.stage("plan").options["image_defaults"], **request["image"]}


def check(out, expected):
    assert out.ok, out.error
    (decoded,) = out.by_stage("vae")
    assert np.abs(decoded.arrays["image"] - expected).max() <= 1e-5
    (final,) = out.by_stage("encode")
    assert Image.open(io.BytesIO(final.arrays["image"])).size == expected.shape[1::-1]


def test_sd3_image_config_on_a_checkpoint_directory(sd3_full):
    requests = [
        {"prompt": "a red fox in the snow", "image": {"width": 64, "height": 64, "steps": 3}},
        {
            "prompt": "a blue cat",
            "image": {"width": 96, "height": 64, "steps": 3, "negative_prompt": "a dog"},
        },
        {"prompt": "a tree", "image": {"width": 64, "height": 64, "steps": 3, "guidance": 1.0}},
    ]
    cfg, outs = run_config("sd3_image", requests, OMNI_SD3_MODEL=sd3_full)
    assert cfg.stage("text").options["model"] == sd3_full
    ref = checkpoint_pipeline(sd3_full)
    for req, out in zip(requests, outs, strict=True):
        check(out, checkpoint_image(ref, {**req, "image": image_fields(cfg, req)}))


def test_flux_image_config_on_a_checkpoint_directory(tmp_path):
    build_tiny_flux(tmp_path)
    requests = [
        {"prompt": "a red fox", "image": {"width": 64, "height": 64, "steps": 3}},
        {
            "prompt": "a cat",
            "image": {
                "width": 64,
                "height": 96,
                "steps": 3,
                "true_cfg_scale": 2.5,
                "negative_prompt": "a dog",
            },
        },
    ]
    cfg, outs = run_config("flux_image", requests, OMNI_FLUX_MODEL=str(tmp_path))
    ref = checkpoint_pipeline(str(tmp_path))
    for req, out in zip(requests, outs, strict=True):
        check(out, checkpoint_image(ref, {**req, "image": image_fields(cfg, req)}))


@pytest.mark.skipif(SMOLLM2_MISSING, reason="SmolLM2 is not pulled (`hatch run setup`)")
def test_mixed_ar_sd3_config_encodes_the_expanded_prompt(sd3_full):
    """SmolLM2 expands the prompt; the checkpoint's own encoders encode exactly that text."""
    request = {
        "prompt": "a red fox",
        "max_tokens": 12,
        "image": {"width": 64, "height": 64, "steps": 2},
    }
    cfg, (out,) = run_config("mixed_ar_sd3", [request], OMNI_SD3_MODEL=sd3_full)
    text = "".join(e.payload["text"] for e in out.by_stage("postprocess")).strip()
    assert text
    expected = checkpoint_image(
        checkpoint_pipeline(sd3_full), {"prompt": text, "image": image_fields(cfg, request)}
    )
    check(out, expected)
