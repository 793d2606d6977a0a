"""The tiny AR pipeline (transformers engine) on the ray backend, its stages split over two
simulated nodes: prefill's KV crosses nodes through Ray; the same tokens and text as the
local backend."""

import pytest

pytest.importorskip("ray", reason="ray is not installed")
pytest.importorskip("transformers", reason="the transformers engine extra is not installed")

from omni_core import Pipeline  # noqa: E402
from omni_ray.testing import simulated_cluster, split_ar_config  # noqa: E402

PROMPTS = [
    {"prompt": "the quick brown fox", "max_tokens": 20},
    {"messages": [{"role": "user", "content": "stream tokens"}], "max_tokens": 16},
    {"prompt": "héllo wörld", "max_tokens": 12},
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from omni_ar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def text_and_tokens(out):
    assert out.ok, out.error
    segs = out.by_stage("postprocess")
    return "".join(e.payload["text"] for e in segs), [t for e in segs for t in e.tokens]


def test_tiny_ar_pipeline_over_two_nodes_equals_the_local_backend(tiny_model):
    cfg = split_ar_config(tiny_model)
    with Pipeline(cfg, backend="local") as pipe:
        local = [text_and_tokens(o) for o in pipe.generate(PROMPTS)]
    with simulated_cluster(nodes=2), Pipeline(cfg, backend="ray") as pipe:
        where = {n: h["where"] for n, h in pipe.backend.health().items()}
        remote = [text_and_tokens(o) for o in pipe.generate(PROMPTS)]
    assert where["intake"] == where["prefill"] != where["decode"] == where["postprocess"]
    assert remote == local
    assert all(len(tokens) > 3 for _, tokens in local)
