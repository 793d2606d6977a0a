"""Media-free multimodal decode on vLLM itself: omni's ``requires_kv`` plugin
(:mod:`omni_ar.engines.vllm_requires_kv`), the connector's block-name check and the
engine's multimodal prefill and decode, on the tiny Llava.

vLLM's Llava imports transformers' Pixtral image processor, which needs torchvision:
the engine tests run where vLLM's Llava imports (``hatch run vllm-mm:test``, see the
development guide), and are skipped elsewhere; the plugin's own tests run wherever vLLM
is installed.
"""

import os
import re

import numpy as np
import pytest
from omni_ar.testing import require_vllm

require_vllm()

from omni_ar.engines import vllm_requires_kv as plugin  # noqa: E402
from omni_ar.params import SamplingParams  # noqa: E402
from omni_testing.events import events_of  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_environment")  # in-process engines below

# blocks of 32 tokens (vLLM's CPU attention); the image's 16 placeholders at [19, 35)
# straddle the first two blocks; a small KV cache per engine
BLOCK = 32
ENGINE_ARGS = {"block_size": BLOCK, "max_model_len": 256, "kv_cache_memory_bytes": 8 << 20}
PROMPT = "USER: look at this <image>\nwhat is in this picture, please tell me in detail ASSISTANT:"


# -- the plugin: entry point, version guard ------------------------------------------------
def test_vllm_finds_the_plugin_in_its_own_entry_point_group():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "omni_requires_kv"]
    assert ep.value == "omni_ar.engines.vllm_requires_kv:register"
    assert ep.load() is plugin.register


@pytest.fixture
def unwrapped(monkeypatch):
    """The scheduler as vLLM ships it, for one test; the plugin installed again after."""
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched.scheduler import Scheduler

    load_general_plugins()  # what every engine does first (once a process)
    assert plugin.installed()

    original = Scheduler._try_schedule_encoder_inputs
    monkeypatch.setattr(
        Scheduler, "_try_schedule_encoder_inputs", getattr(original, "__wrapped__", original)
    )
    monkeypatch.setattr(plugin, "_refusal", None)
    return Scheduler


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "0.32.1", "1.0.0+cu130"])
def test_on_another_vllm_version_it_installs_nothing_and_says_which_it_supports(
    unwrapped, monkeypatch, caplog, version
):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    plugin.register()
    assert not plugin.installed()
    assert f"supports vLLM {plugin.SUPPORTED_VLLM} only" in caplog.text
    with pytest.raises(
        RuntimeError, match=re.escape(f"supports vLLM 0.32.0 only, and this is vLLM {version}")
    ):
        plugin.require()


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_on_the_supported_version_it_installs_once(unwrapped, monkeypatch, version):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    original = unwrapped._try_schedule_encoder_inputs
    plugin.register()
    assert plugin.installed()
    wrapped = unwrapped._try_schedule_encoder_inputs
    assert wrapped.__wrapped__ is original
    plugin.register()  # vLLM may load plugins more than once: never wrapped twice
    assert unwrapped._try_schedule_encoder_inputs is wrapped
    plugin.require()


def test_a_scheduler_method_of_another_shape_is_left_alone(unwrapped, monkeypatch, caplog):
    def other(self, request, num_computed_tokens, budget):  # pragma: no cover - never run
        raise AssertionError

    monkeypatch.setattr(unwrapped, "_try_schedule_encoder_inputs", other)
    plugin.register()
    assert unwrapped._try_schedule_encoder_inputs is other
    with pytest.raises(RuntimeError, match="not the .* it was written for"):
        plugin.require()


def test_failure_notes_are_bounded(monkeypatch):
    monkeypatch.setattr(plugin, "FAILURES_MAX", 3)
    table = type(plugin.FAILURES)()
    for i in range(5):
        plugin.remember(table, f"k{i}", str(i))
    plugin.remember(table, "k2", "again")  # a key seen again is the newest
    assert list(table.items()) == [("k3", "3"), ("k4", "4"), ("k2", "again")]


