"""The embedded models: small diffusers pipeline directories built offline with seeded
random weights, so every stage runs anywhere. Their images are not meaningful pictures.

* ``tiny-sd3``: transformer, VAE and scheduler of the SD3 layout, no text encoders: the
  conditioning comes from a text-encoder stage of width ``conditioning_width`` (SmolLM2's
  576 in the main job).
* ``tiny-sd3-full`` and ``tiny-flux``: complete checkpoints in the layout of
  ``stable-diffusion-3.5-medium`` (CLIP-L, CLIP-G, T5 and their tokenizers) and of
  ``FLUX.1-dev`` (CLIP-L, T5, guidance embedding), written with ``save_pretrained`` from
  the pipeline object, so they load through the same ``from_pretrained`` paths as a real
  checkpoint. The tokenizers have a small vocabulary built here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEED = 0
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789,.!?'-"
WORDS = ("a", "red", "blue", "fox", "the", "in", "snow", "cat", "dog", "of", "on", "tree")


def build_tiny_sd3(target: Path, conditioning_width: int, seed: int = SEED) -> None:
    """Transformer, VAE and scheduler of a small SD3 model (no text encoders)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(seed)
    transformer = _sd3_transformer(conditioning_width, conditioning_width)
    torch.manual_seed(seed + 1)
    vae = _vae(scaling_factor=1.5305, shift_factor=0.0609)  # SD3's latent statistics
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    transformer.save_pretrained(target / "transformer")
    vae.save_pretrained(target / "vae")
    scheduler.save_pretrained(target / "scheduler")
    (target / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "StableDiffusion3Pipeline",
                "_omni_note": "random weights: not meaningful pictures",
                "transformer": ["diffusers", "SD3Transformer2DModel"],
                "vae": ["diffusers", "AutoencoderKL"],
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            },
            indent=1,
        )
    )


def build_tiny_sd3_full(target: Path, seed: int = SEED) -> None:
    """A complete SD3 checkpoint: CLIP-L (hidden 16) + CLIP-G (hidden 24) + T5 (d_model
    64 = the joint attention width), pooled width 16 + 24."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    clip_l, clip_g = _clip(16, seed + 1), _clip(24, seed + 2)
    t5 = _t5(64, seed + 3)
    torch.manual_seed(seed + 4)
    transformer = _sd3_transformer(joint_width=64, pooled_width=16 + 24)
    torch.manual_seed(seed + 5)
    vae = _vae(scaling_factor=1.5305, shift_factor=0.0609)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        text_encoder=clip_l,
        tokenizer=clip_tokenizer(),
        text_encoder_2=clip_g,
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5,
        tokenizer_3=t5_tokenizer(),
    )
    pipe.save_pretrained(target)


def build_tiny_flux(target: Path, seed: int = SEED) -> None:
    """A complete Flux.1-dev-layout checkpoint: CLIP-L (hidden 16, its pooled output the
    pooled conditioning) + T5 (d_model 32), guidance embedding, dynamic shifting."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed + 4)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2 x 2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(seed + 5)
    vae = _vae(scaling_factor=0.3611, shift_factor=0.1159)  # Flux's latent statistics
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
        text_encoder=_clip(16, seed + 1, projection=False),
        tokenizer=clip_tokenizer(),
        text_encoder_2=_t5(32, seed + 3),
        tokenizer_2=t5_tokenizer(),
    )
    pipe.save_pretrained(target)


def _sd3_transformer(joint_width: int, pooled_width: int) -> Any:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=joint_width,
        caption_projection_dim=64,
        pooled_projection_dim=pooled_width,
        out_channels=16,
        pos_embed_max_size=64,  # latents up to 128 x 128: images up to 1024 px
    )


def _vae(scaling_factor: float, shift_factor: float) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[16, 32, 32, 32],
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )


def _clip(hidden: int, seed: int, projection: bool = True) -> Any:
    """A 3-layer CLIP text model (``clip_skip`` up to 1 keeps a layer)."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(_clip_vocab()[0]),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=3,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=_clip_vocab()[0]["<|startoftext|>"],
        eos_token_id=_clip_vocab()[0]["<|endoftext|>"],
        pad_token_id=_clip_vocab()[0]["<|endoftext|>"],
    )
    torch.manual_seed(seed)
    model = (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)
    return model.eval()


def _t5(d_model: int, seed: int) -> Any:
    import torch
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(_t5_pieces()),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(config).eval()


def _clip_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-pair vocabulary of single characters, end-of-word forms and a few merges."""
    vocab: dict[str, int] = {}
    for c in CHARS:
        vocab[c] = len(vocab)
    for c in CHARS:
        vocab[f"{c}</w>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in WORDS:  # merge each word left to right into one end-of-word token
        part = word[0]
        for i, c in enumerate(word[1:], start=1):
            right = c + ("</w>" if i == len(word) - 1 else "")
            merges.append((part, right))
            part += right
            vocab.setdefault(part, len(vocab))
    merges = list(dict.fromkeys(merges))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab, merges


def clip_tokenizer() -> Any:
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab()
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def _t5_pieces() -> list[tuple[str, float]]:
    words = [(f"\u2581{w}", -1.0) for w in WORDS]
    chars = [(c, -3.0) for c in CHARS]
    return [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0), *chars, *words]


def t5_tokenizer() -> Any:
    from transformers import T5Tokenizer

    return T5Tokenizer(vocab=_t5_pieces(), extra_ids=0, model_max_length=512)
