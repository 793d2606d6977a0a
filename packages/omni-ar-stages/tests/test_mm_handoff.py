"""The multimodal requires_kv handoff on a tiny random Llava, against the model in one
process with the full media."""

import base64
import copy
import io
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from omni_ar.multimodal.handoff import admit, block_hashes
from omni_ar.multimodal.stages import MMDecode, MMIntake, MMPrefill
from omni_ar.multimodal.testing import build_tiny_llava, png_bomb, synthetic_image
from omni_ar.params import RequestError, parse_request
from omni_core import Pipeline, StageInput
from omni_core.dataplane.windows import Piece, Window
from omni_core.stage import StageContext
from omni_testing.events import events_of
from omni_testing.faults import kill_stage, wait_ready
from PIL import Image


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava")))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Four different images: as a PNG file path, JPEG bytes, a PNG data URL, and the
    same pixels as the first in another container (BMP bytes)."""
    d = tmp_path_factory.mktemp("images")
    png0 = synthetic_image(0, 64, 48)
    (d / "a.png").write_bytes(png0)
    bmp0 = io.BytesIO()
    Image.open(io.BytesIO(png0)).save(bmp0, format="BMP")
    url = "data:image/png;base64," + base64.b64encode(synthetic_image(2, 40, 72)).decode()
    return {
        "path": str(d / "a.png"),
        "jpeg": synthetic_image(1, 120, 90, fmt="JPEG"),
        "url": url,
        "bmp_of_path": bmp0.getvalue(),
        "other": synthetic_image(3, 64, 48),
    }


def chat(*parts, max_tokens=20):
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p[0]}
        for p in parts
    ]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def img(source):
    return (source,)


@pytest.fixture(scope="module")
def requests(images):
    return [
        chat("the quick ", img(images["path"]), " fox", max_tokens=24),
        chat(img(images["jpeg"]), "a red fox in the snow", max_tokens=17),
        chat("two: ", img(images["url"]), " and ", img(images["jpeg"]), " ok", max_tokens=30),
        {
            "messages": [
                {"role": "system", "content": "omni pipelines"},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": images["url"]}},
                        {"type": "text", "text": "héllo"},
                        {"type": "image", "image": images["path"]},
                        {"type": "image", "image": images["other"]},
                    ],
                },
            ],
            "max_tokens": 20,
        },
        {"messages": [{"role": "user", "content": "stream tokens"}], "max_tokens": 12},
    ]


def _pil(part):
    from omni_ar.multimodal.media import decode_image, source_bytes

    return Image.fromarray(decode_image(source_bytes(part, "x", allow_local=True), "x", 10**9))


@pytest.fixture(scope="module")
def reference(llava, requests):
    """Greedy tokens of the whole model in this process, with the full media, through
    transformers' own processor and ``generate``."""
    from omni_ar.multimodal.media import flatten, image_parts
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    proc = AutoProcessor.from_pretrained(llava)
    model = LlavaForConditionalGeneration.from_pretrained(llava).eval()
    out = []
    for r in requests:
        msgs = r["messages"]
        text = proc.tokenizer.apply_chat_template(
            flatten(msgs, proc.image_token), add_generation_prompt=True, tokenize=False
        )
        pil = [_pil(part) for _, part in image_parts(msgs)] or None
        inputs = proc(text=text, images=pil, return_tensors="pt")
        with torch.inference_mode():
            gen = model.generate(**inputs, max_new_tokens=r["max_tokens"], do_sample=False)
        out.append(gen[0, inputs["input_ids"].shape[1] :].tolist())
    assert len({tuple(g) for g in out}) == len(out) and all(len(set(g)) > 3 for g in out)
    return proc.tokenizer, out


LOCAL = {"allow_local_images": True}  # the requests here name image files by path


def mm_config(model, enabled=True, prefill=None, decode=None, decode_stage=None):
    opts = {"model": model, "threads": 1}
    return {
        "mrs": {"enabled": enabled},
        "heartbeat_interval_s": 0.1,
        "stages": [
            {"name": "intake", "kind": "ar.mm_intake", "options": {"model": model, **LOCAL}},
            {"name": "prefill", "kind": "ar.mm_prefill", "options": {**opts, **(prefill or {})}},
            {
                "name": "decode",
                "kind": "ar.mm_decode",
                **(decode_stage or {}),
                "options": {**opts, **LOCAL, **(decode or {})},
            },
            {"name": "postprocess", "kind": "ar.mm_postprocess", "options": {"model": model}},
        ],
        "edges": [
            {"from": "intake", "to": "prefill"},
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "postprocess", "window": {"size": 1}},
        ],
    }


