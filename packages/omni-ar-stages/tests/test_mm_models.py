"""The models the requires_kv handoff refuses, each with its reason, before a weight is
read: M-RoPE (positions from the media), encoder-decoder and cross-attending decoders
(they need more than the decoder's KV), pooling heads (nothing to generate). The configs
are transformers' own for real architectures, written without weights."""

import json

import pytest
from omni_ar.multimodal.handoff import check_handoff_model
from omni_ar.multimodal.stages import MMDecode, MMIntake, MMPrefill
from omni_ar.multimodal.testing import build_tiny_llava
from omni_ar.params import RequestError, parse_request
from omni_core.stage import StageContext
from transformers import (
    AutoConfig,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    LlavaConfig,
    MllamaConfig,
    Qwen2VLConfig,
    VisionEncoderDecoderConfig,
    ViTConfig,
)


def _qwen2_vl():
    """As Qwen2-VL-2B-Instruct's config.json has it."""
    return Qwen2VLConfig(
        architectures=["Qwen2VLForConditionalGeneration"],
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    )


def _mllama():
    return MllamaConfig(architectures=["MllamaForConditionalGeneration"])


def _encoder_decoder():
    return VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig(), GPT2Config())


def _pooling():
    return LlavaConfig(text_config=LlamaConfig(), architectures=["LlavaForSequenceClassification"])


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (_qwen2_vl, r"model type 'qwen2_vl' uses M-RoPE \(rope_\w+ has mrope_section\)"),
        (_mllama, "model type 'mllama' cross-attends to the image in its decoder layers"),
        (_encoder_decoder, "model type 'vision-encoder-decoder' is an encoder-decoder model"),
        (_pooling, "model architecture 'LlavaForSequenceClassification' pools"),
    ],
    ids=["m-rope", "cross-attention", "encoder-decoder", "pooling"],
)
def test_a_model_the_handoff_cannot_serve_is_refused_with_its_reason(config, reason):
    with pytest.raises(ValueError, match=reason):
        check_handoff_model(config())


def test_a_text_config_of_an_encoder_decoder_is_refused_too():
    with pytest.raises(ValueError, match="encoder-decoder"):
        check_handoff_model(BertConfig(is_encoder_decoder=True))


def test_llava_and_the_plain_llama_it_wraps_are_admitted(tmp_path):
    check_handoff_model(AutoConfig.from_pretrained(build_tiny_llava(tmp_path)))
    check_handoff_model(LlamaConfig(architectures=["LlamaForCausalLM"]))


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
@pytest.mark.parametrize(
    ("cls", "kind"),
    [(MMIntake, "ar.mm_intake"), (MMPrefill, "ar.mm_prefill"), (MMDecode, "ar.mm_decode")],
)
def test_each_mm_stage_refuses_an_m_rope_checkpoint_at_load_before_reading_anything_else(
    tmp_path, cls, kind, engine
):
    """A checkpoint directory with a Qwen2-VL config and nothing else: the stage's load
    fails on the config, with the reason, not on the missing processor or weights, and
    on vLLM before any engine starts (or vLLM is imported)."""
    _qwen2_vl().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2_vl"
    stage = cls(StageContext("s", kind, {"model": str(tmp_path), "engine": engine}))
    with pytest.raises(ValueError, match="uses M-RoPE"):
        stage.load()


def test_prompt_logprobs_are_refused_where_a_request_enters_the_mm_stages():
    """Decode never computes the prompt's positions, so it could not give their logprobs."""
    with pytest.raises(RequestError, match="field 'prompt_logprobs': unknown request field"):
        parse_request({"prompt": "x", "prompt_logprobs": 1}, 100, images=True)
