"""``omni bench dit --arms rewrite``: the main job's rewrite alone, the stages of
``configs/mixed_ar_dit.yaml`` as shipped before its text encoder (the full arm's figures
are in docs/shapes-model.md, "Wording")."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from omni_bench.dit import rewrite_config, rewrite_rates
from omni_core import load_config
from omni_core.config import PipelineConfig

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def shipped(name: str) -> PipelineConfig:
    """A shipped config, its stage kinds not imported (the layout is what counts here)."""
    return load_config(CONFIGS / name, check_kinds=False)


def test_the_rewrite_is_the_shipped_stages_before_the_text_encoder():
    mixed = shipped("mixed_ar_dit.yaml")
    cfg = rewrite_config(mixed)
    assert [s.name for s in cfg.stages] == ["intake", "prefill", "decode", "postprocess"]
    assert [(e.source, e.target) for e in cfg.edges] == [
        ("intake", "prefill"),
        ("prefill", "decode"),
        ("decode", "postprocess"),
    ]
    assert all(s == mixed.stage(s.name) for s in cfg.stages)  # options as shipped
    assert cfg.edges == mixed.edges[:3]  # windows too
    assert cfg.sinks() == cfg.client_streams() == ["postprocess"]  # the text, to the caller
    assert cfg.ready_timeout_s == mixed.ready_timeout_s


def test_a_pipeline_that_rewrites_nothing_is_refused():
    with pytest.raises(ValueError, match="no stage rewrites the prompt"):
        rewrite_config(shipped("dit_image.yaml"))  # its text encoder first
    with pytest.raises(ValueError, match="no stage rewrites the prompt"):
        rewrite_config(shipped("demo.yaml"))  # no text encoder


class _Rewriter:
    """A stand-in for the rewrite: takes the colours in the order the prompt names them
    (so a wording with the background first comes back swapped) and streams "A <colour>
    <shape> on a <colour> background." in two pieces; a prompt that starts with "A "
    fails, after streaming the right caption."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def generate(self, requests: list[dict]) -> list:
        from omni_dit.shapes import COLOURS, SHAPES

        outs = []
        for r in requests:
            self.prompts.append(r["prompt"])
            words = r["prompt"].lower().replace(",", " ").replace(".", " ").split()
            fg, bg = [w for w in words if w in COLOURS]
            shape = next(w for w in words if w in SHAPES)
            text = f"A {fg} {shape} on a {bg} background."
            events = [SimpleNamespace(payload={"text": t}) for t in (text[:6], text[6:])]
            failed = r["prompt"].startswith("A ")
            outs.append(
                SimpleNamespace(ok=not failed, error="failed" if failed else None, events=events)
            )
        return outs


def test_rewrite_rates_count_each_set_and_phrasing_and_show_the_wrong_rewrites():
    from omni_dit.shapes import HELD_OUT

    scenes = HELD_OUT[:3]
    canonical, short = "a {fg} {shape} on a {bg} background", "{fg} {shape} on {bg}"
    swapped, kept = (
        "{bg} background, {fg} {shape} in the middle",
        "make a {shape} that is {fg} on {bg}",
    )
    failing = "A {fg} {shape}. Background: {bg}."
    pipe = _Rewriter()
    r = rewrite_rates(pipe, scenes, {"": (canonical, short), "other_": (swapped, kept, failing)})
    phrasings = (canonical, short, swapped, kept, failing)
    assert pipe.prompts == [s.caption(p) for p in phrasings for s in scenes]  # all at once
    assert (r["rewrite_rate"], r["rewrite_right"], r["rewrite_asked"]) == (1.0, 6, 6)
    assert (r["rewrite_other_rate"], r["rewrite_other_right"], r["rewrite_other_asked"]) == (
        0.333,
        3,
        9,
    )
    assert r["rewrite_by_phrasing"] == {
        canonical: 1.0,
        short: 1.0,
        swapped: 0.0,
        kept: 1.0,
        failing: 0.0,
    }
    # two of each wrong phrasing (of three), a failed request with its error
    s0, s1 = scenes[:2]
    assert r["rewrite_wrong"] == [
        {
            "phrasing": swapped,
            "prompt": s.caption(swapped),
            "rewrite": f"A {s.bg} {s.shape} on a {s.fg} background.",
            "caption": s.caption(),
        }
        for s in (s0, s1)
    ] + [
        {
            "phrasing": failing,
            "prompt": s.caption(failing),
            "rewrite": s.caption().capitalize() + ".",
            "caption": s.caption(),
            "error": "failed",
        }
        for s in (s0, s1)
    ]


def test_rewrite_rates_of_no_scene_and_of_one():
    from omni_dit.shapes import HELD_OUT

    short = "{fg} {shape} on {bg}"
    r = rewrite_rates(_Rewriter(), (), {"": (short,), "other_": ()})
    assert (r["rewrite_rate"], r["rewrite_asked"], r["rewrite_other_rate"]) == (0.0, 0, 0.0)
    assert r["rewrite_by_phrasing"] == {short: 0.0} and not r["rewrite_wrong"]
    r = rewrite_rates(_Rewriter(), HELD_OUT[:1], {"": (short,), "other_": ()})
    assert (r["rewrite_rate"], r["rewrite_right"], r["rewrite_asked"]) == (1.0, 1, 1)
    assert r["rewrite_by_phrasing"] == {short: 1.0}


def test_rewrite_arm_runs_the_shipped_rewrite(bench_json):
    pytest.importorskip("omni_ar")
    from omni_ar.models import packaged_model_ready
    from omni_dit.shapes import HELD_OUT, OTHER_WORDINGS, TEMPLATES, USER_PHRASINGS, rewrite_right

    if not packaged_model_ready("smollm2"):
        pytest.skip("needs the packaged SmolLM2 (hatch run setup)")
    args = ["--arms", "rewrite", "--quality-scenes", "2", "--quality-phrasings", "1"]
    r = bench_json("dit", [*args, "--other-wordings", "1"])
    by_phrasing = r["rewrite_by_phrasing"]
    assert list(by_phrasing) == [TEMPLATES[0], USER_PHRASINGS[0], OTHER_WORDINGS[0]]
    assert (r["rewrite_asked"], r["rewrite_other_asked"]) == (4, 2)
    assert r["rewrite_right"] == 2 * (by_phrasing[TEMPLATES[0]] + by_phrasing[USER_PHRASINGS[0]])
    assert r["rewrite_other_right"] == 2 * by_phrasing[OTHER_WORDINGS[0]]
    wrong = r["rewrite_wrong"]  # all of them, here
    assert len(wrong) == 6 - r["rewrite_right"] - r["rewrite_other_right"], wrong
    scenes = {s.caption(): s for s in HELD_OUT[:2]}
    assert not any(rewrite_right(scenes[w["caption"]], w["rewrite"]) for w in wrong), wrong
    # the shipped rewrite of the canonical caption and a user phrasing (120 / 120 in full)
    assert r["rewrite_rate"] >= 0.75, wrong
