"""The procedural world of the embedded ``tiny-sd3-shapes`` model, and its picture oracle.

A scene is one flat shape (circle, square, triangle) in one colour on a background of
another, at a random size and place; its caption names the three ("a red circle on a blue
background", or any of :data:`TRAIN_PHRASINGS`). :func:`draw` paints a scene,
:data:`HELD_OUT` are the shape-and-colours combinations the model never saw in training,
:data:`USER_PHRASINGS` the wordings it never saw, and :func:`judge` reads a
picture back with simple image statistics: the background's colour from the border, the
figure's from the rest, and the shape from how the figure fills its bounding box and how
its width changes from top to bottom.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "orange": (245, 140, 30),
    "purple": (140, 60, 180),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
COLOURS = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle")
SIZE = 64  # the side of the pictures the model learned

TEMPLATES = (  # the five phrasings of the first model, all still in training
    "a {fg} {shape} on a {bg} background",  # the canonical caption (the main job's rewrite)
    "a {fg} {shape} against a {bg} backdrop",
    "{fg} {shape}, {bg} background",
    "a {bg} background with a {fg} {shape}",
    "a picture of a {fg} {shape} on {bg}",
)

# The training grammar: a phrasing is an optional lead, then the figure and the background
# in either order, joined by one of a few relations. Every part is seen in training; the
# user phrasings below are compositions of them that training never shows (as the
# held-out scenes are of shapes and colours).
LEADS = (
    "",
    "draw ",
    "paint ",
    "draw me ",
    "paint me ",
    "please draw ",
    "please paint ",
    "please draw me ",
    "I want ",
    "make ",
    "show me ",
    "a picture of ",
    "an image of ",
    "can you draw ",
)
FIGURES = ("a {fg} {shape}", "one {fg} {shape}", "{fg} {shape}", "the {fg} {shape}")
BACKGROUNDS = (
    "a {bg} background",
    "a {bg} backdrop",
    "{bg} background",
    "{bg}",
    "the {bg} background",
)
FIGURE_FIRST = ("on", "over", "against", "in front of", ",", "with")  # figure, then background
BACKGROUND_FIRST = ("with", "behind")  # background, then figure

# Plain user wording, held out of training (casefolded): the phrasing sets of
# ``omni bench dit --arms quality``.
USER_PHRASINGS = (
    "draw me a {fg} {shape} on a {bg} background",
    "I want a {fg} {shape} over a {bg} background",
    "please paint a {fg} {shape} against {bg}",
    "{fg} {shape} on {bg}",
)

# Wordings far from the main job's worked examples (configs/mixed_ar_dit.yaml), to show
# how far they carry: the second set of ``omni bench dit --arms rewrite``.
OTHER_WORDINGS = (
    "can you show a {fg} {shape} with a {bg} background",
    "{bg} background, {fg} {shape} in the middle",
    "make a {shape} that is {fg} on {bg}",
    "A {fg} {shape}. Background: {bg}.",
)


def _grammar() -> tuple[str, ...]:
    out: list[str] = []
    for lead in LEADS:
        for fig in FIGURES:
            for bgp in BACKGROUNDS:
                for rel in FIGURE_FIRST:
                    out.append(f"{lead}{fig}{rel if rel == ',' else ' ' + rel} {bgp}")
                for rel in BACKGROUND_FIRST:
                    out.append(f"{lead}{bgp} {rel} {fig}")
    return tuple(out)


_HELD = {p.casefold() for p in USER_PHRASINGS}
# Every training phrasing (lower case as written; training also capitalises the first
# letter of some), never a user phrasing whatever its case.
TRAIN_PHRASINGS = tuple(p for p in _grammar() if p.casefold() not in _HELD)


@dataclass(frozen=True)
class Scene:
    shape: str
    fg: str
    bg: str

    def caption(self, template: int | str = 0) -> str:
        """The caption in one phrasing: an index into :data:`TEMPLATES` or a template
        string with ``{fg}``, ``{shape}`` and ``{bg}``."""
        text = TEMPLATES[template] if isinstance(template, int) else template
        return text.format(shape=self.shape, fg=self.fg, bg=self.bg)


def _held_out() -> tuple[Scene, ...]:
    """24 combinations: 24 distinct (figure, background) colour pairs, each with one shape
    held out (the pair is seen in training with the other two shapes, and the shape with
    other colours), so the held-out scenes test composition, not new words."""
    pairs = [(f, b) for f in COLOURS for b in COLOURS if f != b]
    random.Random(19).shuffle(pairs)
    return tuple(Scene(SHAPES[i % 3], f, b) for i, (f, b) in enumerate(pairs[:24]))


HELD_OUT = _held_out()
TRAIN = tuple(
    s
    for s in (Scene(sh, f, b) for sh in SHAPES for f in COLOURS for b in COLOURS if f != b)
    if s not in set(HELD_OUT)
)


def draw(scene: Scene, rng: np.random.Generator, size: int = SIZE) -> np.ndarray:
    """``uint8 (size, size, 3)``: the scene with its figure at a random size and place,
    edges antialiased (drawn at 4x and box-filtered down)."""
    from PIL import Image, ImageDraw

    k = 4
    big = size * k
    image = Image.new("RGB", (big, big), PALETTE[scene.bg])
    pen = ImageDraw.Draw(image)
    side = rng.uniform(0.38, 0.62) * big
    margin = 0.06 * big
    x0 = rng.uniform(margin, big - margin - side)
    y0 = rng.uniform(margin, big - margin - side)
    box = (x0, y0, x0 + side, y0 + side)
    colour = PALETTE[scene.fg]
    if scene.shape == "circle":
        pen.ellipse(box, fill=colour)
    elif scene.shape == "square":
        pen.rectangle(box, fill=colour)
    elif scene.shape == "triangle":
        pen.polygon([(x0 + side / 2, y0), (x0 + side, y0 + side), (x0, y0 + side)], fill=colour)
    else:
        raise ValueError(f"shape {scene.shape!r}: expected one of {', '.join(SHAPES)}")
    return np.asarray(image.resize((size, size), Image.Resampling.BOX))


@dataclass(frozen=True)
class Verdict:
    shape: str | None  # None: no figure found
    fg: str | None
    bg: str
    fill: float  # the figure's share of its bounding box
    taper: float  # its width near the top over its width near the bottom

    def colours_right(self, scene: Scene) -> bool:
        return self.fg == scene.fg and self.bg == scene.bg

    def shape_right(self, scene: Scene) -> bool:
        return self.shape == scene.shape


def judge(image: np.ndarray) -> Verdict:
    """What a picture shows, read with image statistics (any size; RGB uint8)."""
    rgb = np.asarray(image, dtype=np.float32)[..., :3]
    h, w = rgb.shape[:2]
    palette = np.array(list(PALETTE.values()), dtype=np.float32)
    labels = np.argmin(((rgb[:, :, None, :] - palette) ** 2).sum(-1), axis=-1)
    ring = max(1, min(h, w) // 32)
    border = np.concatenate(
        [
            labels[:ring].ravel(),
            labels[-ring:].ravel(),
            labels[:, :ring].ravel(),
            labels[:, -ring:].ravel(),
        ]
    )
    bg = int(np.bincount(border, minlength=len(palette)).argmax())
    inside = labels[ring:-ring, ring:-ring]
    counts = np.bincount(inside.ravel(), minlength=len(palette))
    counts[bg] = 0
    if counts.max() < 0.01 * inside.size:  # nothing but background
        return Verdict(None, None, COLOURS[bg], 0.0, 0.0)
    fg = int(counts.argmax())
    mask = labels == fg
    ys, xs = np.nonzero(mask)
    # robust bounds: a few stray pixels of the figure's colour do not stretch the box
    y0, y1 = np.percentile(ys, [1, 99])
    x0, x1 = np.percentile(xs, [1, 99])
    box = mask[int(y0) : int(y1) + 1, int(x0) : int(x1) + 1]
    fill = float(box.mean()) if box.size else 0.0
    rows = box.sum(axis=1).astype(np.float32)
    n = len(rows)
    top = rows[int(0.15 * n) : int(0.3 * n) + 1].mean() if n >= 4 else 0.0
    bottom = rows[int(0.7 * n) : int(0.85 * n) + 1].mean() if n >= 4 else 0.0
    taper = float(top / bottom) if bottom else 0.0
    if fill >= 0.88:
        shape = "square"
    elif taper < 0.65 and fill < 0.7:
        shape = "triangle"
    else:
        shape = "circle"
    return Verdict(shape, COLOURS[fg], COLOURS[bg], fill, taper)


def score(
    pipe: Any, scenes: tuple[Scene, ...] = HELD_OUT, template: int | str = 0, seed: int = 0
) -> dict[str, Any]:
    """Each scene's caption in one phrasing (see :meth:`Scene.caption`) through ``pipe``
    (an ``omni_core.Pipeline`` ending in an encoded image), all at once, each picture read
    by :func:`judge`: the share of right colours, of right shapes and of blank pictures
    (no figure at all), and what was seen for each caption."""
    from PIL import Image

    captions = [s.caption(template) for s in scenes]
    requests = [{"prompt": c, "image": {"seed": seed + i}} for i, c in enumerate(captions)]
    seen: list[dict[str, Any]] = []
    colours = shapes_right = blank = rewrites = rewrites_right = 0
    for scene, caption, out in zip(scenes, captions, pipe.generate(requests), strict=True):
        entry: dict[str, Any] = {"prompt": caption}
        if not out.ok:
            entry["error"] = out.error
        else:
            image = np.asarray(Image.open(io.BytesIO(out.final.arrays["image"])).convert("RGB"))
            v = judge(image)
            colours += v.colours_right(scene)
            shapes_right += v.shape_right(scene)
            blank += v.fg is None
            entry["seen"] = f"a {v.fg} {v.shape} on a {v.bg} background"
            expanded = streamed_text(out)
            if expanded:  # a pipeline that rewrote the prompt first
                entry["expanded"] = expanded
                rewrites += 1
                rewrites_right += rewrite_right(scene, expanded)
        seen.append(entry)
    n = max(len(scenes), 1)
    rates = {
        "colour_rate": round(colours / n, 3),
        "shape_rate": round(shapes_right / n, 3),
        "blank_rate": round(blank / n, 3),
    }
    if rewrites:  # the share of rewrites that are the scene's canonical caption
        rates["rewrite_rate"] = round(rewrites_right / n, 3)
    return {**rates, "pictures": seen}


def streamed_text(out: Any) -> str:
    """The text a request's events streamed (``payload["text"]`` pieces, joined), stripped:
    the main job's rewrite of its prompt; empty where none was streamed."""
    texts = [e.payload.get("text", "") for e in out.events if e.payload]
    return "".join(t for t in texts if isinstance(t, str)).strip()


def rewrite_right(scene: Scene, text: str) -> bool:
    """Whether a rewrite is ``scene``'s canonical caption, case and periods at its end
    aside."""
    return text.strip().lower().rstrip(".") == scene.caption()
