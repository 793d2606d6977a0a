"""The docs' pictures of ``tiny-sd3-shapes``: the 24 held-out scenes through
``configs/dit_image.yaml`` as shipped (seeds 0..23, as ``omni bench dit --arms quality``
draws them), in a grid with the oracle's verdict under each, and the main job's previews
and final picture for one prompt.

    hatch run python tools/train-shapes/pictures.py
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
from omni_core import Pipeline, load_config
from omni_dit import shapes
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "images"
MAIN_JOB_PROMPT = "draw me a red square on green"
SCALE = 2  # pixels shown per pixel drawn


def held_out_grid() -> Image.Image:
    """Six columns of held-out scenes: the picture, then a bar that is green where the
    oracle read colours and shape right, amber where only the colours, red otherwise."""
    with Pipeline(load_config(REPO / "configs" / "dit_image.yaml")) as pipe:
        outs = pipe.generate(
            [{"prompt": s.caption(), "image": {"seed": i}} for i, s in enumerate(shapes.HELD_OUT)]
        )
    side = shapes.SIZE * SCALE
    cols, rows = 6, (len(outs) + 5) // 6
    grid = Image.new("RGB", (cols * (side + 4), rows * (side + 12)), "white")
    pen = ImageDraw.Draw(grid)
    for i, (scene, out) in enumerate(zip(shapes.HELD_OUT, outs, strict=True)):
        picture = Image.open(io.BytesIO(out.final.arrays["image"])).convert("RGB")
        v = shapes.judge(np.asarray(picture))
        x, y = (i % cols) * (side + 4), (i // cols) * (side + 12)
        grid.paste(picture.resize((side, side), Image.Resampling.NEAREST), (x, y))
        ok = v.colours_right(scene), v.shape_right(scene)
        colour = "#2e7d32" if all(ok) else "#f9a825" if ok[0] else "#c62828"
        pen.rectangle((x, y + side + 2, x + side, y + side + 8), fill=colour)
        print(f"{scene.caption():45s} -> {v.fg} {v.shape} on {v.bg}", file=sys.stderr)
    return grid


def main_job_strip() -> Image.Image:
    """The main job's previews (every 4 steps) and its final picture, left to right."""
    with Pipeline(load_config(REPO / "configs" / "mixed_ar_dit.yaml")) as pipe:
        events = list(pipe.stream({"prompt": MAIN_JOB_PROMPT}))
    text = "".join(
        str(e.payload.get("text", "")) for e in events if e.stage == "postprocess" and e.payload
    )
    print(f"main job: {MAIN_JOB_PROMPT!r} -> {text.strip()!r}", file=sys.stderr)
    previews = [e.arrays["preview"] for e in events if "preview" in getattr(e, "arrays", {})]
    frames = [Image.fromarray(p) for p in previews]
    final = [e for e in events if e.event_type == "image" and e.is_last][-1]
    frames.append(Image.open(io.BytesIO(final.arrays["image"])).convert("RGB"))
    side = shapes.SIZE * SCALE
    strip = Image.new("RGB", (len(frames) * (side + 4), side), "white")
    for i, f in enumerate(frames):
        strip.paste(f.resize((side, side), Image.Resampling.NEAREST), (i * (side + 4), 0))
    return strip


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    held_out_grid().save(OUT / "shapes-held-out.png")
    main_job_strip().save(OUT / "main-job.png")
    print(f"wrote {OUT}/shapes-held-out.png and main-job.png", file=sys.stderr)


if __name__ == "__main__":
    main()
