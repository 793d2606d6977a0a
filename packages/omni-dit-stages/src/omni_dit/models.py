"""Where a DiT stage's ``model`` option points: an SD3-family directory, or the embedded
default.

A model directory has the diffusers layout of Stable Diffusion 3: ``transformer/``
(``SD3Transformer2DModel``), ``vae/`` (``AutoencoderKL``) and ``scheduler/``
(``FlowMatchEulerDiscreteScheduler``). Text encoders are not read from it: conditioning
comes from a text-encoder stage, whose hidden size must equal the transformer's
``joint_attention_dim`` (and ``pooled_projection_dim``).

The embedded default, ``tiny-sd3``, is a two-layer DiT with a small VAE built from a
config with seeded random weights, cached on first use (nothing is downloaded, nothing
is committed). Its images are not meaningful pictures; it exists so the whole pipeline
runs anywhere. Its conditioning width follows the encoder (``conditioning_width``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omni_core.model_cache import build_once, quiet_offline

TINY = "tiny-sd3"
TINY_SEED = 0


def resolve_model(model: str, conditioning_width: int = 576) -> Path:
    """A loadable SD3-layout directory for ``model`` (building the embedded one once)."""
    quiet_offline()
    if os.path.isdir(model):
        missing = [
            p
            for p in ("transformer", "vae", "scheduler")
            if not os.path.isdir(os.path.join(model, p))
        ]
        if missing:
            raise RuntimeError(
                f"model {model!r}: not an SD3-family directory (missing {', '.join(missing)}/)"
            )
        return Path(model)
    if model != TINY:
        raise RuntimeError(f"model {model!r}: not a directory and not the embedded model {TINY!r}")
    return build_once(
        f"{TINY}-c{conditioning_width}",
        lambda target: build_tiny_sd3(target, conditioning_width),
        "model_index.json",
    )


def build_tiny_sd3(target: Path, conditioning_width: int, seed: int = TINY_SEED) -> None:
    """Write a small SD3-layout model with seeded random weights into ``target``."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=conditioning_width,
        caption_projection_dim=64,
        pooled_projection_dim=conditioning_width,
        out_channels=16,
        pos_embed_max_size=64,  # latents up to 128 x 128: images up to 1024 px
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
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
        scaling_factor=1.5305,  # SD3's latent statistics
        shift_factor=0.0609,
    )
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


def read_config(path: Path, part: str) -> dict[str, Any]:
    """A part's config, without loading its weights."""
    name = "scheduler_config.json" if part == "scheduler" else "config.json"
    return json.loads((path / part / name).read_text())


def torch_dtype(name: str) -> Any:
    import torch

    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            name
        ]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected float32, bfloat16 or float16") from None


def load_transformer(path: Path, dtype: str = "float32") -> Any:
    from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(
        path / "transformer", torch_dtype=torch_dtype(dtype)
    ).eval()


def load_vae(path: Path, dtype: str = "float32") -> Any:
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL

    return AutoencoderKL.from_pretrained(path / "vae", torch_dtype=torch_dtype(dtype)).eval()


def load_scheduler(path: Path) -> Any:
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
        FlowMatchEulerDiscreteScheduler,
    )

    return FlowMatchEulerDiscreteScheduler.from_pretrained(path / "scheduler")
