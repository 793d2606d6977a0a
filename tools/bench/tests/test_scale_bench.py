"""``omni bench scale`` runs small: the cpu arm (1 then 2 replicas of a CPU-bound stage)
and the kill arm (a replica SIGKILLed under load, restarted), every request completed.

Figures are not asserted (shared machines are noisy); the keys, their sanity and
``lost == 0`` are.
"""


def test_scale_cpu_and_kill_arms_lose_nothing(bench_json):
    args = ["--arms", "cpu,kill", "--requests", "24", "--concurrency", "8"]
    args += ["--kill-before-s", "2", "--kill-after-s", "1", "--restart-limit-s", "30"]
    r = bench_json("scale", args)

    cpu = r["cpu"]
    assert cpu["rps_replicas1"] > 0 and cpu["rps_replicas2"] > 0
    assert cpu["replicas2_vs_1_throughput"] > 0 and isinstance(cpu["target_met"], bool)
    assert cpu["replicas1"]["completed"] == cpu["replicas2"]["completed"] == 24
    # one worker served the single replica; both replicas served with two
    assert cpu["replicas1"]["served_by_pids"] == 1 and cpu["replicas2"]["served_by_pids"] == 2
    assert cpu["lost"] == 0

    kill = r["kill"]
    assert kill["lost"] == 0, kill
    assert kill["completed"] == kill["requests"] > 0
    assert kill["restart_s"] is not None and kill["restart_s"] > 0
    assert kill["states_seen"][-1] == "ready" and kill["restarts"]["work#1"] == 1
    for key in ("rps_before", "rps_during_restart", "rps_after", "during_restart_vs_before"):
        assert kill[key] >= 0, key
    assert r["targets_met"]["lost == 0"] is True
    assert set(r["targets_met"]) == {
        "cpu.replicas2_vs_1_throughput >= 1.7",
        "kill.during_restart_vs_before >= 0.4",
        "lost == 0",
    }
