"""A tiny Llava (CLIP vision tower + Llama) with random weights, and synthetic images.

Built from configs in about a second, nothing downloaded or committed; untied embeddings
and a large init range keep greedy output varied, and images change it.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from omni_ar.testing import build_tokenizer, tiny_llama_config

IMAGE_SIZE = 32  # the vision tower's input (shortest edge resized, then center-cropped)
PATCH = 8  # -> (32 / 8)^2 = 16 placeholders per image


def build_tiny_llava(path: str | Path, seed: int = 0, for_vllm: bool = False) -> Path:
    """Write a tiny Llava checkpoint and its processor into ``path``; returns it.
    ``for_vllm``: one vLLM's CPU backend runs (attention heads of 32, which its
    kernels need, and the vision tower's weights under ``vision_tower.vision_model.``,
    where vLLM's Llava looks for them; transformers loads it too)."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    try:  # transformers >= 5.20 names the PIL backend apart (the default needs torchvision)
        from transformers.models.clip.image_processing_pil_clip import (
            CLIPImageProcessorPil as CLIPImageProcessor,
        )
    except ImportError:
        from transformers import CLIPImageProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(extra_special=("<image>",))
    text = tiny_llama_config(len(tok), head_dim=32 if for_vllm else None)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        initializer_range=0.2,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(cfg).eval().save_pretrained(path)
    if for_vllm:
        _vision_model_keys(path / "model.safetensors")
    images = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by "default"
    ).save_pretrained(path)
    return path


def _vision_model_keys(file: Path) -> None:
    """Rename the vision tower's tensors ``vision_tower.X`` -> ``vision_tower.vision_model.X``
    (transformers 5 saves CLIP's tower without its ``vision_model`` level)."""
    from safetensors.torch import load_file, save_file

    tower, nested = "vision_tower.", "vision_tower.vision_model."
    state = {
        tower + "vision_model." + k[len(tower) :]
        if k.startswith(tower) and not k.startswith(nested)
        else k: v
        for k, v in load_file(file).items()
    }
    save_file(state, file, metadata={"format": "pt"})


def synthetic_image(seed: int, width: int = 64, height: int = 48, fmt: str = "PNG") -> bytes:
    """An encoded image: smooth colour gradients with a few bright rectangles and mild
    noise (photo-like enough that JPEG compresses it as it would a photo)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, 3)
    freq = rng.uniform(1.0, 4.0, 3)
    rgb = np.stack(
        [
            127 + 100 * np.sin(freq[c] * (x / width + y / height) * np.pi + phase[c])
            for c in range(3)
        ],
        axis=-1,
    )
    for _ in range(4):
        x0, y0 = rng.integers(0, width // 2), rng.integers(0, height // 2)
        rgb[y0 : y0 + height // 4, x0 : x0 + width // 4] = rng.uniform(0, 255, 3)
    rgb += rng.normal(0, 4, rgb.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buf, format=fmt, quality=90)
    return buf.getvalue()


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG of ``width x height`` black pixels: some 1/1000 of its size decoded
    (12 MP, 36 MB as RGB, in about 35 KB)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height)).save(buf, format="PNG")
    return buf.getvalue()
