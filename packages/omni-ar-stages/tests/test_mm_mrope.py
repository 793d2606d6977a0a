"""M-RoPE models through the requires_kv handoff on the transformers engine: tiny random
Qwen2-VL and Qwen2.5-VL (dynamic resolution: images of different sizes and aspect ratios,
several a request), against the model's own ``generate`` given the images."""

import base64
import copy

import numpy as np
import pytest
import torch
from omni_ar.handoff import MRope
from omni_ar.multimodal.handoff import AdmissionError, check_mrope
from omni_ar.multimodal.media import decode_image, flatten, image_parts, source_bytes
from omni_ar.multimodal.mrope import grid_tokens, position_delta
from omni_ar.multimodal.stages import MMDecode, MMIntake, MMPrefill
from omni_ar.multimodal.testing import build_tiny_qwen2_vl, synthetic_image
from omni_ar.params import SamplingParams
from omni_core import Pipeline, StageInput
from omni_core.dataplane.windows import Piece, Window
from omni_core.stage import StageContext
from omni_testing.events import events_of

VERSIONS = ["2", "2.5"]
# (width, height): landscape, portrait, a long strip, a square; each its own grid
SIZES = [(64, 48), (40, 72), (200, 30), (96, 96)]


@pytest.fixture(scope="module", params=VERSIONS, ids=lambda v: f"qwen{v}-vl")
def qwen(request, tmp_path_factory):
    return str(build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen"), version=request.param))


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


IMAGES = [_url(synthetic_image(i, w, h)) for i, (w, h) in enumerate(SIZES)]


def chat(*parts, max_tokens=14):
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p[0]}
        for p in parts
    ]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


REQUESTS = [
    chat("the quick ", (IMAGES[0],), " fox"),
    chat("two: ", (IMAGES[1],), " and ", (IMAGES[2],), " ok", max_tokens=17),
    chat(*[(u,) for u in IMAGES], "four of them", max_tokens=12),
    {"messages": [{"role": "user", "content": "text only, no image"}], "max_tokens": 10},
    chat((IMAGES[3],), "a red fox in the snow", max_tokens=9),
]


def reference_tokens(model_dir: str, requests: list[dict]) -> list[list[int]]:
    """Greedy tokens of the whole model in this process through transformers' own
    image processor and ``generate``: each image marker expanded by the grid the
    processor gives it, as Qwen2-VL's processor does."""
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    images = AutoImageProcessor.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = config.image_token_id
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    out = []
    for r in requests:
        msgs = r["messages"]
        ids = tok.encode(
            tok.apply_chat_template(
                flatten(msgs, marker), add_generation_prompt=True, tokenize=False
            )
        )
        pixels = [decode_image(source_bytes(p, "x"), "x", 10**9) for _, p in image_parts(msgs)]
        kwargs = {}
        if pixels:
            inputs = images(images=pixels, return_tensors="pt", input_data_format="channels_last")
            grids = iter(inputs["image_grid_thw"].tolist())
            ids = [
                u for t in ids for u in ([t] * (grid_tokens(next(grids), 2)) if t == pad else [t])
            ]
            kwargs = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}
        ii = torch.tensor([ids])
        with torch.inference_mode():
            gen = model.generate(
                input_ids=ii,
                mm_token_type_ids=(ii == pad).int(),
                max_new_tokens=r["max_tokens"],
                do_sample=False,
                **kwargs,
            )
        out.append(gen[0, len(ids) :].tolist())
    assert len({tuple(g) for g in out}) == len(out)
    return out


@pytest.fixture(scope="module")
def reference(qwen):
    return reference_tokens(qwen, REQUESTS)


