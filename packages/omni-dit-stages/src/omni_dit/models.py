"""Where a DiT stage's ``model`` option points, and loading a checkpoint's parts.

``model`` is required and takes what a diffusers user writes:

* a local directory in diffusers' layout (``model_index.json``, ``transformer/``,
  ``vae/``, ``scheduler/``, and the text encoders where ``dit.text_encode`` reads them);
* a Hugging Face id (``stabilityai/stable-diffusion-3.5-medium``), resolved through the
  Hugging Face cache by diffusers' own ``DiffusionPipeline.download`` (so ``variant``,
  ``HF_HUB_OFFLINE``, ``HF_HOME``/``HF_HUB_CACHE`` and ``HF_TOKEN`` work as with
  ``from_pretrained``); with ``HF_HUB_OFFLINE=1`` only what is cached is used;
* an embedded model by name (:data:`EMBEDDED`): ``tiny-sd3-shapes``, trained here and
  shipped in this package (it draws the scenes of :mod:`omni_dit.shapes`), or one of the
  random-weight ones, built once into omni's cache.

Every part is then loaded from the resolved directory with ``local_files_only``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_core.plugin import NamedModel, Reporter, build_once, cached
from omni_hf import hub_failure, hub_offline, looks_like_hub_id, quiet_hub

from omni_dit import embedded

TINY = "tiny-sd3"
# trained by tools/train-shapes/train.py, shipped as a diffusers directory in this package
SHAPES = "tiny-sd3-shapes"
SHAPES_DIR = Path(__file__).parent / "weights" / SHAPES
# the complete embedded checkpoints by name (tiny-sd3 is built per conditioning width)
_COMPLETE = {"tiny-sd3-full": embedded.build_tiny_sd3_full, "tiny-flux": embedded.build_tiny_flux}
EMBEDDED = (SHAPES, TINY, *_COMPLETE)


# What the zygote imports for the model stages (diffusers' top level is lazy: the modules
# that build transformers, VAEs and schedulers are named; the text encoders are transformers').
PRELOAD = (
    "torch",
    "diffusers.models.modeling_utils",
    "diffusers.models.transformers",
    "diffusers.models.autoencoders.autoencoder_kl",
    "diffusers.schedulers.scheduling_flow_match_euler_discrete",
    "diffusers.image_processor",
    "transformers.modeling_utils",
)


class ModelError(RuntimeError):
    """A ``model`` that cannot be resolved or loaded; the message names it and why."""


def resolve_model(model: str, conditioning_width: int = 576, variant: str | None = None) -> Path:
    """A diffusers pipeline directory for ``model`` (building an embedded one once,
    downloading a hub id unless offline)."""
    quiet_hub()
    if not isinstance(model, str) or not model:
        raise ModelError("option 'model': expected a directory, a Hugging Face id or a name")
    if os.path.isdir(model):
        path = Path(model)
    elif model == SHAPES:
        path = SHAPES_DIR
    elif model == TINY:
        return build_once(
            _tiny_dir(conditioning_width),
            lambda target: embedded.build_tiny_sd3(target, conditioning_width),
            "model_index.json",
        )
    elif model in _COMPLETE:
        return build_once(model, _COMPLETE[model], "model_index.json")
    elif looks_like_hub_id(model):
        path = _download(model, variant)
    else:
        raise ModelError(
            f"model {model!r}: not a directory, not a Hugging Face id (org/name) and not an "
            f"embedded model ({', '.join(EMBEDDED)})"
        )
    missing = [
        p
        for p in ("model_index.json", "transformer", "vae", "scheduler")
        if not (path / p).exists()
    ]
    if missing:
        raise ModelError(
            f"model {model!r}: not a diffusers pipeline directory (missing {', '.join(missing)})"
        )
    return path


def _tiny_dir(conditioning_width: int) -> str:
    """The cache directory of ``tiny-sd3`` built for one conditioning width."""
    return f"{TINY}-c{conditioning_width}"


def named_models() -> list[NamedModel]:
    """This family's named models (entry point ``omni-dit-stages`` of ``omni.models``)."""

    def ready(name: str) -> Callable[[], Path | None]:
        return lambda: cached(name, "model_index.json")

    def build(model: str) -> Callable[[Reporter], Path]:
        def pull(report: Reporter) -> Path:
            report("building it with seeded random weights (offline)")
            return resolve_model(model)

        return pull

    def shipped(report: Reporter) -> Path:
        return SHAPES_DIR

    return [
        NamedModel(
            SHAPES,
            "omni-dit-stages",
            "SD3 layout trained here: a coloured circle, square or triangle on a coloured "
            "background, 64 px, conditioned by SmolLM2 (the main job's)",
            lambda: SHAPES_DIR if (SHAPES_DIR / "model_index.json").exists() else None,
            shipped,
            "shipped in the package",
        ),
        NamedModel(
            TINY,
            "omni-dit-stages",
            "SD3 layout, random weights, no text encoders (576-wide conditioning; parity tests)",
            ready(_tiny_dir(576)),
            build(TINY),
            "build offline",
        ),
        *(
            NamedModel(
                name,
                "omni-dit-stages",
                f"a complete {layout} checkpoint with random weights (tests, benchmarks)",
                ready(name),
                build(name),
                "build offline",
            )
            for name, layout in (("tiny-sd3-full", "SD3.5"), ("tiny-flux", "FLUX.1"))
        ),
    ]


