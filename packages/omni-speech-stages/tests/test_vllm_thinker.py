"""``speech.thinker`` on vLLM (``engine: vllm``) against the same stage on transformers:
the same text tokens, payloads and segments, and the talker's rows (``embed``, ``hidden``,
``tts``) within :data:`ROW_ATOL`; requests at once (prefill chunked, decodes in the same
steps) each get their own rows; the talker's codes and the waveform behind the vLLM
thinker equal those behind the transformers one.

Runs where vLLM's Qwen2.5-Omni thinker imports (``hatch run vllm-mm:test``); skipped
elsewhere, failed instead under ``OMNI_VLLM_MM=1``. ``OMNI_SPEECH_FIGURES=1`` adds the
throughput figures (rows or none, against transformers; printed, ``-s``).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torchvision") is None:
    if os.environ.get("OMNI_VLLM_MM"):
        pytest.fail("vLLM or torchvision is not installed here", pytrace=False)
    pytest.skip("vLLM's multimodal models need vLLM and torchvision", allow_module_level=True)

from omni_core import Pipeline, StageInput  # noqa: E402
from omni_core.stage import StageContext  # noqa: E402
from omni_speech.testing import png_part, wav_part  # noqa: E402
from omni_speech.thinker import Thinker  # noqa: E402
from omni_testing.events import events_of

ROW_ATOL = 1e-4  # rows up to ~4.4 in size; measured at most 2.6e-5 apart (tiny model, fp32 CPU)
MAX_TOKENS = 10
# vLLM's CPU blocks; 64 tokens a step chunks every prompt here (164 to 207 tokens)
ENGINE_ARGS = {
    "block_size": 32,
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 32 << 20,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
}

TEXT = {"prompt": "hello there, how are you today", "max_tokens": MAX_TOKENS, "seed": 11}
MEDIA = {
    "messages": [
        {"role": "user", "content": [png_part(), wav_part(), {"type": "text", "text": "what?"}]}
    ],
    "max_tokens": MAX_TOKENS,
    "seed": 5,
}
IMAGE = {
    "messages": [{"role": "user", "content": [png_part(56, 32), {"type": "text", "text": "hm"}]}],
    "max_tokens": MAX_TOKENS + 3,
}
SAY = {"input": "hello there", "audio": {"voice": "Ethan"}}  # the speech endpoint's
QUIET = {**TEXT, "prompt": "text only, please", "modalities": ["text"]}
CASES = {"text": TEXT, "image+audio": MEDIA, "say": SAY, "text-out": QUIET}

pytestmark = pytest.mark.usefixtures("restore_environment")


@pytest.fixture(scope="module")
def restore_environment() -> Iterator[None]:
    """The in-process engine sets vLLM's environment: undo it for the tests after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen2.5-Omni with the thinker's heads of 32 (vLLM's CPU kernels)."""
    try:
        import vllm.model_executor.models.qwen2_5_omni_thinker  # noqa: F401
    except Exception as e:  # transformers' Qwen2-VL processors need torchvision
        if os.environ.get("OMNI_VLLM_MM"):
            pytest.fail(f"vLLM's Qwen2.5-Omni thinker does not import here: {e}", pytrace=False)
        pytest.skip(f"vLLM's Qwen2.5-Omni thinker does not import here ({e})")
    from omni_speech.testing import build_tiny_omni

    # seed 2: its greedy talker speaks both replies to max_codes (seed 0's stops at 5)
    path = tmp_path_factory.mktemp("tiny-omni-vllm")
    return str(build_tiny_omni(path, seed=2, for_vllm=True))


def _stage(model: str, **options: Any) -> Thinker:
    stage = Thinker(StageContext("thinker", "speech.thinker", {"model": model, **options}))
    stage.load()
    return stage


@pytest.fixture(scope="module")
def reference(model: str) -> Thinker:
    return _stage(model)


@pytest.fixture(scope="module")
def on_vllm(model: str) -> Iterator[Thinker]:
    stage = _stage(model, engine="vllm", engine_args=ENGINE_ARGS)
    yield stage
    stage.model.close()


def _input(request: dict, rid: str = "r") -> StageInput:
    return StageInput(rid, copy.deepcopy(request), {}, True, True)


def run_one(stage: Thinker, request: dict) -> list:
    return events_of(stage.process([_input(request)]))


def run_at_once(stage: Thinker, requests: list[dict]) -> list[list]:
    """Every request's generator driven round-robin, as a worker drives them under
    ``max_inflight``: their requests share the engine's steps."""
    gens = {i: stage.process([_input(r, f"r{i}")]) for i, r in enumerate(requests)}
    out: dict[int, list] = {i: [] for i in gens}
    while gens:
        for i, g in list(gens.items()):
            try:
                ev = next(g)
            except StopIteration:
                del gens[i]
                continue
            if ev is not None:
                out[i].append(ev)
    return [out[i] for i in range(len(requests))]


def assert_same_segments(got: list, want: list) -> float:
    """Same tokens, payloads, ends and array names; rows within ROW_ATOL. Returns the
    largest difference of a row."""
    errors = [e.message for e in got if not hasattr(e, "tokens")]
    assert not errors, errors
    assert [e.tokens for e in got] == [e.tokens for e in want]
    assert [e.payload for e in got] == [e.payload for e in want]
    assert [e.is_last for e in got] == [e.is_last for e in want]
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        ga, wa = getattr(g, "arrays", None) or {}, getattr(w, "arrays", None) or {}
        assert sorted(ga) == sorted(wa)
        for name in wa:
            assert ga[name].shape == wa[name].shape and ga[name].dtype == wa[name].dtype, name
            np.testing.assert_allclose(ga[name], wa[name], rtol=0, atol=ROW_ATOL, err_msg=name)
            worst = max(worst, float(np.abs(ga[name] - wa[name]).max()))
    return worst


@pytest.mark.parametrize("name", list(CASES))
def test_segments_equal_the_reference_stage(reference, on_vllm, name):
    want = run_one(reference, CASES[name])
    got = run_one(on_vllm, CASES[name])
    worst = assert_same_segments(got, want)
    speaks = name != "text-out"
    assert ("hidden" in (getattr(got[0], "arrays", None) or {})) == speaks
    if speaks:
        assert got[0].arrays["hidden"].shape[0] == got[0].payload["prompt_tokens"]
    print(f"{name}: {len(got)} tokens, rows at most {worst:.2e} apart")


def test_requests_at_once_get_their_own_rows(reference, on_vllm):
    """Six requests in the engine together, their prompts in chunks of at most 64
    tokens a step beside the others' decodes: each one's rows by its own positions."""
    requests = [TEXT, MEDIA, SAY, QUIET, IMAGE, {**TEXT, "prompt": "tell me more"}]
    want = [run_one(reference, r) for r in requests]
    got = run_at_once(on_vllm, requests)
    for g, w in zip(got, want, strict=True):
        assert_same_segments(g, w)
    assert not on_vllm.model.tap.watched
    assert not on_vllm.model.engine.engine.has_unfinished_requests()


def test_preempted_requests_keep_their_rows(model, reference, monkeypatch):
    """A KV cache of 16 blocks (448 tokens) for four requests of ~300 tokens each: vLLM
    preempts some and recomputes them later, and the rows stay each request's own."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted = []
    preempt = Scheduler._preempt_request
    monkeypatch.setattr(
        Scheduler,
        "_preempt_request",
        lambda self, request, *a, **k: (
            preempted.append(request.request_id) or preempt(self, request, *a, **k)
        ),
    )
    small = {**ENGINE_ARGS, "max_model_len": 448, "kv_cache_memory_bytes": 16 * 32 * 1024}
    stage = _stage(model, engine="vllm", engine_args=small)
    try:
        requests = [
            {"prompt": f"request {k}: say something about {k * 7}", "max_tokens": 120}
            for k in range(4)
        ]
        requests = [{**r, "ignore_eos": True} for r in requests]
        got = run_at_once(stage, requests)
        assert preempted  # the case this test is for
        for g, r in zip(got, requests, strict=True):
            assert_same_segments(g, run_one(reference, r))
    finally:
        stage.model.close()


def test_a_closed_request_leaves_nothing(on_vllm):
    """Cancelled after two segments: vLLM's request is aborted, the tap forgets it."""
    gen = on_vllm.process([_input({**TEXT, "max_tokens": 50})])
    seen = [e for e in (next(gen) for _ in range(8)) if e is not None]
    assert seen and on_vllm.model.tap.watched
    gen.close()
    assert not on_vllm.model.tap.watched
    assert not on_vllm.model.engine.engine.has_unfinished_requests()


def test_refused_request_fails_alone(on_vllm):
    """A prompt over vLLM's max_model_len is refused as it enters: that request fails."""
    long = {"prompt": "hello there " * 400, "max_tokens": 4}
    bad, good = run_at_once(on_vllm, [long, TEXT])
    assert len(bad) == 1 and "vLLM refused the request" in bad[0].message, bad
    assert "maximum context length is 1024" in bad[0].message, bad[0].message
    assert all(hasattr(e, "tokens") for e in good) and good[-1].is_last


def _pipeline(model: str, thinker: dict) -> dict:
    talker = {"model": model, "max_codes": 48, "sampling": {"do_sample": False}}
    kinds = {
        "thinker": ("speech.thinker", {"model": model, **thinker}),
        "talker": ("speech.talker", talker),
        "token2wav": ("speech.token2wav", {"model": model}),
    }
    return {
        "name": "speech_vllm_test",
        "ready_timeout_s": 120,
        "mrs": {"enabled": False},
        "stages": [
            {"name": name, "kind": kind, "client_stream": True, "options": options}
            for name, (kind, options) in kinds.items()
        ],
        "edges": [
            {"from": "thinker", "to": "talker", "window": {"size": 1}},
            {"from": "talker", "to": "token2wav", "window": {"size": 1}},
        ],
    }


def _spoken(result: Any) -> tuple[list, list, np.ndarray]:
    assert result.ok, result.error
    text = [t for e in result.by_stage("thinker") for t in e.tokens or []]
    codes = [t for e in result.by_stage("talker") for t in e.tokens or []]
    audio = [e.arrays["audio"] for e in result.by_stage("token2wav") if "audio" in e.arrays]
    return text, codes, np.concatenate(audio) if audio else np.zeros(0, np.float32)


@pytest.fixture(scope="module")
def spoken_reference(model: str) -> list[tuple[list, list, np.ndarray]]:
    with Pipeline(_pipeline(model, {})) as p:
        return [_spoken(r) for r in p.generate(copy.deepcopy([TEXT, MEDIA]))]


@pytest.mark.parametrize("workers", [False, True], ids=["inline", "workers"])
def test_talker_codes_and_waveform_equal_behind_either_thinker(model, spoken_reference, workers):
    """The whole pipeline, greedy talker, inline and in worker processes: the vLLM
    thinker's rows give the talker the same codes, and token2wav the same waveform."""
    config = _pipeline(model, {"engine": "vllm", "engine_args": ENGINE_ARGS})
    config["mrs"] = {"enabled": workers}
    with Pipeline(config) as p:
        got = [_spoken(r) for r in p.generate(copy.deepcopy([TEXT, MEDIA]))]
    want = spoken_reference
    for (text, codes, wav), (want_text, want_codes, want_wav) in zip(got, want, strict=True):
        assert len(want_codes) > 16  # the comparison means something
        assert (text, codes) == (want_text, want_codes)
        assert wav.shape == want_wav.shape
        np.testing.assert_allclose(wav, want_wav, rtol=0, atol=1e-5 * np.abs(want_wav).max())


# -- the cost of the rows (OMNI_SPEECH_FIGURES=1, -s) ----------------------------------------
def _timed(stage: Thinker, requests: list[dict], at_once: bool) -> tuple[int, float]:
    """(tokens, seconds) of the requests."""
    start = time.perf_counter()
    outs = run_at_once(stage, requests) if at_once else [run_one(stage, r) for r in requests]
    tokens = sum(len(e.tokens) for out in outs for e in out if hasattr(e, "tokens"))
    return tokens, time.perf_counter() - start


@pytest.mark.skipif(not os.environ.get("OMNI_SPEECH_FIGURES"), reason="OMNI_SPEECH_FIGURES=1")
def test_figures_rows_cost(model, reference, on_vllm, monkeypatch):
    """Thinker tokens/s, eight requests of 64 tokens one at a time and all at once: vLLM
    with the talker's rows, without them (text out), without them but not reading the
    prefix cache either (as a speaking request does), and transformers with rows. The
    arms take turns, nine rounds, each arm's median and best round printed (the machine
    is shared); and the time the rows themselves take (the tap's copies, the segments'
    rows), summed over the vLLM arm with rows."""
    import platform
    import statistics

    import torch
    from omni_speech.vllm_thinker import RowTap, VllmThinker

    spent = {"rows": 0.0}

    def clocked(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["rows"] += time.perf_counter() - start

        return run

    monkeypatch.setattr(RowTap, "_copy", clocked(RowTap._copy))
    monkeypatch.setattr(VllmThinker, "_arrays", clocked(VllmThinker._arrays))
    params = VllmThinker._params
    unread = {"on": False}
    monkeypatch.setattr(
        VllmThinker,
        "_params",
        lambda self, stage, ti, n, speak: params(self, stage, ti, n, speak or unread["on"]),
    )
    prompts = [f"request {k}: say something about the number {k * 7}" for k in range(8)]
    speak = [{"prompt": p, "max_tokens": 64, "ignore_eos": True} for p in prompts]
    quiet = [{**r, "modalities": ["text"]} for r in speak]
    arms = {
        "vllm, rows": (on_vllm, speak, False),
        "vllm, no rows": (on_vllm, quiet, False),
        "vllm, no rows, prefix cache unread": (on_vllm, quiet, True),
        "transformers, rows": (reference, speak, False),
    }
    for stage in (reference, on_vllm):
        run_one(stage, speak[0])  # warm
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    print(
        f"\nthinker tokens/s, tiny Qwen2.5-Omni (hidden 128, 2 layers), fp32, "
        f"{names[0] if names else platform.processor()}, torch threads "
        f"{torch.get_num_threads()}, OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS')}"
    )
    for at_once in (False, True):
        rates: dict[str, list[float]] = {name: [] for name in arms}
        rows_s = total_s = 0.0
        for _ in range(9):
            for name, (stage, requests, skip) in arms.items():
                unread["on"] = skip
                spent["rows"] = 0.0
                tokens, seconds = _timed(stage, requests, at_once)
                rates[name].append(tokens / seconds)
                if name == "vllm, rows":
                    rows_s, total_s = rows_s + spent["rows"], total_s + seconds
        unread["on"] = False
        mode = "8 at once" if at_once else "one at a time"
        for name, rs in rates.items():
            print(
                f"  {mode:13}  {name:36} {statistics.median(rs):6.0f} tokens/s median, "
                f"{max(rs):6.0f} best"
            )
        print(f"  {mode:13}  the rows' own time: {100 * rows_s / total_s:.1f}% of the rows arm's")