def mm_config(model, enabled=True, prefill=None):
    opts = {"model": model, "threads": 1}
    return {
        "mrs": {"enabled": enabled},
        "heartbeat_interval_s": 0.1,
        "stages": [
            {"name": "intake", "kind": "ar.mm_intake", "options": {"model": model}},
            {"name": "prefill", "kind": "ar.mm_prefill", "options": {**opts, **(prefill or {})}},
            {"name": "decode", "kind": "ar.mm_decode", "options": opts},
        ],
        "edges": [{"from": "intake", "to": "prefill"}, {"from": "prefill", "to": "decode"}],
    }


def tokens_of(out):
    assert out.ok, out.error
    return [t for e in out.by_stage("decode") for t in e.tokens]


@pytest.mark.parametrize("enabled", [True, False], ids=["processes", "inline"])
def test_handoff_tokens_equal_the_model_with_the_images(qwen, reference, enabled):
    """One, two and four images of different sizes, text-only mixed in, in one run."""
    cfg = mm_config(qwen, enabled, prefill={"prefix_cache_blocks": 0})
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(copy.deepcopy(REQUESTS))
    assert [tokens_of(o) for o in outs] == reference


# -- the stages driven directly --------------------------------------------------------------


@pytest.fixture(scope="module")
def stages(qwen):
    def load(cls, kind, **options):
        stage = cls(StageContext("s", kind, {"model": qwen, **options}))
        stage.load()
        return stage

    return (
        load(MMIntake, "ar.mm_intake"),
        load(MMPrefill, "ar.mm_prefill", prefix_cache_blocks=0),
        load(MMDecode, "ar.mm_decode"),
    )


def _input(request, ev=None, rid="r"):
    windows = {}
    if ev is not None:
        piece = Piece(0, ev.tokens, getattr(ev, "arrays", {}), ev.payload)
        windows["up"] = Window("up", 0, 0, 0, [piece], True)
    return StageInput(rid, copy.deepcopy(request), windows, True, True)


def _handoff(stages, request):
    """(prefill's event, the request prefill forwards)."""
    intake, prefill, _ = stages
    (ev,) = intake.process([_input(request)])
    inp = _input(request, ev)
    (out,) = prefill.process([inp])
    return out, inp.request


def _with_mrope(ev, **fields):
    new = copy.copy(ev)
    new.payload = copy.deepcopy(ev.payload)
    if fields.get("drop"):
        new.payload["handoff"].pop("mrope")
    else:
        new.payload["handoff"]["mrope"].update(fields)
    return new


def test_decode_gets_no_image_data_only_ids_hashes_spans_kv_and_positions(stages, reference):
    ev, forwarded = _handoff(stages, REQUESTS[2])
    h = ev.payload["handoff"]
    assert set(ev.arrays) == {"keys", "values"}
    assert [p for _, p in image_parts(forwarded["messages"])] == [
        {"type": "image", "hash": it["hash"]} for it in h["mm_items"]
    ]
    assert set(h) == {
        "requires_kv",
        "prompt_token_ids",
        "block_size",
        "mm_items",
        "kv_block_hashes",
        "mrope",
    }
    assert all(set(it) == {"hash", "offset", "length"} for it in h["mm_items"])
    mrope = h["mrope"]
    assert set(mrope) == {"position_delta", "grids"}
    # dynamic resolution: four images, four grids, each its own shape
    assert len({tuple(g) for g in mrope["grids"]}) == 4
    assert [grid_tokens(g, 2) for g in mrope["grids"]] == [it["length"] for it in h["mm_items"]]
    assert mrope["position_delta"] < 0  # positions advance less than the placeholders
    evs = events_of(stages[2].process([_input(forwarded, ev)]))
    assert [t for e in evs for t in e.tokens] == reference[2]


