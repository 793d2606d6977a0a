"""Cheap previews: latents -> RGB by a per-pixel linear map, no VAE in the loop.

The map (latent channels + 1 bias -> 3) is fitted once per VAE by least squares between
random latents and their VAE decodes pooled to latent resolution, and cached, so the
sampler never holds the VAE. A checkpoint may ship its own map beside
``model_index.json``, fitted on its real latents: ``preview_rgb.npz`` with a linear map
(``linear``) or a per-pixel MLP (``w1``, ``b1``, ``w2``, ``b2``: latent -> SiLU hidden ->
RGB), for latent spaces no linear map reads well (the embedded ``tiny-sd3-shapes``). A
preview shows the model's current estimate of the clean image (for flow matching,
``x0 = x_t - sigma * v``) at latent size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from omni_core.plugin import build_once


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


Projection = np.ndarray | dict[str, np.ndarray]


def cached_projection(model_dir: Path, load_vae: Any) -> Projection:
    """The checkpoint's own map, or the fitted map of the VAE in ``model_dir``, fitted on
    first use (``load_vae()``)."""
    shipped = model_dir / "preview_rgb.npz"
    if shipped.is_file():
        with np.load(shipped) as z:
            maps = {k: z[k].astype(np.float32) for k in z.files}
        return maps.get("linear", maps)
    weights = sorted((model_dir / "vae").glob("*"))
    key = hashlib.sha1(
        "|".join(
            f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in weights
        ).encode()
    ).hexdigest()[:16]

    def fit(target: Path) -> None:
        np.save(target / "rgb.npy", fit_projection(load_vae()))

    return np.load(build_once(f"preview-{key}", fit, "rgb.npy") / "rgb.npy")


def project(x0: Any, projection: Projection) -> np.ndarray:
    """``uint8 (height, width, 3)`` from one latent ``(channels, height, width)``."""
    lat = np.asarray(x0, dtype=np.float32)
    c, h, w = lat.shape
    z = lat.reshape(c, h * w)
    if isinstance(projection, dict):  # a per-pixel MLP
        hidden = projection["w1"].T @ z + projection["b1"][:, None]
        hidden = hidden / (1.0 + np.exp(-hidden))  # SiLU
        rgb = projection["w2"].T @ hidden + projection["b2"][:, None]
    else:
        rgb = projection[:-1].T @ z + projection[-1][:, None]  # (3, h*w)
    rgb = (np.clip(rgb, -1.0, 1.0) + 1.0) * 127.5
    return np.ascontiguousarray(rgb.round().astype(np.uint8).T.reshape(h, w, 3))
