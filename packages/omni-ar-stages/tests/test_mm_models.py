"""The models the requires_kv handoff refuses, each with its reason, before a weight is
read: M-RoPE with a position rule it does not know (Qwen3-VL's interleaved sections),
encoder-decoder and cross-attending decoders (they need more than the decoder's KV),
pooling heads (nothing to generate); and the M-RoPE models it serves (Qwen2-VL,
Qwen2.5-VL). The configs are transformers' own for real architectures, written without
weights."""

import json

import pytest
from omni_ar.multimodal.handoff import check_handoff_model
from omni_ar.multimodal.stages import MMDecode, MMIntake, MMPrefill
from omni_ar.multimodal.testing import build_tiny_llava
from omni_core.stage import StageContext
from transformers import (
    AutoConfig,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    LlavaConfig,
    MllamaConfig,
    Qwen2_5_VLConfig,
    Qwen2VLConfig,
    Qwen3VLConfig,
    VisionEncoderDecoderConfig,
    ViTConfig,
)


def _qwen2_vl():
    """As Qwen2-VL-2B-Instruct's config.json has it."""
    return Qwen2VLConfig(
        architectures=["Qwen2VLForConditionalGeneration"],
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    )


def _qwen3_vl():
    """As Qwen3-VL-2B-Instruct's config.json has it: M-RoPE with interleaved sections."""
    rope = {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    return Qwen3VLConfig(
        architectures=["Qwen3VLForConditionalGeneration"], text_config={"rope_scaling": rope}
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
        (_qwen3_vl, "model type 'qwen3_vl' uses M-RoPE with a position rule the handoff"),
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


def test_qwen2_vl_and_qwen2_5_vl_are_admitted():
    """Their M-RoPE rule is the one the handoff carries (position delta and grids)."""
    check_handoff_model(_qwen2_vl())
    check_handoff_model(
        Qwen2_5_VLConfig(
            architectures=["Qwen2_5_VLForConditionalGeneration"],
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        )
    )


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
@pytest.mark.parametrize(
    ("cls", "kind"),
    [(MMIntake, "ar.mm_intake"), (MMPrefill, "ar.mm_prefill"), (MMDecode, "ar.mm_decode")],
)
def test_each_mm_stage_refuses_an_unknown_m_rope_checkpoint_at_load_before_reading_anything(
    tmp_path, cls, kind, engine
):
    """A checkpoint directory with a Qwen3-VL config and nothing else: the stage's load
    fails on the config, with the reason, not on the missing processor or weights, and
    on vLLM before any engine starts (or vLLM is imported)."""
    _qwen3_vl().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_vl"
    stage = cls(StageContext("s", kind, {"model": str(tmp_path), "engine": engine}))
    with pytest.raises(ValueError, match="uses M-RoPE with a position rule"):
        stage.load()