def test_the_position_delta_is_what_makes_decode_right(stages, reference):
    """The same KV continued at the prompt's own indices (no delta) gives other tokens:
    the delta is not decoration."""
    ev, _ = _handoff(stages, REQUESTS[1])
    h, a = ev.payload["handoff"], ev.arrays
    engine = stages[2].engine
    ids, n = h["prompt_token_ids"], len(h["prompt_token_ids"]) - 1
    params = SamplingParams(max_tokens=REQUESTS[1]["max_tokens"])
    right = MRope(position_delta=h["mrope"]["position_delta"], grids=h["mrope"]["grids"])
    wrong = MRope(position_delta=0, grids=h["mrope"]["grids"])
    got = [t for t, _ in engine.resume(ids, a["keys"], a["values"], n, params, right)]
    assert got == reference[1]
    assert [t for t, _ in engine.resume(ids, a["keys"], a["values"], n, params, wrong)] != got


def test_requests_resumed_together_decode_in_one_batch_each_at_its_own_positions(stages, reference):
    """Every request resumed at once joins the engine's decode batch: one forward per
    step for all of them (not one each), and each still gets its reference tokens, its
    own position delta applied to its row (the text-only request has none)."""
    engine = stages[2].engine
    forwards = []  # the language model's forwards, one a step of the batch
    hook = engine.model.register_forward_hook(lambda *_: forwards.append(1))
    streams = []
    for r in REQUESTS:
        ev, _ = _handoff(stages, r)
        h, a = ev.payload["handoff"], ev.arrays
        ids = h["prompt_token_ids"]
        m = h.get("mrope")
        mrope = MRope(position_delta=m["position_delta"], grids=m["grids"]) if m else None
        params = SamplingParams(max_tokens=r["max_tokens"])
        streams.append(engine.resume(ids, a["keys"], a["values"], len(ids) - 1, params, mrope))
    outs = [[next(s)[0]] for s in streams]
    before = engine.batch.forwards
    active = list(range(len(streams)))
    while active:  # in turn, as the decode stage drives its requests
        for i in list(active):
            try:
                outs[i].append(next(streams[i])[0])
            except StopIteration:
                active.remove(i)
    hook.remove()
    assert outs == reference
    steps = engine.batch.forwards - before
    assert steps == max(len(t) for t in reference) - 1 < sum(len(t) - 1 for t in reference)
    # the first tokens too: one step for all of them, no forward of its own for any
    assert len(forwards) == max(len(t) for t in reference)
    assert not engine.batch.requests  # every one left the batch


def test_a_seed_gives_the_same_tokens_whether_the_first_is_picked_in_the_batch_or_alone(
    stages,
):
    """Resumed at the prompt's last token, the first token is picked by the batch's
    step; resumed one token earlier, by a forward of the request's own: with the same
    seed both pick the same tokens (the first with the request's first generator, the
    rest with the next)."""
    ev, _ = _handoff(stages, REQUESTS[1])
    h, a = ev.payload["handoff"], ev.arrays
    engine = stages[2].engine
    ids = h["prompt_token_ids"]
    mrope = MRope(position_delta=h["mrope"]["position_delta"], grids=h["mrope"]["grids"])
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    forwards = engine.batch.forwards
    in_batch = [
        t for t, _ in engine.resume(ids, a["keys"], a["values"], len(ids) - 1, params, mrope)
    ]
    assert engine.batch.forwards - forwards == 6  # every token from the batch's steps
    alone = [t for t, _ in engine.resume(ids, a["keys"], a["values"], len(ids) - 2, params, mrope)]
    assert in_batch == alone and len(in_batch) == 6
    other = SamplingParams(max_tokens=6, temperature=1.0, seed=8)
    assert [
        t for t, _ in engine.resume(ids, a["keys"], a["values"], len(ids) - 1, other, mrope)
    ] != in_batch