def text_and_tokens(out):
    segs = out.by_stage("postprocess")
    return "".join(e.payload["text"] for e in segs), [t for e in segs for t in e.tokens]


@pytest.fixture(scope="module")
def pipe(llava):
    """The handoff pipeline in worker processes (no prefix cache: every prefill from
    scratch, as the one-process reference runs)."""
    cfg = mm_config(
        llava, prefill={"prefix_cache_blocks": 0}, decode_stage={"restart_backoff_s": 0.1}
    )
    with Pipeline(cfg) as p:
        yield p


@pytest.mark.parametrize("enabled", [True, False], ids=["processes", "inline"])
def test_handoff_tokens_equal_the_model_with_full_media(llava, pipe, requests, reference, enabled):
    tok, expected = reference
    if enabled:
        outs = pipe.generate(copy.deepcopy(requests))
    else:
        with Pipeline(mm_config(llava, False, prefill={"prefix_cache_blocks": 0})) as inline:
            outs = inline.generate(copy.deepcopy(requests))
    for out, exp in zip(outs, expected, strict=True):
        assert out.ok, out.error
        text, tokens = text_and_tokens(out)
        assert tokens == exp
        assert text == tok.decode(exp, skip_special_tokens=True)


# -- the stages driven directly: one real request, then each bad case ----------------------


def _stage(cls, kind, model, **options):
    stage = cls(StageContext("s", kind, {"model": model, **options}))
    stage.load()
    return stage


@pytest.fixture(scope="module")
def stages(llava):
    return (
        _stage(MMIntake, "ar.mm_intake", llava, **LOCAL),
        _stage(MMPrefill, "ar.mm_prefill", llava),
        _stage(MMDecode, "ar.mm_decode", llava, **LOCAL),
    )


def _feed(stage, request, ev=None, edge="up"):
    """Run one stage on one request (a copy, as each stage gets off the wire) and the
    event of its upstream stage; returns (the events, the request as it forwards it)."""
    request = copy.deepcopy(request)
    windows = {}
    if ev is not None:
        piece = Piece(0, ev.tokens, getattr(ev, "arrays", {}), ev.payload)
        windows[edge] = Window(edge, 0, 0, 0, [piece], True)
    return events_of(stage.process([StageInput("r", request, windows, True, True)])), request


def _handoff(stages, request):
    """(prefill's event, the request prefill forwards)."""
    intake, prefill, _ = stages
    (ev,), _ = _feed(intake, request)
    assert ev.event_type == "segment", ev
    (out,), forwarded = _feed(prefill, request, ev)
    return out, forwarded


def _decoded(decode, request, ev):
    evs, _ = _feed(decode, request, ev)
    return evs


def _with(ev, payload=None, arrays=None):
    new = copy.copy(ev)
    new.payload = payload if payload is not None else copy.deepcopy(ev.payload)
    new.arrays = arrays if arrays is not None else dict(ev.arrays)
    return new


def _errors(evs):
    return [e.message for e in evs if e.event_type == "error"]


def test_prompt_logprobs_are_refused_where_a_request_enters_the_mm_stages(stages, requests):
    """A prompt of images has no token logprobs to give: the intake fails that request
    naming the field; the same request without them passes."""
    intake = stages[0]
    (ev,), _ = _feed(intake, {**requests[1], "prompt_logprobs": 1})
    assert ev.event_type == "error" and "field 'prompt_logprobs'" in ev.message, ev
    (ok,), _ = _feed(intake, requests[1])
    assert ok.event_type == "segment"