# -- the engines: vLLM's Llava --------------------------------------------------------------
@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from omni_ar.multimodal.testing import build_tiny_llava, vllm_llava_missing

    why = vllm_llava_missing()
    if why is not None:
        if os.environ.get("OMNI_VLLM_MM"):
            pytest.fail(f"vLLM's Llava does not import here: {why}", pytrace=False)
        pytest.skip(f"vLLM's Llava does not import here ({why}): hatch run vllm-mm:test")
    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-vllm"), for_vllm=True))


def _image(seed):
    import io

    from omni_ar.multimodal.testing import synthetic_image
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(synthetic_image(seed))).convert("RGB"))


@pytest.fixture(scope="module")
def images():
    """Three images, decoded: (pixels, seed)."""
    return [(_image(seed), seed) for seed in range(3)]


@pytest.fixture(scope="module")
def reference(llava, images, tmp_path_factory):
    """vLLM's own ``LLM.generate`` given each image (in a process of its own)."""
    from omni_ar.multimodal.testing import vllm_generate

    cases = [(PROMPT, [px], 12) for px, _ in images]
    out = vllm_generate(llava, cases, ENGINE_ARGS, tmp_path_factory.mktemp("oracle"))
    assert len({tuple(t) for t in out}) == len(out)  # the image changes the output
    return out


@pytest.fixture(scope="module")
def intake(llava):
    """Prompt ids with each image's placeholders and its hash, made as ``ar.mm_intake``
    makes them (the Llava processor's count; the prompt as plain text, as the oracle's)."""
    from omni_ar.multimodal.engine import VLMEngine
    from omni_ar.multimodal.media import image_hash

    engine = VLMEngine(llava)
    engine.load_tokenizer()

    def render(px):
        ids = engine.encode(PROMPT)
        marker = engine.processor.image_token_id
        n = engine.processor._get_num_multimodal_tokens(
            image_sizes=[px.shape[:2]]
        ).num_image_tokens[0]
        at = ids.index(marker)
        ids = ids[:at] + [marker] * n + ids[at + 1 :]
        return ids, [{"hash": image_hash(px), "offset": at, "length": n}]

    return render


@pytest.fixture(scope="module")
def engines(llava):
    """(prefill: KV producer with the vision tower, decode: media-free KV consumer)."""
    from omni_ar.multimodal.testing import vllm_handoff_engines

    return vllm_handoff_engines(llava, ENGINE_ARGS)


def _handoff(engines, intake, px, max_tokens=12):
    from omni_ar.engines.vllm_mm import MMContinuation

    prefill, _ = engines
    ids, items = intake(px)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    done = prefill.prefill_mm(ids, items, [px], params)
    return ids, params, done, MMContinuation(items, done.block_hashes)


def test_media_free_decode_equals_llm_generate_given_the_image(engines, intake, images, reference):
    _, decode = engines
    for (px, _), expected in zip(images, reference, strict=True):
        ids, params, done, mm = _handoff(engines, intake, px)
        steps = decode.decode(done.first[0], done.keys, done.values, params, ids, mm=mm)
        assert [done.first[0], *(t for t, _ in steps)] == expected


def test_decode_builds_no_vision_tower(engines):
    prefill, decode = engines

    def names(engine):
        model = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        return {n.split(".")[0] for n, _ in model.named_parameters()}

    assert "vision_tower" in names(prefill)
    assert "vision_tower" not in names(decode) and "multi_modal_projector" not in names(decode)


def _fails(decode, done, params, ids, mm, keys=None, values=None):
    from omni_ar.errors import EngineRequestError

    assert decode.llm.reset_prefix_cache()  # else its own cache may serve the blocks
    keys = done.keys if keys is None else keys
    values = done.values if values is None else values
    steps = decode.decode(done.first[0], keys, values, params, ids, mm=mm)
    with pytest.raises(EngineRequestError) as e:
        list(steps)
    return str(e.value)


