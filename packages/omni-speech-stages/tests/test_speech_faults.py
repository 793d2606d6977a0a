"""SIGKILL and SIGSTOP of each speech stage (thinker, talker, code2mel, mel2wav, audio) in the
middle of a request, in worker processes: configs/omni_speech.yaml on the tiny model.

What the runtime promises (docs/failure-model.md), as each case checks it:

* The request the stage holds (its stream through the stage not yet whole downstream)
  ends with one ``error`` naming the stage: ``stage_died`` with the signal at once for a
  SIGKILL; ``stage_hung`` once ``stall_timeout_s`` passes for a SIGSTOP ("sent no
  heartbeat", or "busy on one step" where it was stopped inside one), after which the
  frozen worker is killed.
* A request that had already gone past the stage (its stream through the stage ended and
  received by every stage after it) goes on: it completes, its audio whole and in order.
  Checked for the thinker and the talker, with a
  request still speaking in token2wav's halves (for those and audio such a request has
  next to nothing left to do). Every other request open at the fault that the stage might
  still hold fails like the first: the runtime cannot know what died in its buffers.
* A request submitted right after the fault, while the stage restarts, completes once it
  is back, its audio whole and in order.
* Health tells the truth: while a stage is frozen it is ``unresponsive``, and from its
  death until its restart is ready it is ``hung``/``restarting``/``starting``; meanwhile
  the stage is ``failed`` in ``stage_health()``, ``pipe.healthy`` is false and ``/health``
  answers 503 ``unhealthy``; then it is ``ready`` again with one more restart and a new
  pid, and ``/health`` answers 200 ``ok``.

"Mid-request" is when the caller has seen the stage's first event of the request
(the model stages stream to the caller here for that), and the request
holds the stage for seconds after it: a reply of 2000 tokens keeps the thinker busy and
the talker's stream open (it ends only after the thinker's); a two-token reply makes the
talker speak ~180 codes, which keep code2mel, mel2wav and the audio encoder busy for
seconds.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from omni_core import Pipeline, load_config
from omni_core.client.collector import RequestHandle
from omni_core.control.request_table import RequestTable
from omni_speech.audio import encode_whole, finalize_wav
from omni_testing.faults import kill_stage, stopped, wait_for, wait_ready

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "omni_speech.yaml"
SPEECH_STAGES = ("thinker", "talker", "code2mel", "mel2wav", "audio")
WAVE = "mel2wav"  # the stage that speaks samples
# the speech stages' stall_timeout_s: a frozen one is killed after it. code2mel's step
# (a window of up to 132 codes through the DiT) and mel2wav's (its 192 frames through
# the vocoder) take ~0.4 s on an idle core and several seconds on a loaded one; the
# others' steps take milliseconds
STALL_S = {"thinker": 3.0, "talker": 3.0, "code2mel": 12.0, "mel2wav": 12.0, "audio": 3.0}

# holds the thinker for seconds; the talker's stream stays open until the thinker's ends
LONG_TEXT = {"prompt": "tell me a long story", "max_tokens": 2000, "ignore_eos": True, "seed": 1}
# a two-token reply: the talker speaks ~180 codes, the halves of token2wav and audio
# work for seconds
LONG_SPEECH = {"prompt": "say hello", "max_tokens": 2, "ignore_eos": True, "seed": 1}
SHORT = {"prompt": "hi", "max_tokens": 4, "seed": 2}
HOLDS = {"thinker": LONG_TEXT, "talker": LONG_TEXT} | dict.fromkeys(
    ("code2mel", "mel2wav", "audio"), LONG_SPEECH
)


def fault_config(model: str) -> dict[str, Any]:
    """The shipped config in worker processes on ``model``, with short heartbeats and
    stall timeouts, and the inner speech stages streamed to the caller too."""
    cfg = msgspec.to_builtins(load_config(CONFIG))
    cfg["mrs"]["enabled"] = True
    cfg["heartbeat_interval_s"] = 0.1
    for st in cfg["stages"]:
        if "model" in st["options"]:
            st["options"]["model"] = model
        if st["name"] in SPEECH_STAGES:
            st["stall_timeout_s"] = STALL_S[st["name"]]
        if st["name"] in ("thinker", "talker", "code2mel", WAVE):
            st["client_stream"] = True
    return cfg


@pytest.fixture(scope="module")
def pipe(tiny_omni: str):
    with Pipeline(fault_config(tiny_omni)) as p:
        # the request that holds code2mel, mel2wav and audio is streamed in several chunks
        assert len(whole(list(p.submit(LONG_SPEECH)))) >= 4
        yield p


@pytest.fixture(scope="module")
def http(pipe: Pipeline) -> Any:
    """``/health`` of ``omni serve``'s app over ``pipe`` (None without omni-serve)."""
    try:
        from fastapi.testclient import TestClient
        from omni_serve.app import create_app
        from omni_serve.settings import ServeSettings
    except ImportError:
        return None
    return TestClient(create_app(pipe, ServeSettings(model_name="omni_speech")))


