"""The diffusion architectures the DiT stages run, chosen from a checkpoint's
``model_index.json`` (its ``_class_name``, the diffusers pipeline it was saved from).

Each architecture says what differs between them: the shape of the latents (SD3's
``(C, h, w)``, Flux's packed ``(h/2 * w/2, 4C)``), how a request's seeded noise and
schedule are made, one transformer call with its guidance, how latents reach the VAE,
and how prompts are encoded. The stages (``omni_dit.stages``, ``omni_dit.text_encode``)
are the same for all. Where diffusers' pipeline has a function or static method for a
step (``calculate_shift``, ``retrieve_timesteps``, ``_pack_latents``, ``encode_prompt``),
it is called, not re-derived, so a staged image equals the pipeline's.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from omni_dit.architectures.base import Architecture, TextOptions
from omni_dit.models import ModelError, model_index

__all__ = ["SUPPORTED", "Architecture", "TextOptions", "architecture"]

# diffusers pipeline class -> the architecture that runs it
SUPPORTED = {
    "StableDiffusion3Pipeline": "omni_dit.architectures.sd3:SD3",
    "FluxPipeline": "omni_dit.architectures.flux:Flux",
}


def architecture(path: Path) -> Architecture:
    """The architecture of the checkpoint in ``path``; :class:`ModelError` naming an
    unsupported one and listing the supported ones."""
    index = model_index(path)
    name = index.get("_class_name")
    target = SUPPORTED.get(name)
    if target is None:
        raise ModelError(
            f"model {str(path)!r}: architecture {name!r} (model_index.json _class_name) is "
            f"not supported; supported: {', '.join(SUPPORTED)}"
        )
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(path, index)
