"""``omni bench priority`` runs small on the synthetic target: two ``synthetic.sleep``
stages, the second holding one request at a time, a load of 8 kept in flight, 3 probes.

With one slot and a queue of 7 load requests ahead, a probe under ``fcfs`` waits behind
the whole queue, and under ``priority`` at most for the request in the slot: that order
is structural, so it is asserted; the absolute figures are not (shared machines are noisy).
"""


def test_priority_probe_passes_the_load_and_nothing_is_lost(bench_json):
    args = ["--configs", "synthetic", "--concurrency", "8", "--hold", "0.05", "--quick"]
    r = bench_json("priority", args)

    s = r["synthetic"]
    assert (s["load_priority"], s["probe_priority"], s["probes"]) == (0, -1, 3)
    for arm in ("idle", "fcfs", "priority"):
        probe = s[arm]["probe"]
        assert (probe["completed"], probe["errors"], probe["lost"]) == (3, 0, 0), (arm, probe)
        for figure in ("ttft", "completion"):
            assert 0 < probe[f"{figure}_ms_p50"] <= probe[f"{figure}_ms_p95"], (arm, probe)
    assert "load" not in s["idle"]
    # synthetic.sleep is not preemptible, and fcfs never preempts
    assert (
        s["idle"]["preemptions"] == s["fcfs"]["preemptions"] == s["priority"]["preemptions"] == {}
    )
    for arm in ("fcfs", "priority"):
        load = s[arm]["load"]
        assert load["completed"] == load["requests"] >= 8, (arm, load)
        assert load["errors"] == load["lost"] == 0, (arm, load)
        assert load["rps"] > 0 and load["tok_per_s"] > 0, (arm, load)

    # fcfs: behind ~7 holds of 50 ms; priority: behind the one in the slot at most
    fcfs, prio = s["fcfs"]["probe"]["ttft_ms_p50"], s["priority"]["probe"]["ttft_ms_p50"]
    assert prio < fcfs, (prio, fcfs)
    assert s["fcfs_probe_ttft_vs_idle"] > s["priority_probe_ttft_vs_idle"] > 0
    assert s["priority_probe_completion_vs_idle"] > 0 and s["fcfs_probe_completion_vs_idle"] > 0
    assert r["targets_met"]["synthetic: lost == 0 and errors == 0"] is True
    assert set(r["targets_met"]) == {
        "synthetic.priority_probe_ttft_vs_idle <= 2.0",
        "synthetic: lost == 0 and errors == 0",
    }
