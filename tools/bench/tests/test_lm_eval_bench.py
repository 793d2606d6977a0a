"""``omni bench lm-eval`` without lm-eval or servers: the tasks it writes are lm-eval's
YAML over data that parses, the comparison reads lm-eval's samples as lm-eval writes
them, and a missing lm-eval is a clear error, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from omni_bench import evals


def test_the_tasks_are_lm_evals_yaml_over_their_data(tmp_path):
    evals.write_tasks(tmp_path)
    ll = yaml.safe_load((tmp_path / "capitals_ll.yaml").read_text())
    gen = yaml.safe_load((tmp_path / "capitals_gen.yaml").read_text())
    assert ll["task"] == "capitals_ll" and ll["output_type"] == "multiple_choice"
    assert gen["task"] == "capitals_gen" and gen["output_type"] == "generate_until"
    data = ll["dataset_kwargs"]["data_files"]["test"]
    rows = [json.loads(x) for x in Path(data).read_text().splitlines()]
    assert len(rows) == len(evals.CAPITALS)
    for row, (country, city) in zip(rows, evals.CAPITALS, strict=True):
        assert row["country"] == country and row["choices"][row["gold"]] == city
        assert len(set(row["choices"])) == 4
    assert {r["gold"] for r in rows} == {0, 1, 2, 3}  # the gold answer moves


def sample(doc_id, resps):
    return {"doc_id": doc_id, "resps": resps}


def test_the_comparison_reads_each_requests_loglikelihood_and_each_generation():
    def run(lls, gens, acc):
        return {
            "scores": {"capitals_ll": acc, "capitals_gen": 1.0},
            "samples": {
                "capitals_ll": [sample(0, [[[x, True]] for x in lls])],
                "capitals_gen": [sample(i, [[g]]) for i, g in enumerate(gens)],
            },
        }

    omni = run([-1.0, -2.5], ["Paris", "Rome"], 1.0)
    vllm = run([-1.0004, -2.5], ["Paris", "Roma"], 1.0)
    out = evals.compare(omni, vllm)
    assert out["equal_scores"] and out["loglikelihood_requests"] == 2
    assert abs(out["max_abs_loglik_diff"] - 0.0004) < 1e-9
    assert out["generations_same"] == "1 of 2"
    assert not evals.compare(run([-1.0], ["x"], 0.5), run([-1.0], ["x"], 1.0))["equal_scores"]


def test_without_lm_eval_it_says_how_to_get_it(capsys, tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    assert evals.main(["--lm-eval", str(python)]) == 2
    assert 'install "lm-eval[api]"' in capsys.readouterr().err


def test_an_unknown_arm_is_refused_before_anything_starts(capsys):
    assert evals.main(["--arms", "completions,beam"]) == 2
    assert "unknown ['beam']" in capsys.readouterr().err


def test_the_chat_arm_compares_generations_only():
    """``local-chat-completions`` gives no log-likelihoods: its comparison has none."""

    def run(gens):
        samples = {"capitals_gen": [sample(i, [[g]]) for i, g in enumerate(gens)]}
        return {"scores": {"capitals_gen": 0.5}, "samples": samples}

    out = evals.compare(run(["Paris", "Rome"]), run(["Paris", "Rome"]))
    assert out["equal_scores"] and out["loglikelihood_requests"] == 0
    assert out["generations_same"] == "2 of 2"
    assert evals.ARMS["chat"].tasks == ("capitals_gen",)
    assert "--apply_chat_template" in evals.ARMS["chat"].flags


def test_a_batch_size_below_one_is_refused(capsys):
    assert evals.main(["--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err
