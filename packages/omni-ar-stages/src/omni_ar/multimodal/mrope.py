"""M-RoPE (Qwen2-VL, Qwen2.5-VL): where a prompt's tokens sit, from its images' grids.

A text token's position is one number used in all three of (time, height, width); an
image's placeholders take ``t x (h / m) x (w / m)`` grid positions that start where the
text before it stopped, and the text after it goes on from the start plus
``max(h, w) / m`` (``m``: the spatial merge), not plus the image's length. So past the
last image every token sits at its index plus a constant, the *position delta*; that is
all a decode that never sees the media needs to place the tokens after the prompt, and
the grids let it check that delta against the prompt's own placeholder spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# model types whose position rule is this module's (the images' positions as above)
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def uses_mrope(config: Any) -> bool:
    """Whether a model's ``transformers`` config (or its text config) has M-RoPE."""
    text = config.get_text_config()
    for c in (config, text):
        for field in ("rope_scaling", "rope_parameters"):
            rope = getattr(c, field, None)
            if isinstance(rope, dict) and (
                "mrope_section" in rope or "mrope" in (rope.get("rope_type"), rope.get("type"))
            ):
                return True
    return False


def grid_tokens(grid: Sequence[int], merge: int) -> int:
    """Placeholders of an item with patch grid ``(t, h, w)``."""
    t, h, w = grid
    return t * h * w // (merge * merge)


def position_delta(
    spans: Sequence[tuple[int, int]], grids: Sequence[Sequence[int]], merge: int
) -> int:
    """The position delta of a prompt whose items have these (offset, length) spans and
    (t, h, w) grids: each item advances the positions by ``max(h, w) / merge`` instead of
    its length."""
    return sum(
        max(g[1], g[2]) // merge - length for (_, length), g in zip(spans, grids, strict=True)
    )
