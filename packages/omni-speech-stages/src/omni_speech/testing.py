"""A tiny Qwen2.5-Omni (thinker, talker, token2wav) with seeded random weights, built
from transformers' configs in seconds: nothing downloaded or committed.

The thinker's vocabulary is the AR family's tiny byte-level tokenizer with Qwen's special
tokens added; the talker's codec vocabulary is small, its special codes at the top.
``spk_dict.pt`` holds two voices (``Chelsie``, ``Ethan``), as the released checkpoint's
does: each a conditioning vector, a reference mel and the talker's text start token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_ar.testing import build_tokenizer

SPECIAL = (
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
    "<|tts_pad|>",
)
CODEBOOK = 64  # codec codes 0..59 speak; 60..63 are pad, start, end, mask
MEL_BINS = 16  # the audio encoder's input features
VOICES = ("Chelsie", "Ethan")
PATCH = 8  # vision patches (merged 2 x 2 into one placeholder each)


def tiny_omni_config(tok: Any, for_vllm: bool = False) -> Any:
    """The tiny model's config over tokenizer ``tok`` (which holds :data:`SPECIAL`);
    ``for_vllm``: the thinker's attention heads of 32 (hidden 128), which vLLM's CPU
    kernels need."""
    from transformers import Qwen2_5OmniConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    head_dim = 16  # the talker's
    text_head = 32 if for_vllm else head_dim  # the thinker's
    hidden = 4 * text_head
    mrope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = {
        "vocab_size": len(tok),
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        # the rotary frequencies (head_dim / 2) split over (time, height, width)
        "rope_parameters": {**mrope, "mrope_section": [k * text_head // 16 for k in (2, 3, 3)]},
        "initializer_range": 0.2,
        "eos_token_id": ids["<|im_end|>"],
        "tie_word_embeddings": False,
    }
    audio = {
        "num_mel_bins": MEL_BINS,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": hidden,
        "n_window": 8,
        "max_source_positions": 1500,
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": PATCH,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 2 * PATCH * 2,
        "fullatt_block_indexes": [1],
        "out_hidden_size": hidden,
        "in_channels": 3,
    }
    thinker = {
        "text_config": text,
        "audio_config": audio,
        "vision_config": vision,
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
        "initializer_range": 0.2,
    }
    talker = {
        "vocab_size": CODEBOOK,
        "embedding_size": hidden,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "rope_parameters": mrope,
        "initializer_range": 0.2,
        "tts_codec_pad_token_id": CODEBOOK - 4,
        "tts_codec_start_token_id": CODEBOOK - 3,
        "tts_codec_end_token_id": CODEBOOK - 2,
        "tts_codec_mask_token_id": CODEBOOK - 1,
        "tts_text_start_token_id": ids["<|tts_bos|>"],
        "tts_text_end_token_id": ids["<|tts_eos|>"],
        "tts_text_pad_token_id": ids["<|tts_pad|>"],
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
    }
    dit = {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 16,
        "ff_mult": 2,
        "emb_dim": 32,
        "block_size": 8,
        "look_ahead_layers": [2],
        "look_backward_layers": [0, 3],
        "repeats": 2,
        "num_embeds": CODEBOOK,
        "mel_dim": 80,
        "enc_emb_dim": 32,
        "enc_dim": 32,
        "enc_channels": [32, 32, 32, 32, 96],
        "enc_attention_channels": 16,
        "enc_se_channels": 16,
        "max_position_embeddings": 4096,
    }
    bigvgan = {
        "mel_dim": 80,
        "upsample_initial_channel": 64,
        "resblock_kernel_sizes": [3, 7],
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5]],
        "upsample_rates": [5, 3, 2, 2, 2, 2],
        "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
    }
    return Qwen2_5OmniConfig(
        thinker_config=thinker,
        talker_config=talker,
        token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan},
    )


def build_tiny_omni(path: str | Path, seed: int = 0, for_vllm: bool = False) -> Path:
    """Write a tiny random Qwen2.5-Omni checkpoint, its tokenizer, feature extractor,
    image processor and ``spk_dict.pt`` into ``path``; returns it. ``for_vllm``: one
    vLLM's CPU backend runs (see :func:`tiny_omni_config`)."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(extra_special=SPECIAL)
    cfg = tiny_omni_config(tok, for_vllm)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if for_vllm:
        _name_media_tokens(path)
    _save_preprocessors(path)
    gen = torch.Generator().manual_seed(seed + 1)
    speakers = {
        name: {
            "cond": torch.randn(1, cfg.token2wav_config.dit_config.enc_emb_dim, generator=gen),
            "ref_mel": torch.randn(1, 24, 80, generator=gen),
            "bos_token": tok.convert_tokens_to_ids("<|tts_bos|>"),
        }
        for name in VOICES
    }
    torch.save(speakers, path / "spk_dict.pt")
    return path


def _name_media_tokens(path: Path) -> None:
    """The media tokens by name in ``tokenizer_config.json`` (``image_token``...), as
    the released tokenizer names them: transformers' ``Qwen2_5OmniProcessor``, which
    vLLM loads, reads them from the tokenizer."""
    import json

    names = {
        "image_token": "<|IMAGE|>",
        "audio_token": "<|AUDIO|>",
        "video_token": "<|VIDEO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
    }
    file = path / "tokenizer_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **names}, indent=2))


def _save_preprocessors(path: Path) -> None:
    """The feature extractor's and the image processor's settings in one
    ``preprocessor_config.json``, as the released checkpoint keeps them (each class reads
    its own keys from it)."""
    import json
    import tempfile

    from transformers import WhisperFeatureExtractor

    merged: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, part in enumerate(
            (
                WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=16000),
                _image_processor(),
            )
        ):
            part.save_pretrained(Path(tmp) / str(k))
            merged |= json.loads((Path(tmp) / str(k) / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))


def _image_processor() -> Any:
    from omni_speech.processors import image_processor_class

    return image_processor_class()(
        min_pixels=(PATCH * 2) ** 2,
        max_pixels=64 * (PATCH * 2) ** 2,
        patch_size=PATCH,
        merge_size=2,
        temporal_patch_size=2,
    )


def wav_part(seconds: float = 1.5, rate: int = 16000) -> dict[str, Any]:
    """A 440 Hz tone as an OpenAI ``input_audio`` content part (WAV, base64)."""
    import base64
    import io
    import wave

    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    data = base64.b64encode(buf.getvalue()).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def png_part(w: int = 40, h: int = 24, seed: int | None = None) -> dict[str, Any]:
    """Random pixels (from ``seed``, else ``w * h``) as an ``image_url`` part (PNG data
    URL)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    rng = np.random.default_rng(w * h if seed is None else seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), np.uint8)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}
