"""The embedded default model end to end: converted once from the packaged GGUF, then
served by configs/ar_chat.yaml (intake -> the fused ar.generate -> postprocess) and
configs/ar_chat_split.yaml (prefill -> decode) with the same tokens as the engine in one
process."""

import os

import pytest
from omni_ar.models import packaged_model_ready
from omni_core import Pipeline, load_config

MISSING = not packaged_model_ready("smollm2")
if MISSING and os.environ.get("CI"):
    raise RuntimeError("CI needs the packaged model: run `hatch run setup` first")
pytestmark = pytest.mark.skipif(MISSING, reason="SmolLM2 is not pulled (`hatch run setup`)")


@pytest.mark.parametrize("config", ["configs/ar_chat.yaml", "configs/ar_chat_split.yaml"])
def test_ar_chat_config_streams_smollm2_text(config):
    from omni_ar.engines.transformers_engine import TransformersEngine
    from omni_ar.models import resolve_model
    from omni_ar.params import parse_request

    path = resolve_model("smollm2")  # converts on first use (about a minute), then cached
    request = {"prompt": "Name three colors.", "max_tokens": 12}
    cfg = load_config(config)
    with Pipeline(cfg) as pipe:
        out = pipe.generate([request])[0]
    assert out.ok, out.error
    text = "".join(e.payload["text"] for e in out.by_stage("postprocess"))
    tokens = [t for e in out.by_stage("postprocess") for t in e.tokens]
    assert len(tokens) == 12 and text.strip()

    engine = TransformersEngine(path)
    engine.load_tokenizer()
    engine.load_model()
    _, params = parse_request(request, 4096)
    assert tokens == engine.generate([{"role": "user", "content": request["prompt"]}], params)
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