def test_prefill_forwards_no_media_and_decode_continues(stages, requests, reference):
    ev, forwarded = _handoff(stages, requests[2])
    parts = forwarded["messages"][0]["content"]
    assert [p for p in parts if p["type"] == "image"] == [
        {"type": "image", "hash": it["hash"]} for it in ev.payload["handoff"]["mm_items"]
    ]
    assert set(ev.arrays) == {"keys", "values"}
    handoff = ev.payload["handoff"]
    assert handoff["requires_kv"] is True and set(handoff["mm_items"][0]) == {
        "hash",
        "offset",
        "length",
    }
    evs = _decoded(stages[2], forwarded, ev)
    assert [t for e in evs for t in e.tokens] == reference[1][2]


def _bad_cases(ev, forwarded, images):
    h = ev.payload["handoff"]
    n = len(h["prompt_token_ids"])
    it0 = h["mm_items"][0]
    keys, values = ev.arrays["keys"], ev.arrays["values"]

    def item(**kw):
        p = copy.deepcopy(ev.payload)
        p["handoff"]["mm_items"][0].update(kw)
        return _with(ev, p)

    def handoff(**kw):
        p = copy.deepcopy(ev.payload)
        p["handoff"].update(kw)
        return _with(ev, p)

    def outer(**kw):  # prefill's handoff beside the contract (params, first token's top)
        return _with(ev, {**copy.deepcopy(ev.payload), **kw})

    with_media = copy.deepcopy(forwarded)
    with_media["messages"][0]["content"][1] = {"type": "image", "image": images["path"]}
    stray = list(h["prompt_token_ids"])
    stray[-2] = stray[it0["offset"]]  # a placeholder id outside every span
    return {
        "handoff: prefill sent no handoff": (forwarded, _with(ev, {})),
        "requires_kv: the request has 2 media item(s) but requires_kv is not set": (
            forwarded,
            handoff(requires_kv=False),
        ),
        "block size: prefill named blocks of 8 tokens": (forwarded, handoff(block_size=8)),
        "media payload: arrays ['pixel_values']": (
            forwarded,
            _with(ev, arrays={**ev.arrays, "pixel_values": np.zeros((1, 3, 32, 32))}),
        ),
        "media payload: the request still carries image data": (with_media, ev),
        "mm item 0: carries a media payload (data)": (forwarded, item(data="aGVsbG8=")),
        "mm item 0: empty hash": (forwarded, item(hash="")),
        f"mm item 0: placeholder span [{n - 4}, {n + 12}) lies outside the prompt": (
            forwarded,
            item(offset=n - 4),
        ),
        f"mm item 0: placeholder span [{n - 16}, {n}) reaches the final prompt token": (
            forwarded,
            item(offset=n - 16),
        ),
        f"placeholders: prompt position {n - 2} holds a placeholder token outside": (
            forwarded,
            handoff(prompt_token_ids=stray),
        ),
        "handoff from up: Expected `int`, got `str` - at `$.params.max_tokens`": (
            forwarded,
            outer(params={**ev.payload["params"], "max_tokens": "many"}),
        ),
        "handoff from up: Expected `array`, got `str` - at `$.top_ids`": (
            forwarded,
            outer(top_ids="x"),
        ),
        "kv coverage: no KV arrived": (forwarded, _with(ev, arrays={})),
        "kv coverage: KV of shapes": (
            forwarded,
            _with(ev, arrays={"keys": keys[:1], "values": values[:1]}),
        ),
        "kv coverage: the KV covers 20 prompt positions; mm item 1's placeholders": (
            forwarded,
            _with(ev, arrays={"keys": keys[:, :, :20], "values": values[:, :, :20]}),
        ),
        "block hashes: KV block 0 (positions [0, 16)) was computed for other tokens or media": (
            forwarded,
            item(hash="0" * 32),
        ),
        "block hashes: the KV is named by 1 block hashes but covers": (
            forwarded,
            handoff(kv_block_hashes=h["kv_block_hashes"][:1]),
        ),
    }


def test_each_admission_check_rejects_its_case(stages, requests, reference, images):
    decode = stages[2]
    ev, forwarded = _handoff(stages, requests[2])
    assert ev.payload["handoff"]["mm_items"][0]["offset"] < 16  # block 0 holds an image
    cases = _bad_cases(ev, forwarded, images)
    seen = set()
    for expected, (request, bad) in cases.items():
        errors = _errors(_decoded(decode, request, bad))
        assert len(errors) == 1 and errors[0].startswith("requires_kv admission: "), errors
        assert expected in errors[0], (expected, errors[0])
        seen.add(errors[0].split(":")[1])
    assert len(seen) >= 8  # each check says which one failed
    # the same stage still serves the good request, from the untouched handoff
    assert [t for e in _decoded(decode, forwarded, ev) for t in e.tokens] == reference[1][2]


