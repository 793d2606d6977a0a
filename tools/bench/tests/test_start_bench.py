"""``omni bench start`` runs small: the demo arm, each way started once after a warm-up;
the keys and their sanity, not the figures (shared machines are noisy)."""


def test_start_bench_demo_arm_starts_both_ways(bench_json):
    r = bench_json("start", ["--arms", "demo", "--starts", "1"])
    demo = r["demo"]
    assert demo["ready_s_zygote"] > 0 and demo["ready_s_spawn"] > 0
    assert demo["zygote_vs_spawn_ready"] == round(demo["ready_s_zygote"] / demo["ready_s_spawn"], 3)
    assert set(r["targets"]) == {"ready", "restart", "pss"}
