"""A third-party stage on the public plug-in API alone (tools/surface-plugin,
``surface.tally``: it imports nothing of omni but ``omni_core.plugin``) runs after the AR
stages and at the end of the mixed AR + diffusion pipeline, fanned in from both: what it
counts is what the caller saw from the stages before it, and its failure ends only its
own request."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("omni_surface_plugin")

from omni_core import Pipeline  # noqa: E402

TALLY = {"name": "tally", "kind": "surface.tally", "options": {"arrays": ["image"]}}


def of(stage, events):
    """``stage``'s data events (``completed`` names the stage whose stream ended last)."""
    return [e for e in events if e.stage == stage and e.event_type != "completed"]


def ar_stages(llm):
    ar = {"model": llm, "threads": 1}
    kinds = {"intake": "ar.intake", "generate": "ar.generate", "postprocess": "ar.postprocess"}
    return [{"name": n, "kind": k, "options": ar} for n, k in kinds.items()]


def test_after_the_ar_stages_it_counts_the_text_the_caller_got(llm):
    stages = [*ar_stages(llm), {**TALLY, "options": {"max_text_chars": 10_000}}]
    stages[2]["client_stream"] = True
    names = [s["name"] for s in stages]
    edges = [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)]
    edges[1]["window"] = {"size": 1}  # a segment a token: the text flows on as it comes
    cfg = {"heartbeat_interval_s": 0.1, "stages": stages, "edges": edges}
    with Pipeline(cfg) as pipe:
        handles = [pipe.submit({"prompt": p, "max_tokens": 7}) for p in ("a fox", "snow", "hi")]
        outs = [list(h) for h in handles]
    for events in outs:
        assert events[-1].event_type == "completed", events[-1]
        text = "".join(e.payload["text"] for e in of("postprocess", events))
        tokens = sum(len(e.tokens or []) for e in of("postprocess", events))
        (summary,) = [e.payload["tally"] for e in of("tally", events)]
        assert summary == {
            "postprocess": {"text": text, "tokens": tokens, "elements": 0, "mean": None}
        }
        assert text  # the tiny model wrote something


def mixed_config(llm, dit, tally_options):
    ar = {"model": llm, "threads": 1}
    d = {"model": dit, "threads": 1}
    stages = [
        {"name": "intake", "kind": "ar.intake", "options": ar},
        {"name": "generate", "kind": "ar.generate", "options": ar},
        {"name": "postprocess", "kind": "ar.postprocess", "options": ar, "client_stream": True},
        {"name": "text", "kind": "ar.text_encode", "options": {**ar, "max_tokens": 16}},
        {"name": "plan", "kind": "dit.plan", "options": d},
        {"name": "sample", "kind": "dit.sample", "options": d},
        {"name": "vae", "kind": "dit.vae", "options": d, "client_stream": True},
        {**TALLY, "options": {**TALLY["options"], **tally_options}},
    ]
    chain = ["intake", "generate", "postprocess", "text", "plan", "sample", "vae", "tally"]
    edges = [{"from": a, "to": b} for a, b in zip(chain, chain[1:], strict=False)]
    edges.append({"from": "postprocess", "to": "tally", "window": {"size": 1}})  # fan-in
    return {"heartbeat_interval_s": 0.1, "stages": stages, "edges": edges}


def test_in_the_mixed_pipeline_it_counts_both_the_text_and_the_image(llm, dit):
    image = {"steps": 2, "width": 64, "height": 64}
    requests = [{"prompt": p, "max_tokens": 6, "image": image} for p in ("a red fox", "dusk")]
    with Pipeline(mixed_config(llm, dit, {})) as pipe:
        outs = [list(h) for h in [pipe.submit(r) for r in requests]]
    for events in outs:
        assert events[-1].event_type == "completed", events[-1]
        text = "".join(e.payload["text"] for e in of("postprocess", events))
        (decoded,) = [e.arrays["image"] for e in of("vae", events)]
        (summary,) = [e.payload["tally"] for e in of("tally", events)]
        assert summary["postprocess"]["text"] == text
        vae = summary["vae"]
        assert vae["elements"] == decoded.size == 64 * 64 * 3
        assert vae["mean"] == pytest.approx(float(np.asarray(decoded, np.float64).mean()))


def test_its_user_error_fails_its_request_alone_naming_the_option(llm, dit):
    image = {"steps": 2, "width": 64, "height": 64}
    with Pipeline(mixed_config(llm, dit, {"max_text_chars": 0})) as pipe:
        failed = pipe.generate([{"prompt": "a fox", "max_tokens": 4, "image": image}])[0]
        assert pipe.healthy and pipe.health()["tally"]["restarts"] == 0
    assert failed.finish_reason == "error"
    assert "'tally'" in failed.error and "options.max_text_chars" in failed.error