def test_kv_lost_after_admission_is_never_recomputed(stages, requests):
    """The engine re-checks what it holds once admitted: a cache shorter than admitted
    (evicted, truncated) or a placeholder left to compute fails instead of recomputing."""
    from omni_ar.multimodal.handoff import AdmissionError
    from omni_ar.params import SamplingParams

    decode = stages[2]
    ev, _ = _handoff(stages, requests[2])
    h, a = ev.payload["handoff"], ev.arrays
    adm = admit(h, a, 16, decode.engine.kv_shape, decode.engine.placeholder_id)
    ids, params = h["prompt_token_ids"], SamplingParams(max_tokens=4)
    with pytest.raises(AdmissionError, match="holds 20 positions after admission"):
        next(decode.engine.resume(ids, a["keys"][:, :, :20], a["values"], adm.kv_tokens, params))
    last = max(it["offset"] + it["length"] for it in h["mm_items"])
    with pytest.raises(AdmissionError, match=f"position {last - 1} is a placeholder"):
        next(decode.engine.resume(ids, a["keys"], a["values"], last - 1, params))


def test_block_hashes_equal_on_both_sides_and_differ_by_image(stages, images):
    decode = stages[2]
    head = "omni pipelines stream tokens from stage to stage "  # a block before the image
    same = chat(head, img(images["path"]), " fox")
    same_pixels = chat(head, img(images["bmp_of_path"]), " fox")
    other = chat(head, img(images["other"]), " fox")
    evs = [_handoff(stages, r)[0] for r in (same, same_pixels, other)]
    hs = [e.payload["handoff"] for e in evs]
    for ev, h in zip(evs, hs, strict=True):  # decode names the KV blocks as prefill did
        adm = admit(h, ev.arrays, 16, decode.engine.kv_shape, decode.engine.placeholder_id)
        assert adm.block_hashes == h["kv_block_hashes"]
        assert adm.block_hashes == block_hashes(
            h["prompt_token_ids"], h["mm_items"], 16, ev.arrays["keys"].shape[2]
        )
    assert hs[0]["prompt_token_ids"] == hs[2]["prompt_token_ids"]  # only the image differs
    assert hs[0]["mm_items"][0]["hash"] == hs[1]["mm_items"][0]["hash"]  # PNG file vs BMP
    assert hs[0]["kv_block_hashes"] == hs[1]["kv_block_hashes"]
    assert hs[0]["mm_items"][0]["hash"] != hs[2]["mm_items"][0]["hash"]
    first = hs[0]["mm_items"][0]["offset"] // 16  # the first block holding the image
    names, others = hs[0]["kv_block_hashes"], hs[2]["kv_block_hashes"]
    assert first >= 1 and names[:first] == others[:first]
    assert all(a != b for a, b in zip(names[first:], others[first:], strict=True))  # chained


def test_prefix_cache_hits_a_repeated_image_and_prefix(llava, images):
    opts = {"prefix_cache_blocks": 64}
    cfg = mm_config(llava, enabled=False, prefill=opts)
    cfg["stages"][1]["client_stream"] = True
    head, tail = "omni pipelines stream tokens from stage to stage ", " héllo wörld ✓ 猫 🦊 "
    a = chat(head, img(images["jpeg"]), tail + "red")
    b = chat(head, img(images["jpeg"]), tail + "a fox")
    c = chat(head, img(images["other"]), tail + "red")
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([a, b, c, b])
    cached = [o.by_stage("prefill")[0].payload["cached_tokens"] for o in outs]
    span = outs[1].by_stage("prefill")[0].payload["handoff"]["mm_items"][0]
    assert cached[0] == 0
    assert cached[1] >= span["offset"] + span["length"]  # the image's blocks, encoder skipped
    assert 0 < cached[2] <= span["offset"]  # the text prefix only: another image
    assert cached[3] >= cached[1]  # b again: every block of it
    assert text_and_tokens(outs[1])[1] == text_and_tokens(outs[3])[1]
    cfg = mm_config(llava, enabled=False, prefill={"prefix_cache_blocks": 0})
    with Pipeline(cfg) as pipe:
        assert text_and_tokens(pipe.generate([b])[0])[1] == text_and_tokens(outs[1])[1]


