"""On a CUDA machine (``tools/gpu-check`` runs these): model stages on the GPU they are
given, the same results as on the CPU within the dtype's precision, GPU memory in the
stage metrics, CUDA tensors through the data plane. Skipped where torch sees no GPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU"),
]

from omni_core import Pipeline  # noqa: E402
from omni_testing.configs import chain  # noqa: E402


def dit(devices):
    pytest.importorskip("diffusers")
    from omni_dit.testing import dit_config

    cfg = dit_config("tiny-sd3", encode=False, heartbeat_interval_s=0.1)
    for st in cfg["stages"]:
        if st["kind"] in ("dit.sample", "dit.vae"):
            st["devices"] = devices
            st["options"]["dtype"] = "float32"  # compare with the CPU's result
    return cfg


def final_image(pipe):
    req = {"prompt": "a red fox", "image": {"width": 64, "height": 64, "steps": 4, "seed": 3}}
    out = pipe.generate([req])[0]
    assert out.ok, out.error
    return out.final.arrays["image"]


def test_dit_stages_run_on_the_gpu_and_match_the_cpu():
    with Pipeline(dit("cpu")) as pipe:
        on_cpu = final_image(pipe)
    with Pipeline(dit("0")) as pipe:
        on_gpu = final_image(pipe)
        again = final_image(pipe)
        stats = pipe.metrics()["stages"]
    assert np.array_equal(on_gpu, again)  # a seed gives the same image on that device
    assert np.abs(on_gpu.astype(np.float32) - on_cpu.astype(np.float32)).max() < 0.05
    assert stats["sample"]["gpu_mem_allocated_bytes"] > 0
    assert stats["plan"]["gpu_mem_allocated_bytes"] == 0  # no model, no CUDA


def test_a_cuda_tensor_yielded_by_a_stage_reaches_the_next_one_intact():
    cfg = chain(
        ("src", "synthetic.array_source", {"nbytes": 1 << 20, "count": 3}),
        ("sink", "synthetic.array_sink", {}),
    )
    with Pipeline(cfg) as pipe:
        on_gpu, on_cpu = pipe.generate([{"device": "cuda"}, {}])
    assert on_gpu.ok and on_cpu.ok, (on_gpu.error, on_cpu.error)
    assert on_gpu.final.payload == on_cpu.final.payload  # bytes, check and CRC


def test_ar_stages_run_on_the_gpu(tmp_path):
    pytest.importorskip("transformers")
    from omni_ar.testing import build_tiny_llama

    model = str(build_tiny_llama(tmp_path / "tiny"))
    opts = {"model": model, "threads": 1, "dtype": "float32"}
    stages = [
        ("intake", "ar.intake", {"model": model}),
        ("prefill", "ar.prefill", opts),
        ("decode", "ar.decode", opts),
        ("postprocess", "ar.postprocess", {"model": model}),
    ]
    req = {"prompt": "the quick brown fox", "max_tokens": 16, "ignore_eos": True}
    outs = {}
    for devices in ("cpu", "0"):
        cfg = chain(*[(n, k, o, {"devices": devices}) for n, k, o in stages])
        with Pipeline(cfg) as pipe:
            outs[devices] = pipe.generate([req])[0]
            stats = pipe.metrics()["stages"]
    assert outs["0"].ok and outs["cpu"].ok
    assert outs["0"].tokens == outs["cpu"].tokens  # greedy, float32
    assert stats["decode"]["gpu_mem_allocated_bytes"] > 0
