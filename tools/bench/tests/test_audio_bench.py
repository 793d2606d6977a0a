"""``omni bench audio`` run tiny: both arms, the JSON's shape and the no-loss check (figures
are not asserted: shared machines are noisy); the loss check itself on doctored streams."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("omni_speech")


def stream(sizes: list[int], rate: int = 24000) -> list[Any]:
    """A request's token2wav chunks (offsets as token2wav sets them) and the audio stage's
    bytes of them, as the caller receives both."""
    from omni_speech.audio import AudioEncoder

    enc = AudioEncoder("wav", rate)
    events, offset = [], 0
    for k, n in enumerate(sizes):
        wave = np.sin(np.arange(offset, offset + n) / 7).astype(np.float32)
        payload = {"sample_rate": rate, "offset": offset}
        events.append(SimpleNamespace(stage="token2wav", arrays={"audio": wave}, payload=payload))
        data = enc.add(wave) + (enc.finish() if k == len(sizes) - 1 else b"")
        events.append(SimpleNamespace(stage="audio", arrays={"audio": data}, payload={}))
        offset += n
    return events


def test_the_loss_check_finds_a_lost_or_reordered_chunk():
    from omni_bench.audio import intact

    good = stream([480, 960, 480, 0])
    assert intact(good, "token2wav") == (1920, 24000, True)
    assert intact(good, "mel2wav")[2] is False  # not the stage that spoke
    lost = [e for k, e in enumerate(good) if k != 2]  # token2wav's second chunk
    assert not intact(lost, "token2wav")[2]
    swapped = [good[2], good[1], good[0], *good[3:]]
    assert not intact(swapped, "token2wav")[2]
    short = [e for k, e in enumerate(good) if k != 3]  # the audio stage's second bytes
    assert not intact(short, "token2wav")[2]


def test_audio_bench_keys(tmp_path, monkeypatch, bench_json):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))  # the tiny model built here
    r = bench_json(
        "audio",
        ["--requests", "2", "--concurrency", "1,2", "--max-tokens", "8", "--max-codes", "40"],
        timeout_s=600,
    )
    assert isinstance(r["cpu_model"], str) and r["concurrency"] == [1, 2]
    assert r["no_audio_lost"] is True
    # the same codes (sampled from each request's seed) in both arms: as many samples
    assert r["audio_samples_match_baseline"] is True
    levels = [r["staged"]["c1"], r["staged"]["c2"]]
    levels += [r["baseline"]["sequential"]["c1"], r["baseline"]["sequential"]["c2"]]
    levels += [r["baseline"]["batched"]["c2"], r["baseline"]["batched_1_thread"]["c2"]]
    for lv in levels:
        assert lv["requests"] == 2 and lv["audio_s"] > 0 and lv["wall_s"] > 0
        assert 0 < lv["ttfa_ms"]["p50"] <= lv["latency_ms"]["p50"]
        assert lv["ttfa_ms"]["p50"] <= lv["ttfa_ms"]["p95"]
        assert lv["rtf"]["p50"] > 0 and lv["throughput_audio_s_per_s"] > 0
    speaking = {"thinker": 1, "talker": 1, "code2mel": 1, "mel2wav": 1}
    assert r["staged"]["torch_threads_by_stage"] == speaking
    assert set(r["staged"]["c2"]["cpu_s_by_process"]) >= set(speaking)
    assert set(r["baseline"]["batched"]["c2"]["seconds_by_part"]) == {
        "thinker",
        "talker",
        "token2wav",
    }
    ratios = r["ratios"]
    for key in (
        "ttfa_p50_vs_baseline_latency_p50_c1",
        "ttfa_p50_vs_baseline_latency_p50_c2",
        "throughput_vs_baseline_default_c2",
        "throughput_vs_baseline_best_c2",
    ):
        assert ratios[key] > 0, key
    assert ratios["baseline_best"] in ("sequential", "batched", "batched_1_thread")
    assert len(r["targets_met"]) == 3
    assert all(isinstance(v, bool) for v in r["targets_met"].values())