def test_each_kv_that_does_not_cover_the_placeholders_fails_the_request_closed(
    engines, intake, images, reference
):
    from omni_ar.engines.vllm_mm import MMContinuation

    _, decode = engines
    px = images[0][0]
    ids, params, done, mm = _handoff(engines, intake, px)
    it = mm.items[0]
    end = it["offset"] + it["length"]
    assert end > BLOCK  # the placeholders reach past the first block
    # no KV at all
    empty = np.zeros((0,), np.float32)
    msg = _fails(decode, done, params, ids, mm, empty, empty)
    assert f"KV covers 0 prompt positions, its media placeholders end at {end}" in msg
    assert "no KV arrived" in msg and "without running a vision encoder" in msg
    # a short KV: its first block only
    msg = _fails(decode, done, params, ids, mm, done.keys[:, :1], done.values[:, :1])
    assert f"KV covers {BLOCK} prompt positions" in msg and "stops short" in msg
    # the KV of another image: decode names the blocks after its own item hash
    other = MMContinuation([{**it, "hash": "0" * 32}], mm.block_hashes)
    msg = _fails(decode, done, params, ids, other)
    assert "KV block 0 (positions [0, 32)) was computed for other tokens or media" in msg
    # a block name altered in transit: the blocks before it load, the rest do not
    names = list(mm.block_hashes)
    names[1] = "f" * len(names[1])
    msg = _fails(decode, done, params, ids, MMContinuation(mm.items, names))
    assert f"KV covers {BLOCK} prompt positions" in msg and "KV block 1" in msg
    # nothing stuck: the engine serves the same request whole afterwards
    steps = decode.decode(done.first[0], done.keys, done.values, params, ids, mm=mm)
    assert [done.first[0], *(t for t, _ in steps)] == reference[0]
    assert not plugin.FAILURES and not plugin.CONNECTOR_NOTES


def test_decodes_prefix_cache_serves_a_repeated_image_and_prefix(
    engines, intake, images, reference
):
    """The same image and prompt again: decode's own prefix cache holds their full blocks
    (named by the image's hash), so the request needs no KV from prefill at all; another
    image's blocks are not its."""
    _, decode = engines
    assert decode.llm.reset_prefix_cache()
    px = images[1][0]
    ids, params, done, mm = _handoff(engines, intake, px)
    steps = decode.decode(done.first[0], done.keys, done.values, params, ids, mm=mm)
    assert [done.first[0], *(t for t, _ in steps)] == reference[1]
    empty = np.zeros((0,), np.float32)
    steps = decode.decode(done.first[0], empty, empty, params, ids, mm=mm)
    assert [done.first[0], *(t for t, _ in steps)] == reference[1]
    ids2, _, done2, mm2 = _handoff(engines, intake, images[2][0])
    steps = decode.decode(done2.first[0], empty, empty, params, ids2, mm=mm2)
    with pytest.raises(Exception, match="no KV arrived"):
        list(steps)


def test_a_preempted_request_fails_instead_of_recomputing_without_its_media(
    llava, engines, intake, images
):
    """A KV cache of 8 blocks and two requests that each grow to 5: vLLM preempts one,
    and without its media it cannot recompute the placeholders. (With prefix caching,
    off here, a preempted request whose freed blocks are still cached resumes from
    them: those are valid KV of the same tokens and image.)"""
    from omni_ar.engines.vllm_engine import VllmEngine
    from omni_ar.errors import EngineRequestError

    small = VllmEngine(
        llava,
        kv_role="kv_consumer",
        multimodal=True,
        engine_args={
            **ENGINE_ARGS,
            "max_model_len": 160,
            "kv_cache_memory_bytes": 8 * 32768,
            "enable_prefix_caching": False,
        },
    )
    small.load_model()
    runs = []
    for px, _ in images[:2]:
        ids, params, done, mm = _handoff(engines, intake, px, max_tokens=60)
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        runs.append(small.decode(done.first[0], done.keys, done.values, params, ids, mm=mm))
    results = []
    for steps in runs:
        try:
            results.append(len([s for s in steps if s is not None]))
        except EngineRequestError as e:
            results.append(str(e))
    errors = [r for r in results if isinstance(r, str)]
    assert len(errors) == 1, results
    assert "preempted" in errors[0] and "no media to recompute" in errors[0]
    assert 59 in results  # the other one ran to its end