def _download(model: str, variant: str | None) -> Path:
    """The cached snapshot of hub id ``model``, fetched first unless offline."""
    from diffusers import DiffusionPipeline

    try:
        return Path(
            DiffusionPipeline.download(model, variant=variant, local_files_only=hub_offline())
        )
    except Exception as e:  # noqa: BLE001 - hub errors come in many types; name the model
        raise ModelError(hub_failure(model, e)) from None


def model_index(path: Path) -> dict[str, Any]:
    """The checkpoint's ``model_index.json`` (:class:`ModelError` when unreadable)."""
    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"model {str(path)!r}: cannot read model_index.json: {e}") from None
    if not isinstance(index, dict):
        raise ModelError(f"model {str(path)!r}: model_index.json is not a JSON object")
    return index


def read_config(path: Path, part: str) -> dict[str, Any]:
    """A part's config, without loading its weights."""
    name = "scheduler_config.json" if part == "scheduler" else "config.json"
    try:
        return json.loads((path / part / name).read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"model {str(path)!r}: cannot read {part}/{name}: {e}") from None


def torch_dtype(name: str) -> Any:
    """The torch dtype named ``float32``, ``bfloat16`` or ``float16`` (else ValueError)."""
    import torch

    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            name
        ]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected float32, bfloat16 or float16") from None


def load_part(
    cls: Any,
    path: Path,
    part: str,
    dtype: str = "float32",
    variant: str | None = None,
    device: str = "cpu",
) -> Any:
    """``cls.from_pretrained(path / part)`` in ``dtype`` on ``device`` (a torch device:
    ``"cpu"``, ``"cuda:0"``), in eval mode, offline."""
    model = cls.from_pretrained(
        path,
        subfolder=part,
        dtype=torch_dtype(dtype),
        variant=variant,
        local_files_only=True,
    )
    return model.to(device).eval()


def load_vae(
    path: Path, dtype: str = "float32", variant: str | None = None, device: str = "cpu"
) -> Any:
    """The checkpoint's VAE (``AutoencoderKL``), as :func:`load_part` loads a part."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL

    return load_part(AutoencoderKL, path, "vae", dtype, variant, device)


def load_scheduler(path: Path) -> Any:
    """The checkpoint's flow-matching scheduler (``FlowMatchEulerDiscreteScheduler``)
    from its ``scheduler`` config."""
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
        FlowMatchEulerDiscreteScheduler,
    )

    return FlowMatchEulerDiscreteScheduler.from_pretrained(path / "scheduler")
