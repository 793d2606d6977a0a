"""The embedded ``tiny-sd3-shapes``: its world, its oracle, and that it loads by name
through the same ``from_pretrained`` paths as any checkpoint (the picture targets run in
integration_tests/test_shapes_model.py, where SmolLM2 encodes the prompts)."""

import numpy as np
import pytest
from omni_dit import models, shapes
from omni_dit.preview import cached_projection, project


def test_held_out_scenes_are_not_trained_and_every_word_is():
    assert len(shapes.HELD_OUT) == 24 and not set(shapes.HELD_OUT) & set(shapes.TRAIN)
    for scene in shapes.HELD_OUT:  # its colour pair and its shape each appear in training
        assert any((s.fg, s.bg) == (scene.fg, scene.bg) for s in shapes.TRAIN)
        assert any(s.shape == scene.shape and s.fg == scene.fg for s in shapes.TRAIN)


def test_the_oracle_reads_every_drawn_scene_right():
    rng = np.random.default_rng(1)
    for scene in shapes.TRAIN + shapes.HELD_OUT:
        for _ in range(2):
            v = shapes.judge(shapes.draw(scene, rng))
            assert v.colours_right(scene) and v.shape_right(scene), (scene, v)


def test_the_oracle_is_not_fooled_by_noise_or_a_blank_picture():
    rng = np.random.default_rng(2)
    noise = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    blank = np.full((64, 64, 3), shapes.PALETTE["blue"], np.uint8)
    assert shapes.judge(blank).shape is None and shapes.judge(blank).bg == "blue"
    scene = shapes.Scene("circle", "red", "blue")
    assert not (shapes.judge(noise).colours_right(scene) and shapes.judge(noise).shape_right(scene))


def test_a_wrong_picture_is_judged_wrong():
    rng = np.random.default_rng(3)
    v = shapes.judge(shapes.draw(shapes.Scene("triangle", "green", "white"), rng))
    asked = shapes.Scene("circle", "white", "green")
    assert not v.colours_right(asked) and not v.shape_right(asked)


def test_the_shipped_model_loads_by_name_and_draws_its_size():
    pytest.importorskip("diffusers")
    import torch
    from diffusers import SD3Transformer2DModel

    path = models.resolve_model(models.SHAPES)
    assert path == models.SHAPES_DIR and (path / "model_index.json").is_file()
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size < 8 * 2**20, size  # a few MB, shipped in the wheel
    transformer = models.load_part(SD3Transformer2DModel, path, "transformer")
    assert transformer.config.joint_attention_dim == 576  # SmolLM2's hidden states
    vae = models.load_vae(path)
    assert vae.config.scaling_factor != 1.0  # fitted on its latents
    # previews use the map fitted on its real latents, shipped beside it, and read its
    # colours right: a drawn scene's latents previewed give the scene's two colours
    projection = cached_projection(path, lambda: pytest.fail("fitted again"))
    assert projection["w1"].shape == (vae.config.latent_channels, 32)
    scene = shapes.Scene("square", "red", "green")
    image = shapes.draw(scene, np.random.default_rng(0))
    x = torch.from_numpy(image.astype(np.float32).transpose(2, 0, 1)[None] / 127.5 - 1)
    with torch.no_grad():
        raw = vae.encode(x).latent_dist.mean
    c = vae.config
    preview = project(((raw - c.shift_factor) * c.scaling_factor)[0].numpy(), projection)
    assert preview.shape == (16, 16, 3)
    verdict = shapes.judge(preview)
    assert verdict.colours_right(scene), verdict


def test_user_phrasings_are_held_out_compositions_of_the_training_grammar():
    train = {p.casefold() for p in shapes.TRAIN_PHRASINGS}
    words = {w for p in train for w in p.replace(",", " ").split()}
    assert len(shapes.USER_PHRASINGS) >= 4 and len(train) >= 1000
    for phrasing in shapes.USER_PHRASINGS:  # never trained, in any case
        assert phrasing.casefold() not in train, phrasing
        # ... but made of words training shows: the wording is new, not the words
        assert set(phrasing.casefold().replace(",", " ").split()) <= words, phrasing
    # the first model's phrasings, the canonical caption first, are all still trained
    assert set(shapes.TEMPLATES) <= set(shapes.TRAIN_PHRASINGS)
    assert shapes.Scene("circle", "red", "blue").caption() == "a red circle on a blue background"
    assert shapes.Scene("circle", "red", "blue").caption("{fg} {shape} on {bg}") == (
        "red circle on blue"
    )


def test_every_phrasing_fits_the_text_encoders_16_tokens():
    """``ar.text_encode`` cuts a prompt to ``max_tokens: 16``, its lead token counted
    (configs/dit_image.yaml); a longer caption would lose its colours or its shape."""
    pytest.importorskip("transformers")
    pytest.importorskip("omni_ar", reason="the AR family resolves the packaged SmolLM2")
    from omni_ar.models import packaged_model_ready, resolve_model
    from transformers import AutoTokenizer

    if not packaged_model_ready("smollm2"):
        pytest.skip("needs the packaged SmolLM2 (hatch run setup)")
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    # every colour as figure and as background, every shape
    scenes = [
        shapes.Scene(shapes.SHAPES[i % 3], fg, shapes.COLOURS[(i + 1) % 8])
        for i, fg in enumerate(shapes.COLOURS)
    ]
    phrasings = shapes.TRAIN_PHRASINGS + shapes.USER_PHRASINGS
    captions = [s.caption(p) for p in phrasings for s in scenes]
    captions += [c[0].upper() + c[1:] for c in captions]  # training capitalises some
    longest = max(len(ids) for ids in tok(captions)["input_ids"])
    assert longest <= 15, longest