# -- the stages: ar.mm_intake -> ar.mm_prefill -> ar.mm_decode on engine: vllm ---------------
def _data_url(seed, width, height):
    import base64

    from omni_ar.multimodal.testing import synthetic_image

    png = synthetic_image(seed, width, height)
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _chat(*parts, max_tokens=16):
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p[0]}
        for p in parts
    ]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


@pytest.fixture(scope="module")
def chats():
    a, b = (_data_url(7, 64, 48),), (_data_url(8, 40, 72),)
    return [
        _chat("the quick ", a, " fox"),
        _chat("two: ", a, " and ", b, " ok", max_tokens=20),
        _chat(b, "a red fox in the snow", max_tokens=12),
        {"messages": [{"role": "user", "content": "stream tokens"}], "max_tokens": 10},
    ]


@pytest.fixture(scope="module")
def chat_reference(llava, chats, tmp_path_factory):
    """vLLM's own ``LLM.generate`` given each request's images, its prompt the chat
    template's text with one image marker per image (as ar.mm_intake renders it)."""
    from omni_ar.multimodal.engine import VLMEngine
    from omni_ar.multimodal.testing import chat_case, vllm_generate

    render = VLMEngine(llava)
    render.load_tokenizer()
    cases = [chat_case(render, r) for r in chats]
    out = vllm_generate(llava, cases, ENGINE_ARGS, tmp_path_factory.mktemp("chat-oracle"))
    assert len({tuple(t) for t in out}) == len(out)
    return render.tokenizer, out


def mm_config(model, enabled=True, media="none"):
    engine = {"model": model, "engine": "vllm", "engine_args": ENGINE_ARGS}
    return {
        "mrs": {"enabled": enabled},
        "ready_timeout_s": 300,
        "heartbeat_interval_s": 0.2,
        "stages": [
            {"name": "intake", "kind": "ar.mm_intake", "options": {"model": model}},
            {
                "name": "prefill",
                "kind": "ar.mm_prefill",
                "max_batch_size": 4,  # prefills batched in vLLM's steps
                "client_stream": True,  # the event decode receives, looked at below
                "options": {**engine, "forward_media": media == "reprocess"},
            },
            {
                "name": "decode",
                "kind": "ar.mm_decode",
                "max_inflight": 4,
                "options": {**engine, "media": media, "max_segment_tokens": 4},
            },
            {"name": "postprocess", "kind": "ar.mm_postprocess", "options": {"model": model}},
        ],
        "edges": [
            {"from": "intake", "to": "prefill"},
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "postprocess", "window": {"size": 1}},
        ],
    }


@pytest.mark.parametrize(
    "enabled,media",
    [(True, "none"), (False, "none"), (True, "reprocess")],
    ids=["processes", "inline", "full-media-baseline"],
)
def test_stages_on_vllm_equal_llm_generate_and_decode_never_gets_the_media(
    llava, chats, chat_reference, enabled, media
):
    import copy

    from omni_ar.multimodal.media import has_media
    from omni_core import Pipeline

    tok, expected = chat_reference
    with Pipeline(mm_config(llava, enabled, media)) as pipe:
        handles = [pipe.submit(copy.deepcopy(r)) for r in chats]
        for h, exp in zip(handles, expected, strict=True):
            events = list(h)
            errors = [e.message for e in events if e.event_type == "error"]
            assert not errors, errors
            events = [e for e in events if e.event_type == "segment"]
            tokens = [t for e in events if e.stage == "postprocess" for t in e.tokens]
            text = "".join(e.payload["text"] for e in events if e.stage == "postprocess")
            assert tokens == exp
            assert text == tok.decode(exp, skip_special_tokens=True)
            (sent,) = [e for e in events if e.stage == "prefill"]
            assert sorted(sent.arrays) == ["keys", "values"]
            handoff = sent.payload["handoff"]
            assert all(sorted(it) == ["hash", "length", "offset"] for it in handoff["mm_items"])
            assert handoff["requires_kv"] == bool(handoff["mm_items"])
            # the media leaves with prefill, but in the full-media baseline
            assert has_media(sent.request["messages"]) == (
                media == "reprocess" and bool(handoff["mm_items"])
            )


