"""M-RoPE models (Qwen2-VL, Qwen2.5-VL) through the media-free handoff on vLLM 0.32: tiny
random checkpoints, images of different sizes and aspect ratios (each its own grid), one,
two and four a request with text-only mixed in, against vLLM's own ``LLM.generate`` given
the images (in a process of its own).

Decode gives its vLLM each image as its patch grid alone (``image_grid_thw``): vLLM's own
M-RoPE code places the prompt's tokens from it and the request's delta, and no pixel, no
processed tensor and no vision tower is there. Runs where vLLM's Qwen2-VL imports
(``hatch run vllm-mm:test``), as ``test_vllm_mm.py``.
"""

import copy
import os

import pytest
from omni_ar.testing import require_vllm

require_vllm()

from omni_ar.errors import EngineRequestError  # noqa: E402
from omni_ar.handoff import MRope  # noqa: E402
from omni_ar.multimodal.mrope import grid_tokens, position_delta  # noqa: E402
from omni_ar.params import RequestError, SamplingParams  # noqa: E402
from omni_testing.events import events_of  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_environment")  # in-process engines below

BLOCK = 32  # vLLM's CPU attention
ENGINE_ARGS = {"block_size": BLOCK, "max_model_len": 256, "kv_cache_memory_bytes": 8 << 20}
# (width, height): landscape, portrait, a long strip, a square; each its own grid
SIZES = [(64, 48), (40, 72), (200, 30), (96, 96)]


def _url(seed, width, height):
    import base64

    from omni_ar.multimodal.testing import synthetic_image

    return (
        "data:image/png;base64," + base64.b64encode(synthetic_image(seed, width, height)).decode()
    )


IMAGES = [(_url(i, w, h),) for i, (w, h) in enumerate(SIZES)]


def _chat(*parts, max_tokens=14):
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p[0]}
        for p in parts
    ]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


REQUESTS = [
    _chat("the quick ", IMAGES[0], " fox"),
    _chat("two: ", IMAGES[1], " and ", IMAGES[2], " ok", max_tokens=17),
    _chat(*IMAGES, "four of them", max_tokens=12),
    {"messages": [{"role": "user", "content": "text only, no image"}], "max_tokens": 10},
    _chat(IMAGES[3], "a red fox in the snow", max_tokens=9),
]


@pytest.fixture(scope="module", params=["2", "2.5"], ids=lambda v: f"qwen{v}-vl")
def qwen(request, tmp_path_factory):
    from omni_ar.multimodal.testing import build_tiny_qwen2_vl

    try:
        import vllm.model_executor.models.qwen2_vl  # noqa: F401
    except ImportError as e:  # transformers' Qwen2-VL image processor needs torchvision
        if os.environ.get("OMNI_VLLM_MM"):
            pytest.fail(f"vLLM's Qwen2-VL does not import here: {e}", pytrace=False)
        pytest.skip(f"vLLM's Qwen2-VL does not import here ({e}): hatch run vllm-mm:test")
    path = tmp_path_factory.mktemp(f"qwen{request.param}-vllm")
    return str(build_tiny_qwen2_vl(path, version=request.param, for_vllm=True))


@pytest.fixture(scope="module")
def intake(qwen):
    """``ar.mm_intake`` on the model."""
    from omni_ar.multimodal.stages import MMIntake
    from omni_core.stage import StageContext

    stage = MMIntake(StageContext("intake", "ar.mm_intake", {"model": qwen}))
    stage.load()
    return stage


@pytest.fixture(scope="module")
def reference(qwen, intake, tmp_path_factory):
    """vLLM's own ``LLM.generate`` given each request's images, its prompt the chat
    template's text with one image marker per image, as ar.mm_intake renders it."""
    from omni_ar.multimodal.testing import chat_case, vllm_generate

    cases = [chat_case(intake.engine, r) for r in REQUESTS]
    out = vllm_generate(qwen, cases, ENGINE_ARGS, tmp_path_factory.mktemp("oracle"))
    assert len({tuple(t) for t in out}) == len(out)  # the images change the output
    return out


@pytest.fixture(scope="module")
def engines(qwen):
    """(prefill: KV producer with the vision tower, decode: media-free KV consumer)."""
    from omni_ar.multimodal.testing import vllm_handoff_engines

    return vllm_handoff_engines(qwen, ENGINE_ARGS)