def check_http(http: Any, code: int, stage: str, state: str | tuple[str, ...]) -> None:
    if http is None:
        return
    r = http.get("/health")
    body = r.json()
    assert r.status_code == code, body
    assert body["status"] == ("ok" if code == 200 else "unhealthy")
    assert body["stages"][stage]["state"] in ((state,) if isinstance(state, str) else state)


def whole(events: list[Any]) -> list[Any]:
    """A completed request's waveform chunks, checked whole and in order: each chunk's
    offset is the samples before it, and the audio stage's bytes are one WAV of exactly
    those samples."""
    assert events[-1].event_type == "completed", events[-1]
    chunks = [e for e in events if e.stage == WAVE and "audio" in e.arrays]
    sizes = [e.arrays["audio"].size for e in chunks]
    assert [e.payload["offset"] for e in chunks] == [sum(sizes[:k]) for k in range(len(sizes))]
    assert sum(sizes) > 0
    wave = np.concatenate([e.arrays["audio"] for e in chunks])
    blob = b"".join(bytes(e.arrays["audio"]) for e in events if e.stage == "audio" and e.arrays)
    assert finalize_wav(blob) == encode_whole(wave, "wav", chunks[0].payload["sample_rate"])
    return [c for c in chunks if c.arrays["audio"].size]


def until(handle: RequestHandle, stage: str) -> None:
    """Read ``handle`` until ``stage``'s first event of it."""
    for e in handle:
        assert not e.terminal, f"the request ended before {stage} emitted: {e}"
        if e.stage == stage:
            return
    raise AssertionError("the stream ended without a terminal event")


def went_past(pipe: Pipeline, h: RequestHandle, stage: str) -> bool:
    """``h``'s stream through ``stage`` ended and every stage after it has it: the
    runtime's own test for a request a dead worker leaves alone."""
    downstream = [e.target for e in pipe.config.outbound(stage)]
    return RequestTable._past(h, stage, downstream)


def down(pipe: Pipeline, http: Any, stage: str, states: tuple[str, ...]) -> None:
    """Every view of health says ``stage`` does not serve, in one of ``states``."""
    h = pipe.health()[stage]
    assert not h["healthy"] and h["state"] in states, h
    assert pipe.stage_health()[stage]["state"] == "failed"
    assert not pipe.healthy
    check_http(http, 503, stage, states)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("stage", SPEECH_STAGES)
def test_a_fault_mid_request_fails_that_request_only_and_health_follows(
    pipe: Pipeline, http: Any, stage: str, sig: int
) -> None:
    wait_for(lambda: pipe.healthy, 60, "every stage ready")
    before = pipe.health()[stage]
    check_http(http, 200, stage, "ready")
    past = None
    if stage in ("thinker", "talker"):  # a request through the stage, speaking after it
        past = pipe.submit(LONG_SPEECH)
        wait_for(lambda: went_past(pipe, past, stage), 30, f"a request past {stage}")
    victim = pipe.submit(HOLDS[stage])
    until(victim, stage)
    assert past is None or not past.done  # it is still speaking when the fault comes
    if sig == signal.SIGKILL:
        kill_stage(pipe, stage)
        end = list(victim)[-1]
        assert end.event_type == "error" and end.code == "stage_died", end
        assert "SIGKILL" in end.message
    else:
        with stopped(before["pid"]):
            wait_for(
                lambda: pipe.health()[stage]["state"] == "unresponsive",
                STALL_S[stage],
                f"health to call {stage} unresponsive",
            )
            down(pipe, http, stage, ("unresponsive",))
            end = list(victim)[-1]
        assert end.event_type == "error" and end.code == "stage_hung", end
        assert f"stall_timeout_s={STALL_S[stage]:g}" in end.message
    assert f"stage '{stage}'" in end.message
    down(pipe, http, stage, ("hung", "restarting", "starting"))
    after = pipe.submit(SHORT)  # while the stage restarts
    if past is not None:
        whole(list(past))
    whole(list(after))
    assert wait_ready(pipe, stage, 60)
    now = pipe.health()[stage]
    assert now["healthy"] and now["restarts"] == before["restarts"] + 1
    assert now["pid"] != before["pid"]
    wait_for(lambda: pipe.healthy, 60, "every stage ready")
    check_http(http, 200, stage, "ready")