def test_a_prompt_vllm_refuses_fails_alone_in_its_prefill_batch(llava, chats, chat_reference):
    """Four requests at once, one longer than the engines' max_model_len (256): vLLM
    refuses it when it enters, which fails the batch's engine call; prefill then runs the
    prompts one by one, and only that one fails, with vLLM's reason."""
    import copy

    from omni_core import Pipeline

    tok, expected = chat_reference
    long = _chat("0123456789 " * 40, (_data_url(9, 32, 32),), " ok")  # some 460 tokens
    batch = [copy.deepcopy(chats[0]), long, copy.deepcopy(chats[1]), copy.deepcopy(chats[3])]
    with Pipeline(mm_config(llava)) as pipe:
        outs = pipe.generate(batch)
    assert not outs[1].ok and "vLLM multimodal prefill" in outs[1].error, outs[1].error
    assert "256" in outs[1].error
    for k, exp in ((0, expected[0]), (2, expected[1]), (3, expected[3])):
        out = outs[k]
        assert out.ok, out.error
        assert [t for e in out.by_stage("postprocess") for t in e.tokens] == exp


# -- the stages driven directly: a handoff altered on its way to decode ----------------------
@pytest.fixture(scope="module")
def mm_stages(llava):
    from omni_ar.multimodal.stages import MMDecode, MMIntake, MMPrefill
    from omni_core.stage import StageContext

    engine = {"model": llava, "engine": "vllm", "engine_args": ENGINE_ARGS}
    out = []
    for cls, kind, options in (
        (MMIntake, "ar.mm_intake", {"model": llava}),
        (MMPrefill, "ar.mm_prefill", engine),
        (MMDecode, "ar.mm_decode", engine),
    ):
        stage = cls(StageContext("s", kind, options))
        stage.load()
        out.append(stage)
    return out


def _feed(stage, request, ev=None):
    """One stage on one request and its upstream stage's event: (events, the request as
    the stage forwards it)."""
    import copy

    from omni_core import StageInput
    from omni_core.dataplane.windows import Piece, Window

    request = copy.deepcopy(request)
    windows = {}
    if ev is not None:
        piece = Piece(0, ev.tokens, getattr(ev, "arrays", {}), ev.payload, logprobs=ev.logprobs)
        windows["up"] = Window("up", 0, 0, 0, [piece], True)
    return events_of(stage.process([StageInput("r", request, windows, True, True)])), request


def test_decode_stage_fails_an_altered_handoff_alone(mm_stages, chats, chat_reference):
    import copy

    intake, prefill, decode = mm_stages
    _, expected = chat_reference
    (ev,), _ = _feed(intake, chats[0])
    (sent,), forwarded = _feed(prefill, chats[0], ev)
    assert sent.event_type == "segment" and sent.tokens == expected[0][:1]

    def decoded(change=None, arrays=None, outer=None):
        ev = copy.copy(sent)
        ev.payload = copy.deepcopy(sent.payload)
        if change:
            ev.payload["handoff"].update(change)
        ev.payload.update(outer or {})  # beside the contract: params, the first token's top
        ev.arrays = dict(sent.arrays) if arrays is None else arrays
        evs, _ = _feed(decode, forwarded, ev)
        tokens = [t for e in evs if e.event_type == "segment" for t in e.tokens]
        return tokens, [e.message for e in evs if e.event_type == "error"]

    assert decoded() == (expected[0], [])
    names = list(sent.payload["handoff"]["kv_block_hashes"])
    # checked by the stage, before the engine sees the request
    cases = {
        "no KV arrived": decoded(arrays={}),
        "block size: prefill named blocks of 16 tokens": decoded({"block_size": 16}),
        "the KV is named by 1 block hashes but holds": decoded({"kv_block_hashes": names[:1]}),
        "handoff from up: Expected `int`, got `str` - at `$.params.max_tokens`": decoded(
            outer={"params": {**sent.payload["params"], "max_tokens": "many"}}
        ),
        "handoff from up: Expected `array`, got `str` - at `$.top_ids`": decoded(
            outer={"top_ids": "x"}
        ),
    }
    for needle, (tokens, errors) in cases.items():
        assert tokens == [] and len(errors) == 1 and needle in errors[0], (needle, errors)
        assert errors[0].startswith("requires_kv admission: ")
    # checked by the engine (the connector's names, omni's plugin): the image lies in
    # block 0; a wrong name there loads nothing, and after prefill's first token the
    # request ends, with nothing computed from the wrong KV
    (it,) = sent.payload["handoff"]["mm_items"]
    assert it["offset"] + it["length"] <= BLOCK < len(sent.payload["handoff"]["prompt_token_ids"])
    wrong = "f" * len(names[0])
    assert decode.engine.llm.reset_prefix_cache()  # else its own cache serves the blocks
    tokens, errors = decoded({"kv_block_hashes": [wrong, *names[1:]]})
    assert tokens == expected[0][:1] and len(errors) == 1, errors
    assert "KV block 0 (positions [0, 32)) was computed for other tokens or media" in errors[0]
    # a wrong name past the image: that block and the rest are computed again (text
    # only), never loaded, and the tokens are the same
    assert decode.engine.llm.reset_prefix_cache()
    assert decoded({"kv_block_hashes": [names[0], wrong, *names[2:]]}) == (expected[0], [])
    assert decoded() == (expected[0], [])  # the engine goes on


