"""Complete checkpoints (SD3 and Flux layouts, text encoders included) through the stages,
against diffusers' own pipelines loaded with ``from_pretrained`` from the same directory.

The checkpoints are tiny (built offline from configs, tokenizers with a small local
vocabulary) and written with ``save_pretrained``, so they take the paths a real one takes.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from omni_core import Pipeline
from omni_core.config import ConfigError, parse_config
from omni_dit.architectures import architecture
from omni_dit.embedded import build_tiny_flux, build_tiny_sd3_full
from omni_dit.models import ModelError, resolve_model
from omni_dit.testing import checkpoint_image, checkpoint_pipeline, dit_config

SD3_REQUESTS = [
    {"prompt": "a red fox in the snow", "image": {"width": 64, "height": 64, "steps": 4}},
    {
        "prompt": "a blue cat",
        "image": {"width": 96, "height": 64, "steps": 4, "seed": 7, "guidance": 4.0},
    },
    {
        "prompt": "a dog on a tree",
        "image": {
            "width": 64,
            "height": 64,
            "steps": 4,
            "seed": 3,
            "guidance": 5.0,
            "negative_prompt": "snow",
        },
    },
    {"prompt": "the fox", "image": {"width": 64, "height": 64, "steps": 4, "seed": 1}},
    {
        "prompt": "a red tree",
        "image": {
            "width": 64,
            "height": 64,
            "steps": 4,
            "seed": 2,
            "guidance": 5.0,
            "negative_prompt": "a cat",
        },
    },
]
FLUX_REQUESTS = [
    {
        "prompt": "a red fox in the snow",
        "image": {"width": 64, "height": 64, "steps": 4, "guidance": 3.5},
    },
    {
        "prompt": "a blue cat",
        "image": {"width": 96, "height": 64, "steps": 4, "seed": 5, "guidance": 2.0},
    },
    {
        "prompt": "a dog on a tree",
        "image": {
            "width": 64,
            "height": 96,
            "steps": 4,
            "seed": 3,
            "guidance": 3.5,
            "true_cfg_scale": 3.0,
            "negative_prompt": "snow",
        },
    },
    {
        "prompt": "the cat",
        "image": {"width": 64, "height": 64, "steps": 4, "seed": 9, "guidance": 3.5},
    },
    # no guidance: the pipeline's 3.5; true_cfg_scale without a negative prompt: none
    {
        "prompt": "a tree",
        "image": {"width": 64, "height": 64, "steps": 4, "seed": 4, "true_cfg_scale": 2.0},
    },
]


@pytest.fixture(scope="module")
def sd3_full(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sd3-full")
    build_tiny_sd3_full(path)
    return str(path)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-flux")
    build_tiny_flux(path)
    return str(path)


def expected_images(model, requests, **components):
    torch.set_num_threads(1)  # the stages' thread count (another may change float rounding)
    pipe = checkpoint_pipeline(model, **components)
    return [checkpoint_image(pipe, r) for r in requests]


def config(model, enabled=True, text=None):
    cfg = dit_config(
        model, encode=False, enabled=enabled, text=text or {}, sample={"max_batch_size": 8}
    )
    cfg["stages"][3]["client_stream"] = True  # vae: the decoded image
    return cfg


def decoded(out):
    assert out.ok, out.error
    (ev,) = out.by_stage("vae")
    return ev.arrays["image"]


@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_staged_images_equal_the_diffusers_pipeline(arch, sd3_full, flux):
    """Several requests in flight (with and without guidance and a negative prompt, two
    sizes): each image equals the pipeline's at the same seed within 1e-5."""
    model, requests = (sd3_full, SD3_REQUESTS) if arch == "sd3" else (flux, FLUX_REQUESTS)
    expected = expected_images(model, requests)
    with Pipeline(config(model)) as pipe:
        outs = pipe.generate(requests)
        for out, exp in zip(outs, expected, strict=True):
            image = decoded(out)
            assert image.shape == exp.shape
            assert np.abs(image - exp).max() <= 1e-5, np.abs(image - exp).max()
        alone = decoded(pipe.generate([requests[2]])[0])  # alone in every batch
        assert np.abs(alone - expected[2]).max() <= 1e-5
        assert pipe.metrics()["stages"]["sample"]["shm_slots_in_use"] == 0
    assert len({e.tobytes() for e in expected}) == len(expected)


def test_sd3_encoder_options_as_the_pipeline_takes_them(sd3_full):
    """use_t5: false (T5 skipped, as SD3 allows), clip_skip and max_sequence_length."""
    requests = SD3_REQUESTS[1:3]
    expected = expected_images(sd3_full, requests, text_encoder_3=None, tokenizer_3=None)
    with Pipeline(config(sd3_full, enabled=False, text={"use_t5": False})) as pipe:
        for out, exp in zip(pipe.generate(requests), expected, strict=True):
            assert np.abs(decoded(out) - exp).max() <= 1e-5
    pipe_ref = checkpoint_pipeline(sd3_full)
    exp = checkpoint_image(pipe_ref, requests[1], clip_skip=1, max_sequence_length=24)
    opts = {"clip_skip": 1, "max_sequence_length": 24}
    with Pipeline(config(sd3_full, enabled=False, text=opts)) as pipe:
        out = pipe.generate([requests[1]])[0]
    assert np.abs(decoded(out) - exp).max() <= 1e-5