def test_each_altered_position_field_fails_only_its_request(stages, reference):
    """A batch of the good request and one altered copy at a time: the copy fails with
    the field named, the good one is served."""
    ev, forwarded = _handoff(stages, REQUESTS[1])
    m = ev.payload["handoff"]["mrope"]
    g0, g1 = m["grids"]
    d = m["position_delta"]
    swapped = [1, g0[2], g0[1]] if g0[1] != g0[2] else [1, g0[1] * 2, g0[2] // 2]
    cases = {
        "mrope: missing": _with_mrope(ev, drop=True),
        f"mrope.position_delta: prefill sent {d + 1}; mrope.grids": _with_mrope(
            ev, position_delta=d + 1
        ),
        "mrope.grids: 1 grids for 2 mm items": _with_mrope(ev, grids=[g0]),
        "mrope.grids[1]: grid (1, ": _with_mrope(ev, grids=[g0, [1, g1[1] + 2, g1[2]]]),
        "mrope.grids[0]: [2, ": _with_mrope(ev, grids=[[2, *g0[1:]], g1]),
        "mrope.grids[1]: [1, 4] is not": _with_mrope(ev, grids=[g0, [1, 4]]),
        "handoff: Expected `int`, got `str` - at `$.mrope.position_delta`": _with_mrope(
            ev, position_delta="3"
        ),
        "handoff: Object contains unknown field `pixels` - at `$.mrope`": _with_mrope(
            ev, pixels=[1, 2]
        ),
    }
    if swapped != g0 and max(swapped[1:]) != max(g0[1:]):
        cases["mrope.position_delta: prefill sent"] = _with_mrope(ev, grids=[swapped, g1])
    decode = stages[2]
    for expected, bad in cases.items():
        inputs = [_input(forwarded, bad, "bad"), _input(forwarded, ev, "good")]
        evs = events_of(decode.process(inputs))
        errors = [e for e in evs if e.event_type == "error"]
        assert [e.request_id for e in errors] == ["bad"], (expected, errors)
        assert errors[0].message.startswith("requires_kv admission: "), errors[0].message
        assert expected in errors[0].message, (expected, errors[0].message)
        good = [t for e in evs if e.request_id == "good" for t in (e.tokens or [])]
        assert good == reference[1]


def test_check_mrope_on_a_model_without_m_rope():
    from omni_ar.handoff import MMHandoff

    h = MMHandoff(
        requires_kv=True,
        prompt_token_ids=[1, 2, 3],
        block_size=16,
        mm_items=[],
        kv_block_hashes=[],
        mrope=MRope(position_delta=0, grids=[]),
    )
    with pytest.raises(AdmissionError, match="this decode's model has no M-RoPE"):
        check_mrope(h, None)
    check_mrope(h, 2)  # no items, no grids, delta 0: a text-only prompt on an M-RoPE model


@pytest.mark.parametrize(
    ("spans", "grids", "delta"),
    [
        ([], [], 0),
        ([(3, 12)], [[1, 6, 8]], 4 - 12),
        ([(1, 8), (12, 24)], [[1, 8, 4], [1, 4, 24]], (4 - 8) + (12 - 24)),
        ([(0, 4)], [[1, 4, 4]], 2 - 4),
    ],
)
def test_position_delta_matches_the_models_own_rope_index(stages, spans, grids, delta):
    """The rule decode checks with equals transformers' ``get_rope_index``, which prefill
    gives the positions with."""
    assert position_delta(spans, grids, 2) == delta
    prefill = stages[1].engine
    n = (spans[-1][0] + spans[-1][1] if spans else 0) + 5
    ids = [7] * n
    for off, length in spans:
        ids[off : off + length] = [prefill.placeholder_id] * length
    positions, got = prefill.rope_positions(ids, grids)
    assert got == delta
    assert positions[0, 0, -1].item() == n - 1 + delta  # text after the images: index + delta


def test_prefix_cache_resumes_mid_prompt_at_the_right_positions(qwen, reference):
    """A repeated image + prefix is served from prefill's prefix cache: the rest of the
    prompt is computed at positions from the whole prompt's grids, and the tokens are
    the model's own."""
    cfg = mm_config(qwen, enabled=False, prefill={"prefix_cache_blocks": 64})
    cfg["stages"][1]["client_stream"] = True
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(copy.deepcopy([REQUESTS[2], REQUESTS[2], REQUESTS[1]]))
    cached = [o.by_stage("prefill")[0].payload["cached_tokens"] for o in outs]
    assert cached[0] == 0 and cached[1] > 0
    assert [tokens_of(o) for o in outs] == [reference[2], reference[2], reference[1]]


def test_video_parts_are_refused_naming_why(stages):
    request = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what happens"},
                    {"type": "video", "video": [_url(synthetic_image(i)) for i in range(4)]},
                ],
            }
        ],
        "max_tokens": 4,
    }
    (ev,) = stages[0].process([_input(request)])
    assert ev.event_type == "error"
    assert "field 'messages[0].content[1]': video" in ev.message, ev.message


