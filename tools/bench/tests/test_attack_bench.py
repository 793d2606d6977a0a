"""``omni bench attack`` runs, with short server deadlines and small attacks: what must
hold on any machine (nothing forged accepted, no slot freed early, every slow-loris
connection closed by its deadline, the attacker never answered a 500, nothing lost) is
checked; the timing figures only for their presence (``health_p99_ms_during_big_body <=
50`` and each arm's ``ratio <= 2`` are the bench's targets, not a test's)."""

from __future__ import annotations

import json
import subprocess

import pytest
from omni_bench.serve import OMNI


@pytest.mark.timeout(460)  # the bench's own 400 s
def test_attack_bench_holds_what_must_hold():
    out = subprocess.run(
        [
            *OMNI,
            "bench",
            "attack",
            "--json",
            "--arms",
            "server,dataplane",
            "--header-timeout",
            "2",
            "--body-timeout",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode in (0, 1), out.stderr[-4000:]  # 1: a target missed
    r = json.loads(out.stdout.strip().splitlines()[-1])
    srv, dp = r["server"], r["dataplane"]
    assert "error" not in srv and "error" not in dp, (srv, dp)
    # the server: every big body answered (a 4xx: parsed and refused), every slow-loris
    # connection closed by the server, normal clients answered throughout
    assert set(srv["big_body_statuses"]) <= {400, 413}, srv
    assert srv["health_p99_ms_idle"] > 0 and srv["health_p99_ms_during_big_body"] > 0
    assert srv["slowloris"] == 64 and srv["slowloris_closed"] == 64, srv
    assert srv["slowloris_open_past_deadline"] == 0 and srv["slowloris_max_open_s"] < 6, srv
    assert srv["rps_without_attack"] > 0 and srv["rps_during_slowloris"] > 0, srv
    assert srv["lost"] == 0, srv
    # the data plane: every hostile segment refused, the stage serving on; nothing forged
    # or replayed accepted on the cross-node channel, no slot freed for a forged Release
    assert dp["squatted_start_ok"] and dp["refused"] == dp["attempted"] > 0, dp
    assert dp["sink_same_pid"] and dp["served_after"] > 0 and dp["healthy_after"], dp
    assert dp["forged_accepted"] == 0 and dp["ray_replayed_accepted"] == 0, dp
    assert dp["ray_replay_original_delivered"] and dp["ray_auth_failures"] > 0, dp
    assert dp["slots_freed_early"] == 0 and dp["ray_releases_refused"] > 0, dp
    assert dp["lost"] == 0 and dp["ray_lost"] == 0, dp
    missed = [m for m in r["missed"] if not m.startswith(("health_p99", "served_ratio"))]
    assert not missed, r["missed"]


# what the attacker may be answered in each per-client arm ("none": closed unanswered)
ATTACKER_ANSWERS = {
    "prompts": {"400", "413", "429", "503"},
    "connections": {"400", "408", "429", "431", "503", "none"},
    "image_headers": {"400", "413", "429", "503"},
    "keys": {"200", "429", "503"},  # served within its share, then refused
    "keys_weighted": {"200", "429", "503"},
}


@pytest.mark.timeout(660)  # the bench's own 600 s
def test_attack_bench_per_client_and_ray_arms_refuse_the_attacker_and_lose_nothing():
    arms = [*ATTACKER_ANSWERS, "ray"]
    out = subprocess.run(
        [
            *OMNI,
            "bench",
            "attack",
            "--json",
            "--arms",
            ",".join(arms),
            "--measure-s",
            "2",
            "--prompt-mb",
            "2",
            "--png-chunks",
            "100000",
            "--held-connections",
            "96",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode in (0, 1), out.stderr[-4000:]  # 1: a target missed
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for arm, answers in ATTACKER_ANSWERS.items():
        part = r[arm]
        assert "error" not in part, (arm, part)
        assert part["p99_ms_idle"] > 0 and part["p99_ms_attack"] > 0 and part["ratio"] > 0
        statuses = part["attacker_statuses"]
        assert statuses and set(statuses) <= answers, (arm, statuses)  # never a 500
        assert part["attacker_5xx"] == 0 and sum(statuses.values()) > 0, (arm, part)
        if not arm.startswith("keys"):
            assert part["attacker_2xx"] == 0, (arm, part)
        assert part["lost"] == 0 and part["normal_refused"] == {}, (arm, part)
        assert part["normal_requests"] > 0, (arm, part)
    for arm in ("keys", "keys_weighted"):
        assert r[arm]["attacker_statuses"].get("429", 0) > 0, r[arm]  # past its share
    ray = r["ray"]
    assert "error" not in ray, ray
    assert ray["forged_accepted"] == 0 and ray["accepted_calls"] == [], ray
    assert ray["forged_refused"] == ray["forged_sent"] > 0 and ray["legit_ok"], ray
    assert ray["calls_refused"] > 0 and ray["messages_refused"] > 0, ray
    assert ray["lost"] == 0 and ray["normal_requests"] > 0, ray
    missed = [m for m in r["missed"] if not m.split("=")[0].endswith("ratio")]
    assert not missed, r["missed"]