def test_architecture_from_model_index(sd3_full, flux, tmp_path):
    assert type(architecture(resolve_model(sd3_full))).__name__ == "SD3"
    assert type(architecture(resolve_model(flux))).__name__ == "Flux"
    other = tmp_path / "other"
    shutil.copytree(flux, other)
    index = json.loads((other / "model_index.json").read_text())
    index["_class_name"] = "PixArtSigmaPipeline"
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError) as e:
        architecture(resolve_model(str(other)))
    msg = str(e.value)
    assert (
        "PixArtSigmaPipeline" in msg and "StableDiffusion3Pipeline" in msg and "FluxPipeline" in msg
    )


def test_unsupported_architecture_fails_the_load_naming_it(flux, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(flux, other)
    index = json.loads((other / "model_index.json").read_text())
    index["_class_name"] = "PixArtSigmaPipeline"
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(Exception) as e, Pipeline(config(str(other), enabled=False)):
        pass
    assert "PixArtSigmaPipeline" in str(e.value) and "supported" in str(e.value)


def test_model_is_required_for_dit_stages():
    cfg = dit_config("tiny-sd3")
    del cfg["stages"][2]["options"]["model"]
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    assert "stages[2].options.model" in str(e.value) and "required" in str(e.value)


def test_bad_model_values_name_the_model(tmp_path):
    with pytest.raises(ModelError, match="not a directory"):
        resolve_model("no-such-model")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "transformer").mkdir()
    with pytest.raises(ModelError, match="missing model_index.json"):
        resolve_model(str(tmp_path / "half"))


def _hub_cache(root, repo, source):
    """A Hugging Face cache holding ``source`` as the snapshot of ``repo`` at main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(source, entry / "snapshots" / commit)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)


def test_hub_ids_resolve_through_the_cache_offline(flux, tmp_path, monkeypatch):
    """A Hugging Face id found in HF_HUB_CACHE runs (workers resolve it, offline); one
    that is not cached fails the start naming the id and HF_HUB_OFFLINE."""
    _hub_cache(tmp_path / "hub", "omni-test/tiny-flux", flux)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    expected = expected_images(flux, FLUX_REQUESTS[:1])[0]
    with Pipeline(config("omni-test/tiny-flux")) as pipe:
        image = decoded(pipe.generate(FLUX_REQUESTS[:1])[0])
    assert np.abs(image - expected).max() <= 1e-5
    with pytest.raises(Exception) as e, Pipeline(config("omni-test/not-cached", enabled=False)):
        pass
    assert "omni-test/not-cached" in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)


def test_bfloat16_follows_the_pipeline_in_bfloat16(sd3_full):
    """dtype bfloat16 on every part, against the pipeline loaded in bfloat16 (the VAE's
    output is post-processed in float32 here, in bfloat16 there: a few 1e-3 apart)."""
    request = SD3_REQUESTS[2]
    expected = expected_images(sd3_full, [request], dtype=torch.bfloat16)[0].astype(np.float32)
    cfg = config(sd3_full, enabled=False, text={"dtype": "bfloat16"})
    for stage in cfg["stages"][1:4]:
        stage["options"]["dtype"] = "bfloat16"
    with Pipeline(cfg) as pipe:
        image = decoded(pipe.generate([request])[0])
    assert image.dtype == np.float32
    assert np.abs(image - expected).max() <= 2e-2, np.abs(image - expected).max()


def test_plan_refuses_guidance_its_encoder_did_not_prepare(sd3_full):
    """dit.text_encode decides from its own image_defaults whether to encode the negative
    prompt; a plan whose defaults make the request guided fails it, naming why (no silent
    zeros for the negative prompt)."""
    cfg = config(sd3_full, enabled=False)
    cfg["stages"][1]["options"]["image_defaults"] = {"guidance": 5.0}
    with Pipeline(cfg) as pipe:
        out = pipe.generate([SD3_REQUESTS[0]])[0]
    assert out.finish_reason == "error"
    assert "did not encode a negative prompt" in out.error and "'plan'" in out.error


@pytest.mark.parametrize(
    ("model", "text", "message"),
    [
        ("tiny-sd3", {}, "text_encoder"),  # no text encoders in that checkpoint
        ("full", {"max_sequence_length": 600}, "max_sequence_length"),
        ("full", {"image_defaults": {"steps": "many"}}, "image_defaults"),
        ("flux", {"clip_skip": 1}, "clip_skip"),
    ],
)
def test_text_encoder_load_errors_name_the_cause(model, text, message, sd3_full, flux):
    model = {"full": sd3_full, "flux": flux}.get(model, model)
    with pytest.raises(Exception) as e, Pipeline(config(model, enabled=False, text=text)):
        pass
    assert message in str(e.value), str(e.value)
