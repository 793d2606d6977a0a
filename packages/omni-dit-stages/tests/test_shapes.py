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
