"""Cheap previews: latents -> RGB by a per-pixel linear map, no VAE in the loop.

The map (latent channels + 1 bias -> 3) is fitted once per VAE by least squares between
random latents and their VAE decodes pooled to latent resolution, and cached, so the
sampler never holds the VAE. A preview shows the model's current estimate of the clean
image (for flow matching, ``x0 = x_t - sigma * v``) at 1/8 of the image size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from omni_core.model_cache import build_once


def fit_projection(vae: Any, samples: int = 8, size: int = 8, seed: int = 0) -> np.ndarray:
    """``(channels + 1, 3)``: RGB in [-1, 1] from a latent pixel (in the sampler's scaled
    space) and a bias. The latents are drawn on the CPU and decoded on the VAE's device
    (the sampler fits with a float32 VAE on the CPU: one map whatever device samples)."""
    import torch
    import torch.nn.functional as F

    cfg = vae.config
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(samples, cfg.latent_channels, size, size, generator=g)
    scaled = (z / cfg.scaling_factor + (cfg.shift_factor or 0.0)).to(vae.device, vae.dtype)
    with torch.inference_mode():
        image = vae.decode(scaled).sample
    rgb = F.adaptive_avg_pool2d(image.float().cpu(), (size, size))
    x = z.permute(0, 2, 3, 1).reshape(-1, cfg.latent_channels)
    x = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1)
    y = rgb.permute(0, 2, 3, 1).reshape(-1, 3)
    return torch.linalg.lstsq(x, y).solution.numpy().astype(np.float32)


def cached_projection(model_dir: Path, load_vae: Any) -> np.ndarray:
    """The fitted map of the VAE in ``model_dir``, fitted on first use (``load_vae()``)."""
    weights = sorted((model_dir / "vae").glob("*"))
    key = hashlib.sha1(
        "|".join(
            f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in weights
        ).encode()
    ).hexdigest()[:16]

    def fit(target: Path) -> None:
        np.save(target / "rgb.npy", fit_projection(load_vae()))

    return np.load(build_once(f"preview-{key}", fit, "rgb.npy") / "rgb.npy")


def project(x0: Any, projection: np.ndarray) -> np.ndarray:
    """``uint8 (height, width, 3)`` from one latent ``(channels, height, width)``."""
    lat = np.asarray(x0, dtype=np.float32)
    c, h, w = lat.shape
    rgb = projection[:-1].T @ lat.reshape(c, h * w) + projection[-1][:, None]  # (3, h*w)
    rgb = (np.clip(rgb, -1.0, 1.0) + 1.0) * 127.5
    return np.ascontiguousarray(rgb.round().astype(np.uint8).T.reshape(h, w, 3))