def _input(request, ev=None, rid="r"):
    from omni_core import StageInput
    from omni_core.dataplane.windows import Piece, Window

    windows = {}
    if ev is not None:
        piece = Piece(0, ev.tokens, getattr(ev, "arrays", {}), ev.payload, logprobs=ev.logprobs)
        windows["up"] = Window("up", 0, 0, 0, [piece], True)
    return StageInput(rid, copy.deepcopy(request), windows, True, True)


@pytest.fixture(scope="module")
def prefilled(intake, engines):
    """Every request through ar.mm_intake and the prefill engine, in one batch:
    (ids, items, MMPrefilled, params) each."""
    from omni_ar.engines.vllm_mm import MMPrompt

    prompts, params = [], []
    for r in REQUESTS:
        (ev,) = intake.process([_input(r)])
        items = ev.payload["mm_items"]
        images = [ev.arrays[f"image_{i}"] for i in range(len(items))]
        prompts.append(MMPrompt(ev.tokens, items, images))
        params.append(SamplingParams(max_tokens=r["max_tokens"], temperature=0))
    done = list(engines[0].prefill_mm_many(prompts, params))
    assert not [d for d in done if isinstance(d, str)], done
    return [(p.ids, p.items, d, sp) for p, d, sp in zip(prompts, done, params, strict=True)]


def _continuation(items, done, mrope=None):
    from omni_ar.engines.vllm_mm import MMContinuation

    return MMContinuation(items, done.block_hashes, mrope=mrope or done.mrope)


def _decode(decode, ids, items, done, params, mrope=None):
    return decode.decode(
        done.first[0], done.keys, done.values, params, ids, mm=_continuation(items, done, mrope)
    )


def _drain(steps):
    return [t for t, _ in (s for s in steps if s is not None)]


# -- the engines --------------------------------------------------------------------------
def test_media_free_decode_equals_llm_generate_given_the_images(
    engines, prefilled, reference, monkeypatch
):
    """All five decoded at once (their deltas differ: -0 to some -50), each given only
    its items' grids: no image data reaches decode's vLLM."""
    _, decode = engines
    entered = []
    add = decode.engine.add_request
    monkeypatch.setattr(
        decode.engine,
        "add_request",
        lambda rid, p, *a, **k: entered.append(p) or add(rid, p, *a, **k),
    )
    streams = [_decode(decode, ids, items, d, sp) for ids, items, d, sp in prefilled]
    got = [[d.first[0], *_drain(s)] for (_, _, d, _), s in zip(prefilled, streams, strict=True)]
    assert got == reference
    for p, (_, items, _, _) in zip(entered, prefilled, strict=True):
        data = p["mm_kwargs"]["image"]
        assert len(data) == len(items)
        assert all(set(item) == {"image_grid_thw"} for item in data)  # no pixels, no embeds


def test_prefill_gives_vllms_grids_and_delta(engines, prefilled, intake):
    """The grids are vLLM's processor's (each image's own), in mm_items order, and the
    delta vLLM's M-RoPE gives equals the handoff's rule (:mod:`omni_ar.multimodal.mrope`)
    that decode's admission checks."""
    merge = engines[0].merge
    assert merge == engines[1].merge == 2
    for _, items, done, _ in prefilled:
        m = done.mrope
        assert isinstance(m, MRope) and len(m.grids) == len(items)
        assert [grid_tokens(g, merge) for g in m.grids] == [it["length"] for it in items]
        spans = [(it["offset"], it["length"]) for it in items]
        assert m.position_delta == position_delta(spans, m.grids, merge)
        sizes = [intake.engine.grid((h, w)) for w, h in SIZES]
        assert all(g in sizes for g in m.grids)
    assert len({tuple(g) for g in prefilled[2][2].mrope.grids}) == 4
    assert prefilled[3][2].mrope == MRope(position_delta=0, grids=[])  # text only


def test_decode_builds_no_vision_tower(engines):
    def names(engine):
        ((names,),) = engine.llm.apply_model(lambda m: [[n for n, _ in m.named_parameters()]])
        return names

    prefill, decode = names(engines[0]), names(engines[1])
    assert any(n.startswith("visual.") for n in prefill)
    assert {n.split(".")[0] for n in decode} == {"language_model"}


