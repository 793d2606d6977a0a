"""Where the model-bearing DiT stages (dit.text_encode, dit.sample, dit.vae) put their
models: ``omni_core.plugin.StageContext.place`` of the stage's ``devices`` and ``dtype`` option.

On a machine without a GPU (where this suite runs) a stage that asks for one fails its
load naming the stage, what it asked for and what torch sees; ``devices: cpu`` gives the
image of no ``devices`` key, bit for bit; ``dtype: auto`` is float32. The tests marked
``gpu`` run only where torch sees a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omni_core import Pipeline
from omni_core.errors import StageStartError
from omni_core.plugin import DeviceError, Placement
from omni_core.stage import StageContext
from omni_dit.stages import Sample, VaeDecode
from omni_dit.testing import dit_config, stock_image, stock_pipeline
from omni_dit.text_encode import TextEncode
from omni_testing.encoders import hash_conditioning

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="torch sees no GPU")
cpu_only = pytest.mark.skipif(GPU, reason="torch sees a GPU")

REQUESTS = [
    {"prompt": "a red fox in the snow", "image": {"width": 64, "height": 64, "steps": 4}},
    {
        "prompt": "a lighthouse",
        "image": {"width": 96, "height": 64, "steps": 3, "seed": 7, "guidance": 4.0},
    },
]


def loaded(cls, model, devices=None, **options):
    """A stage of ``cls`` built and loaded in this process, as its worker would."""
    opts = {"model": model, "conditioning_width": 32, **options}
    if cls is TextEncode:
        opts.pop("conditioning_width")
    stage = cls(StageContext(name="s", kind="dit", options=opts, devices=devices))
    stage.load()
    return stage


def config(model, devices=None):
    """hash_encode -> plan -> sample -> vae, the decoded image to the caller; ``devices``
    on every stage when given."""
    cfg = dit_config(model, encode=False)
    cfg["stages"][3]["client_stream"] = True
    if devices is not None:
        for stage in cfg["stages"]:
            stage["devices"] = devices
    return cfg


def decoded(out):
    assert out.ok, out.error
    (ev,) = out.by_stage("vae")
    return ev.arrays["image"]


@pytest.mark.parametrize("devices", ["", pytest.param(None, marks=cpu_only)])
def test_dtype_auto_is_float32_on_the_cpu(tiny_dit, devices):
    """devices: cpu (and, without a GPU, no devices key): the models load on the CPU in
    float32, as before the option had an auto."""
    sample = loaded(Sample, tiny_dit, devices)
    assert sample.placement == Placement("cpu", "float32")
    assert sample.transformer.dtype == torch.float32
    assert sample.transformer.device == torch.device("cpu")
    vae = loaded(VaeDecode, tiny_dit, devices)
    assert vae.placement == Placement("cpu", "float32")
    assert vae.vae.dtype == torch.float32 and vae.vae.device == torch.device("cpu")


def test_an_explicit_dtype_is_the_models_dtype(tiny_dit):
    sample = loaded(Sample, tiny_dit, "", dtype="bfloat16")
    assert sample.placement == Placement("cpu", "bfloat16")
    assert sample.transformer.dtype == torch.bfloat16


def test_an_unknown_dtype_fails_the_load_naming_it(tiny_dit):
    with pytest.raises(DeviceError, match=r"stage 's': dtype 'fp32': expected auto or one of"):
        loaded(Sample, tiny_dit, "", dtype="fp32")


@cpu_only
@pytest.mark.parametrize("cls", [TextEncode, Sample, VaeDecode])
def test_a_gpu_asked_for_without_one_fails_every_model_stage(cls, tiny_dit):
    """Before any weights are read (tiny-sd3 has no text encoders: the device is what
    fails dit.text_encode here, not the checkpoint)."""
    with pytest.raises(DeviceError) as e:
        loaded(cls, tiny_dit, "0")
    msg = str(e.value)
    assert "stage 's'" in msg and "devices '0'" in msg and "sees none" in msg, msg


@cpu_only
def test_a_gpu_asked_for_without_one_fails_the_pipelines_start(tiny_dit):
    """A pipeline whose sample stage has devices: "0" on a machine without a GPU does not
    start; the error names the stage, the devices asked for and what torch sees."""
    cfg = config(tiny_dit)
    cfg["stages"][2]["devices"] = "0"
    with pytest.raises(StageStartError) as e, Pipeline(cfg):
        pass
    msg = str(e.value)
    assert "stage 'sample' (kind 'dit.sample') failed to load" in msg, msg
    assert "DeviceError" in msg and "devices '0' asks for a GPU" in msg, msg
    assert f"torch {torch.__version__} sees none" in msg and "0 device(s)" in msg, msg


@cpu_only
def test_devices_cpu_gives_the_image_of_no_devices_key(tiny_dit):
    """Without a GPU, no devices key means the CPU: devices: cpu changes no bit (one
    request at a time: a micro-batch may move the last bit)."""
    images = []
    for devices in (None, "cpu"):
        with Pipeline(config(tiny_dit, devices)) as pipe:
            images.append([decoded(pipe.generate([r])[0]) for r in REQUESTS])
    for default, cpu in zip(*images, strict=True):
        assert default.dtype == np.float32 and np.array_equal(default, cpu)


# -- on a GPU -----------------------------------------------------------------------


@gpu
def test_gpu_placement_by_default(tiny_dit):
    """No devices key where torch sees a GPU: cuda:0, in bfloat16 (float16 before Ampere)."""
    sample = loaded(Sample, tiny_dit)
    dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    assert sample.placement == Placement("cuda:0", dtype)
    assert sample.transformer.device.type == "cuda"
    assert sample.transformer.dtype == getattr(torch, dtype)
    vae = loaded(VaeDecode, tiny_dit)
    assert vae.vae.device.type == "cuda" and vae.vae.dtype == getattr(torch, dtype)


@gpu
def test_gpu_image_equals_the_diffusers_pipeline_on_the_gpu(tiny_dit):
    """float32 on the GPU: the staged image is diffusers' pipeline's on the same device
    (seeded noise drawn on the CPU by both), and the same on every run."""
    ref = stock_pipeline(tiny_dit, 32).to("cuda")
    cfg = config(tiny_dit)
    for stage in cfg["stages"][2:4]:
        stage["options"]["dtype"] = "float32"
    with Pipeline(cfg) as pipe:
        for request in REQUESTS:
            embeds, pooled = hash_conditioning(request["prompt"], 32, 8)
            embeds = torch.from_numpy(embeds)[None].cuda()
            pooled = torch.from_numpy(pooled)[None].cuda()
            expected = stock_image(ref, embeds, pooled, request["image"])
            first = decoded(pipe.generate([request])[0])
            again = decoded(pipe.generate([request])[0])
            assert np.abs(first - expected).max() <= 1e-4, np.abs(first - expected).max()
            assert np.array_equal(first, again)