def test_intake_counts_placeholders_as_the_image_processor_grids_them(stages):
    """encode_mm's spans come from the image processor's resize rule alone (no pixels
    processed): each equals the placeholders the processor's own output grid makes."""
    intake = stages[0]
    pixels = [np.zeros((h, w, 3), np.uint8) for w, h in [*SIZES, (1000, 17), (17, 17)]]
    out = intake.engine.image_processor(
        images=pixels, return_tensors="pt", input_data_format="channels_last"
    )
    want = [grid_tokens(g, 2) for g in out["image_grid_thw"].tolist()]
    assert [intake.engine.grid(p.shape[:2]) for p in pixels] == out["image_grid_thw"].tolist()
    msgs = [{"role": "user", "content": [{"type": "image", "image": "x"}] * len(pixels)}]
    _, spans = intake.engine.encode_mm(msgs, [p.shape[:2] for p in pixels])
    assert [n for _, n in spans] == want


def test_the_full_media_baseline_places_positions_from_the_media_itself(qwen, reference):
    """``media: reprocess`` (the bench's baseline): decode renders the prompt and its
    M-RoPE fields from the images it gets, and gives the same tokens."""
    cfg = mm_config(qwen, enabled=False, prefill={"prefix_cache_blocks": 0, "forward_media": True})
    cfg["stages"][2]["options"]["media"] = "reprocess"
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(copy.deepcopy(REQUESTS[:3]))
    assert [tokens_of(o) for o in outs] == reference[:3]


def test_a_prefix_cache_hit_never_splits_an_image_next_to_another(stages):
    """Two images a few tokens apart: the cache hit ends inside the second, whose block
    starts inside the first, so the start moves back before both (it moved back only
    before the second, leaving the first's last placeholders without their pixels)."""
    from omni_ar.multimodal.handoff import PrefixCache
    from omni_ar.multimodal.stages import _items

    engine = stages[1].engine
    pad = engine.placeholder_id
    a = decode_image(source_bytes({"type": "image", "image": IMAGES[1]}, "x"), "x", 10**9)
    b = decode_image(source_bytes({"type": "image", "image": IMAGES[0]}, "x"), "x", 10**9)
    la, lb = (grid_tokens(engine.grid(p.shape[:2]), 2) for p in (a, b))  # 8 and 12
    # image a at [12, 20), image b at [22, 34): the tail after b shares block [32, 48)
    head = [60] * 12 + [pad] * la + [61, 62] + [pad] * lb
    spans = [(12, la), (12 + la + 2, lb)]
    items = _items([a, b], spans)
    cache = PrefixCache(64)
    engine.prefill_kv([*head, 63, 64, 65, 66], items, [a, b], 16, cache)
    ids = [*head, 67, 68, 69]  # another tail: blocks [0, 16) and [16, 32) hit
    keys, values, cached, _ = engine.prefill_kv(ids, items, [a, b], 16, cache)
    # the hit [0, 32) ends inside b, whose first block [16, 32) a overlaps: from 0
    assert cached == 0
    cold_keys, _, _, _ = engine.prefill_kv(ids, items, [a, b], 16, None)
    assert np.allclose(keys, cold_keys, atol=1e-5)