class _Painter:
    """A stand-in pipeline for :func:`shapes.score`: draws the scene its prompt names
    (the words, in any phrasing), or a blank canvas when the prompt has no shape word."""

    def generate(self, requests: list[dict]) -> list:
        import io
        from types import SimpleNamespace

        from PIL import Image

        outs = []
        for r in requests:
            words = r["prompt"].replace(",", " ").split()
            colours = [w for w in words if w in shapes.PALETTE]
            shape = next((w for w in words if w in shapes.SHAPES), None)
            rng = np.random.default_rng(r["image"]["seed"])
            if shape is None:
                image = np.full((64, 64, 3), shapes.PALETTE[colours[-1]], np.uint8)
            else:
                fg, bg = (
                    colours if words.index(shape) < words.index("background") else colours[::-1]
                )
                image = shapes.draw(shapes.Scene(shape, fg, bg), rng)
            buf = io.BytesIO()
            Image.fromarray(image).save(buf, format="PNG")
            final = SimpleNamespace(arrays={"image": buf.getvalue()})
            outs.append(SimpleNamespace(ok=True, final=final, events=[]))
        return outs


def test_score_takes_a_phrasing_and_counts_blank_pictures():
    scenes = shapes.HELD_OUT[:6]
    right = shapes.score(_Painter(), scenes, "{bg} background behind the {fg} {shape}")
    assert right["colour_rate"] == right["shape_rate"] == 1.0 and right["blank_rate"] == 0.0
    assert right["pictures"][0]["prompt"] == scenes[0].caption(
        "{bg} background behind the {fg} {shape}"
    )
    blank = shapes.score(_Painter(), scenes, "a {fg} thing on a {bg} background")
    assert blank["blank_rate"] == 1.0 and blank["shape_rate"] == 0.0
    assert shapes.score(_Painter(), scenes, 3)["colour_rate"] == 1.0  # an index: TEMPLATES[3]


class _Rewriter(_Painter):
    """A stand-in for the main job: rewrites each prompt first (the canonical caption of
    the scene its words name, its colours swapped in every other one, streamed as text
    in two pieces) and paints the rewrite."""

    def generate(self, requests: list[dict]) -> list:
        from types import SimpleNamespace

        rewritten = []
        for i, r in enumerate(requests):
            words = r["prompt"].replace(",", " ").split()
            fg, bg = [w for w in words if w in shapes.PALETTE]
            shape = next(w for w in words if w in shapes.SHAPES)
            scene = shapes.Scene(shape, *((fg, bg) if i % 2 == 0 else (bg, fg)))
            rewritten.append({**r, "prompt": scene.caption()})
        outs = super().generate(rewritten)
        for out, r in zip(outs, rewritten, strict=True):
            text = r["prompt"].capitalize() + "."
            out.events = [SimpleNamespace(payload={"text": t}) for t in (text[:5], text[5:])]
        return outs


def test_score_reads_a_rewrite_against_the_canonical_caption():
    scenes = shapes.HELD_OUT[:6]
    r = shapes.score(_Rewriter(), scenes, "{fg} {shape} on {bg}")
    assert r["rewrite_rate"] == 0.5 and r["colour_rate"] == 0.5  # the swapped half
    assert r["pictures"][0]["expanded"] == scenes[0].caption().capitalize() + "."
    assert "rewrite_rate" not in shapes.score(_Painter(), scenes)  # nothing rewritten


def test_a_rewrite_is_right_only_as_the_scenes_canonical_caption():
    scene = shapes.Scene("circle", "red", "blue")
    for text in (
        "a red circle on a blue background",
        "A red circle on a blue background.",  # case and a final period aside
        " A Red Circle On A Blue Background. \n",
    ):
        assert shapes.rewrite_right(scene, text), text
    for text in (
        "a blue circle on a red background",  # the colours swapped
        "a red square on a blue background",
        "red circle on blue",  # right words, not the caption
        "a red circle on a blue background, please",
        "a red circle. on a blue background",
        "",
    ):
        assert not shapes.rewrite_right(scene, text), text


def test_streamed_text_joins_the_text_pieces_of_a_request():
    from types import SimpleNamespace

    payloads = [{"text": " A red"}, None, {"tokens": [7]}, {"text": ["x"]}, {"text": " circle. "}]
    out = SimpleNamespace(events=[SimpleNamespace(payload=p) for p in payloads])
    assert shapes.streamed_text(out) == "A red circle."
    assert shapes.streamed_text(SimpleNamespace(events=[])) == ""


def test_other_wordings_are_the_documented_ones_never_trained():
    scene = shapes.Scene("circle", "red", "blue")
    assert [scene.caption(w) for w in shapes.OTHER_WORDINGS] == [
        "can you show a red circle with a blue background",
        "blue background, red circle in the middle",
        "make a circle that is red on blue",
        "A red circle. Background: blue.",
    ]
    known = {p.casefold() for p in shapes.TRAIN_PHRASINGS + shapes.USER_PHRASINGS}
    assert not known & {w.casefold() for w in shapes.OTHER_WORDINGS}