# -- a worker on engine: vllm stopped or killed with a request in its hands -----------------
def test_a_stopped_or_killed_vllm_worker_fails_its_request_and_restarts(
    llava, chats, chat_reference
):
    """Decode SIGSTOPped before a request reaches it: health says so within heartbeats,
    the request ends ``stage_hung`` and the worker restarts. Prefill SIGSTOPped, given a
    request, then SIGKILLed: that request ends naming ``stage 'prefill'`` (``stage_died``;
    ``stage_hung`` if the stall timeout fires first). Each restarted worker loads its vLLM
    engine again and serves the next request as ``LLM.generate`` does. (No timing race:
    the stop comes before the request, so it is in the worker's hands.)"""
    import copy
    import signal

    from omni_core import Pipeline
    from omni_testing.faults import kill_stage, stopped, wait_for, wait_ready

    _, expected = chat_reference
    cfg = mm_config(llava)
    for stage in cfg["stages"][1:3]:
        stage.update({"restart_backoff_s": 0.1, "stall_timeout_s": 5.0})

    def served(pipe):
        (out,) = pipe.generate([copy.deepcopy(chats[1])])
        assert out.ok, out.error
        assert [t for e in out.by_stage("postprocess") for t in e.tokens] == expected[1]

    with Pipeline(cfg) as pipe:
        served(pipe)
        with stopped(pipe.pids()["decode"]):
            h = pipe.submit(copy.deepcopy(chats[0]))
            wait_for(lambda: not pipe.healthy, 5.0, "health to notice the stopped decode")
            assert pipe.health()["decode"]["state"] == "unresponsive"
            events = list(h)
            assert events[-1].event_type == "error", events[-1]
            assert events[-1].code == "stage_hung" and "stage 'decode'" in events[-1].message
        assert wait_ready(pipe, "decode", 300)
        assert pipe.health()["decode"]["restarts"] == 1
        served(pipe)

        kill_stage(pipe, "prefill", signal.SIGSTOP)
        h = pipe.submit(copy.deepcopy(chats[0]))
        wait_for(lambda: pipe.health()["prefill"]["state"] == "unresponsive", 5.0, "health")
        kill_stage(pipe, "prefill")  # SIGKILL ends a stopped process too
        events = list(h)
        assert events[-1].event_type == "error", events[-1]
        assert events[-1].code in ("stage_died", "stage_hung"), events[-1]
        assert "stage 'prefill'" in events[-1].message
        assert wait_ready(pipe, "prefill", 300)
        assert pipe.healthy and all(s["state"] == "ready" for s in pipe.health().values())
        served(pipe)
