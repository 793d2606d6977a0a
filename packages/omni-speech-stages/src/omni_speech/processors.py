"""The checkpoint's input processors the thinker runs apart from the model's own
processor (whose video part needs torchvision)."""

from __future__ import annotations

from typing import Any


def image_processor_class() -> Any:
    """Qwen's image processor, its PIL backend (the default one needs torchvision)."""
    try:  # transformers >= 5.20 names the PIL backend apart
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )
    except ImportError:
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor
    return Qwen2VLImageProcessorPil