def test_bad_images_end_only_their_request(llava, images, tmp_path):
    truncated = images["jpeg"][: len(images["jpeg"]) // 2]
    big = synthetic_image(5, 300, 200)
    bad = [
        (truncated, "cannot decode image"),
        (b"not an image at all", "cannot decode image"),
        ("data:image/png;base64,@@@", "invalid base64"),
        ("data:image/png,rawdata", "expected a base64 data URL"),
        (str(tmp_path / "missing.png"), "cannot read image file"),
        ("https://example.com/cat.png", "remote URLs are not fetched"),
        (big, "over max_image_pixels=20000"),
    ]
    cfg = mm_config(llava, enabled=False)
    cfg["stages"][0]["options"]["max_image_pixels"] = 20_000
    good = chat("the quick ", img(images["path"]), " fox", max_tokens=5)
    with Pipeline(cfg) as pipe:
        outs = pipe.generate([chat("x ", img(src), max_tokens=5) for src, _ in bad] + [good])
    for out, (_, why) in zip(outs, bad, strict=False):
        assert out.finish_reason == "error"
        assert "stage 'intake'" in out.error and "messages[0].content[1]" in out.error, out.error
        assert why in out.error, out.error
    assert outs[-1].ok and len(text_and_tokens(outs[-1])[1]) == 5


def test_image_budget_is_checked_from_the_header_before_decoding():
    from omni_ar.multimodal.media import MediaError, decode_image, load_images

    bomb = png_bomb(4_000, 3_000)  # 12 MP: 36 MB as RGB
    assert len(bomb) < 60_000
    t0 = time.perf_counter()
    with pytest.raises(MediaError, match=r"'m\[0\]': image of 4000x3000 pixels, over max_image"):
        decode_image(bomb, "m[0]", 1_000_000)
    refused_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert decode_image(bomb, "m[0]", 16_000_000).shape == (3_000, 4_000, 3)  # a real bomb
    decoded_s = time.perf_counter() - t0
    assert refused_s < decoded_s / 10, (refused_s, decoded_s)  # refused before decoding
    huge = png_bomb(30_000, 30_000)  # past PIL's own limit: refused by it, named as ours
    with pytest.raises(MediaError, match=r"'m\[0\]': image over max_image_pixels=16000000"):
        decode_image(huge, "m[0]", 16_000_000)
    # the request's total: three 120x90 images, 30000 pixels at most together
    parts = [{"type": "image", "image": synthetic_image(i, 120, 90, fmt="JPEG")} for i in (1, 2, 3)]
    msgs = [{"role": "user", "content": parts}]
    assert len(load_images(msgs, 20_000, 40_000)) == 3
    with pytest.raises(MediaError, match=r"content\[2\]'.*32400 pixels, over max_total_pixels"):
        load_images(msgs, 20_000, 30_000)


def test_local_image_files_only_with_the_stage_option(llava, images, tmp_path):
    """From the Python API too, a request may not make the intake read its files unless
    the stage's options allow it; even then a FIFO (which would hang it) is refused."""
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    good = chat("the quick ", img(images["url"]), " fox", max_tokens=3)
    sources = [images["path"], "file://" + images["path"], str(fifo)]
    asks = [chat("x ", img(src), max_tokens=3) for src in sources] + [good]
    cfg = mm_config(llava, enabled=False)
    del cfg["stages"][0]["options"]["allow_local_images"]
    with Pipeline(cfg) as pipe:
        outs = pipe.generate(asks)
    for out in outs[:3]:
        assert out.finish_reason == "error", out
        assert "messages[0].content[1]" in out.error and "allow_local_images is off" in out.error
    assert outs[-1].ok
    with Pipeline(mm_config(llava, enabled=False)) as pipe:
        outs = pipe.generate(asks)
    assert outs[0].ok and outs[1].ok and outs[3].ok
    assert "is not a regular file" in outs[2].error, outs[2].error


def test_text_stages_refuse_image_parts(llava):
    request = chat("x ", img(b"png"))
    with pytest.raises(RequestError, match=r"messages\[0\].content.*multimodal stages"):
        parse_request(request, 100)
    assert parse_request(request, 100, images=True)[0] == request["messages"]
    bad = {"messages": [{"role": "user", "content": [{"type": "image", "url": 1}]}]}
    with pytest.raises(RequestError, match=r"field 'messages\[0\].content\[0\]'"):
        parse_request(bad, 100, images=True)


def test_media_free_decode_on_vllm_without_omnis_plugin_says_why(llava, monkeypatch):
    """The plugin not installed (here: as on a vLLM other than 0.32.0): the stage
    refuses at load, before any engine starts, naming the version it supports."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from omni_ar.engines import vllm_requires_kv as plugin
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched.scheduler import Scheduler

    load_general_plugins()
    method = Scheduler._try_schedule_encoder_inputs
    monkeypatch.setattr(
        Scheduler, "_try_schedule_encoder_inputs", getattr(method, "__wrapped__", method)
    )
    monkeypatch.setattr(plugin, "_refusal", "omni's plugin supports vLLM 0.32.0 only (test)")
    with pytest.raises(RuntimeError, match=r"media-free decode: .*supports vLLM 0\.32\.0 only"):
        _stage(MMDecode, "ar.mm_decode", llava, engine="vllm")


def test_decode_never_loads_the_vision_tower(llava):
    """In a fresh interpreter: the decode stage loads, and neither the vision tower's
    code nor any of its weights is there."""
    code = f"""
import sys
from omni_core.registry import load_stage_class
from omni_core.stage import StageContext
stage = load_stage_class("ar.mm_decode")(StageContext("d", "ar.mm_decode", {{"model": {llava!r}}}))
stage.load()
names = list(stage.engine.model.state_dict())
assert type(stage.engine.model).__name__ == "LlamaForCausalLM", type(stage.engine.model)
assert names and not [n for n in names if "vision" in n or "projector" in n], names
loaded = [m for m in sys.modules if m.endswith(("modeling_clip", "modeling_llava"))]
assert not loaded, loaded
print("ok", len(names))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-2000:]