def test_the_grids_place_the_tokens(engines, prefilled, reference):
    """Decode places the tokens by the grids it is given: a grid of the same
    placeholder count but another shape, with the delta it gives, passes every check
    and gives other tokens (so a right delta is what makes decode right; a wrong pair
    agreeing with each other is beyond what a media-free decode can tell)."""
    _, decode = engines
    ids, items, done, params = prefilled[1]
    (g0, g1) = done.mrope.grids
    n = grid_tokens(g1, 2)  # as many placeholders, another longest side
    other = next(
        [1, 2 * a, 2 * (n // a)]
        for a in range(1, n + 1)
        if not n % a and 2 * max(a, n // a) != max(g1)
    )
    assert grid_tokens(other, 2) == grid_tokens(g1, 2) and max(other) != max(g1)
    spans = [(it["offset"], it["length"]) for it in items]
    mrope = MRope(position_delta=position_delta(spans, [g0, other], 2), grids=[g0, other])
    assert decode.llm.reset_prefix_cache()
    got = [done.first[0], *_drain(_decode(decode, ids, items, done, params, mrope))]
    assert got != reference[1]
    assert [done.first[0], *_drain(_decode(decode, ids, items, done, params))] == reference[1]


def test_each_altered_position_field_fails_only_that_request(engines, prefilled, reference):
    """The engine's own check, below the stage's admission (a caller of ``decode``): an
    altered delta or grid is refused as the request enters, naming the field; a request
    in flight beside it goes on."""
    _, decode = engines
    ids, items, done, params = prefilled[1]
    m = done.mrope
    (g0, g1) = m.grids
    cases = {
        f"mrope.position_delta: prefill sent {m.position_delta + 1}; vLLM's M-RoPE gives "
        f"{m.position_delta}": MRope(position_delta=m.position_delta + 1, grids=m.grids),
        "mrope.grids: 1 grids for 2 mm items": MRope(position_delta=m.position_delta, grids=[g0]),
        f"mrope.grids[1]: grid [1, {g1[1] + 2}, {g1[2]}] makes": MRope(
            position_delta=m.position_delta, grids=[g0, [1, g1[1] + 2, g1[2]]]
        ),
        f"mrope.grids[0]: grid [2, {g0[1]}, {g0[2]}] makes": MRope(
            position_delta=m.position_delta, grids=[[2, *g0[1:]], g1]
        ),
        # as many placeholders, but two frames: vLLM's own code refuses it
        "mrope.grids: vLLM cannot place [[2, ": MRope(
            position_delta=m.position_delta, grids=[[2, g0[1] // 2, g0[2]], g1]
        ),
    }
    assert g0[1] % 4 == 0
    good = _decode(decode, ids, items, done, params)
    try:
        first = next(s for s in good if s is not None)  # in flight
        for needle, bad in cases.items():
            with pytest.raises(RequestError) as e:
                _decode(decode, ids, items, done, params, bad)
            assert needle in str(e.value)
        from omni_ar.engines.vllm_mm import MMContinuation

        with pytest.raises(RequestError, match="mrope: missing"):
            decode.decode(
                done.first[0], done.keys, done.values, params, ids,
                mm=MMContinuation(items, done.block_hashes),
            )  # fmt: skip
        assert [done.first[0], first[0], *_drain(good)] == reference[1]
    finally:
        good.close()
    from omni_ar.engines.vllm_requires_kv import CONNECTOR_NOTES, FAILURES

    assert not FAILURES and not CONNECTOR_NOTES


def test_a_kv_short_of_the_images_still_fails_closed(engines, prefilled):
    """The requires_kv plugin on an M-RoPE model: the KV's first block alone stops short
    of the images, and the request ends without running an encoder."""
    _, decode = engines
    ids, items, done, params = prefilled[2]
    end = max(it["offset"] + it["length"] for it in items)
    assert decode.llm.reset_prefix_cache()
    steps = decode.decode(
        done.first[0], done.keys[:, :1], done.values[:, :1], params, ids,
        mm=_continuation(items, done),
    )  # fmt: skip
    with pytest.raises(EngineRequestError, match=f"KV covers {BLOCK} .* end at {end}"):
        _drain(steps)


# -- the stages -------------------------------------------------------------------------------
def _config(model, media="none"):
    engine = {"model": model, "engine": "vllm", "engine_args": ENGINE_ARGS}
    reprocess = media == "reprocess"
    return {
        "mrs": {"enabled": False},
        "stages": [
            {"name": "intake", "kind": "ar.mm_intake", "options": {"model": model}},
            {
                "name": "prefill",
                "kind": "ar.mm_prefill",
                "max_batch_size": 5,
                "client_stream": True,
                "options": {**engine, "forward_media": reprocess},
            },
            {
                "name": "decode",
                "kind": "ar.mm_decode",
                "max_inflight": 5,
                "options": {**engine, "media": media},
            },
            {"name": "postprocess", "kind": "ar.mm_postprocess", "options": {"model": model}},
        ],
        "edges": [
            {"from": "intake", "to": "prefill"},
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "postprocess", "window": {"size": 1}},
        ],
    }


@pytest.mark.parametrize("media", ["none", "reprocess"], ids=["handoff", "full-media-baseline"])
def test_stages_inline_equal_llm_generate_and_decode_gets_no_image_data(qwen, reference, media):
    """Inline (one process); the full-media baseline (``media: reprocess``) too, whose
    decode renders the prompt from the images again and gives them to its vLLM."""
    from omni_ar.multimodal.media import has_media
    from omni_core import Pipeline

    with Pipeline(_config(qwen, media)) as pipe:
        outs = pipe.generate(copy.deepcopy(REQUESTS))
    for out, expected in zip(outs, reference, strict=True):
        assert out.ok, out.error
        assert [t for e in out.by_stage("postprocess") for t in e.tokens] == expected
        (sent,) = out.by_stage("prefill")
        assert sorted(sent.arrays) == ["keys", "values"]
        h = sent.payload["handoff"]
        assert all(sorted(it) == ["hash", "length", "offset"] for it in h["mm_items"])
        assert sorted(h["mrope"]) == ["grids", "position_delta"]
        assert len(h["mrope"]["grids"]) == len(h["mm_items"])
        assert has_media(sent.request["messages"]) == (media == "reprocess" and bool(h["mm_items"]))


@pytest.fixture(scope="module")
def decode_stage(qwen):
    from omni_ar.multimodal.stages import MMDecode, MMPrefill
    from omni_core.stage import StageContext

    options = {"model": qwen, "engine": "vllm", "engine_args": ENGINE_ARGS}
    out = []
    for cls, kind in ((MMPrefill, "ar.mm_prefill"), (MMDecode, "ar.mm_decode")):
        stage = cls(StageContext(kind, kind, options))
        stage.load()
        out.append(stage)
    return out


def test_decode_stage_fails_an_altered_position_field_alone(intake, decode_stage, reference):
    """A batch of the good request and one altered copy at a time: the copy fails in
    decode's admission, naming the field; the good one gets LLM.generate's tokens."""
    prefill, decode = decode_stage
    (ev,) = intake.process([_input(REQUESTS[1])])
    inp = _input(REQUESTS[1], ev)
    (sent,) = prefill.process([inp])
    forwarded = inp.request
    m = sent.payload["handoff"]["mrope"]
    (g0, g1), d = m["grids"], m["position_delta"]

    def altered(**fields):
        ev = copy.copy(sent)
        ev.payload = copy.deepcopy(sent.payload)
        if fields.pop("drop", False):
            del ev.payload["handoff"]["mrope"]
        else:
            ev.payload["handoff"]["mrope"].update(fields)
        return ev

    cases = {
        "mrope: missing": altered(drop=True),
        f"mrope.position_delta: prefill sent {d + 1}": altered(position_delta=d + 1),
        "mrope.grids: 1 grids for 2 mm items": altered(grids=[g0]),
        "mrope.grids[1]: grid (1, ": altered(grids=[g0, [1, g1[1] + 2, g1[2]]]),
        "mrope.grids[0]: [2, ": altered(grids=[[2, *g0[1:]], g1]),
        "at `$.mrope.position_delta`": altered(position_delta="3"),
    }
    for needle, bad in cases.items():
        inputs = [_input(forwarded, bad, "bad"), _input(forwarded, sent, "good")]
        evs = events_of(decode.process(inputs))
        errors = [e for e in evs if e.event_type == "error"]
        assert [e.request_id for e in errors] == ["bad"], (needle, errors)
        assert errors[0].message.startswith("requires_kv admission: "), errors[0].message
        assert needle in errors[0].message, (needle, errors[0].message)
        good = [t for e in evs if e.request_id == "good" for t in (e.tokens or [])]
        assert good == reference[1]