def test_decode_killed_mid_request_fails_it(pipe, requests, reference):
    """A decode worker that dies takes the request's KV with it: the request ends with
    an error (it is not replayed or recomputed), and the restarted stage serves more."""
    long = {**copy.deepcopy(requests[0]), "max_tokens": 400, "ignore_eos": True}
    h = pipe.submit(long)
    next(iter(h))
    kill_stage(pipe, "decode")
    events = list(h)
    assert events[-1].event_type == "error" and "stage 'decode'" in events[-1].message
    wait_ready(pipe, "decode")
    out = pipe.generate([copy.deepcopy(requests[1])])[0]
    assert text_and_tokens(out)[1] == reference[1][1]
    assert pipe.metrics()["counts"].get("replayed", 0) == 0


def test_only_the_usual_image_formats_are_opened(tmp_path, monkeypatch):
    """A request's image is opened as PNG, JPEG, WebP, GIF or BMP only: a TIFF (which
    Pillow would decode) and an EPS (which would run Ghostscript) are refused by the
    intake's own words; a local file (where allowed) is read up to a size."""
    from omni_ar.multimodal import media
    from omni_ar.multimodal.media import MediaError, decode_image, source_bytes

    tiff = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(tiff, format="TIFF")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n"
    assert Image.open(io.BytesIO(tiff.getvalue())).format == "TIFF"  # Pillow knows both
    assert Image.open(io.BytesIO(eps)).format == "EPS"
    for data in (tiff.getvalue(), eps):
        with pytest.raises(MediaError, match=r"field 'x': cannot decode image \(not a"):
            decode_image(data, "x", 10**9)
    png = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(png, format="PNG")
    assert decode_image(png.getvalue(), "x", 10**9).shape == (8, 8, 3)
    path = tmp_path / "big.png"
    path.write_bytes(png.getvalue())
    part = {"type": "image", "image": str(path)}
    assert source_bytes(part, "x", allow_local=True) == png.getvalue()
    monkeypatch.setattr(media, "MAX_FILE_BYTES", len(png.getvalue()) - 1)
    with pytest.raises(MediaError, match="too big for an image"):
        source_bytes(part, "x", allow_local=True)
