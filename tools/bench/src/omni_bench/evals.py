"""``omni bench lm-eval``: lm-evaluation-harness, unmodified, against vLLM's own OpenAI
server and ``omni serve`` on the same model, one after the other, on tasks defined here
(no dataset download): the scores side by side, and each log-likelihood lm-eval read
from each server compared request by request.

The tasks (:data:`CAPITALS`, written to a temporary folder as lm-eval's YAML and a JSONL
file): ``capitals_ll``, multiple choice by log-likelihood (``local-completions``: each
choice a completion with ``echo: true, logprobs: 1, max_tokens: 1``, read from the
prompt's logprobs); ``capitals_gen``, greedy generation until a newline or a period,
exact match after a few worked examples. lm-eval runs as its users run it: its CLI, at
its own defaults (:data:`ARMS`): ``local-completions`` on both tasks (its prompts sent
as token ids, ``tokenized_requests`` being its default: the model's tokenizer encodes
them), and ``local-chat-completions`` with ``--apply_chat_template`` on the generation
task (chat models cannot give log-likelihoods), one request at a time
(``num_concurrent=1``), ``--log_samples``. It need not live in this environment
(``--lm-eval PYTHON``: an interpreter that has ``lm-eval[api]``; its dependencies pin
other versions than vLLM's).

omni serves the generated fused pipeline on the vLLM engine (:func:`omni_bench.serve.omni_config`,
``--engine``: or the transformers engine), vLLM its ``api_server`` (as ``omni bench
serve`` starts it, float32, eager). ``equal_scores``: every task's metric the same;
``max_abs_loglik_diff``: the largest difference between the two servers'
log-likelihoods of one request (the target is within noise: 1e-3 x tokens)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Russia", "Moscow"),
    ("China", "Beijing"),
    ("Greece", "Athens"),
    ("Norway", "Oslo"),
    ("Poland", "Warsaw"),
    ("Portugal", "Lisbon"),
    ("Sweden", "Stockholm"),
    ("Austria", "Vienna"),
    ("Ireland", "Dublin"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Cuba", "Havana"),
    ("Chile", "Santiago"),
]
SHOTS = (  # worked examples before each generation question
    "Q: What is the capital of Belgium?\nA: Brussels\n"
    "Q: What is the capital of India?\nA: New Delhi\n"
)
TASKS = ("capitals_ll", "capitals_gen")
METRICS = {"capitals_ll": "acc,none", "capitals_gen": "exact_match,first_word"}


@dataclass(frozen=True)
class Arm:
    """One lm-eval run against a server: its model type, the endpoint, its tasks."""

    model: str  # lm-eval's --model
    path: str  # the server's endpoint
    tasks: tuple[str, ...]
    flags: tuple[str, ...] = ()  # more of lm-eval's CLI flags


ARMS = {
    "completions": Arm("local-completions", "/v1/completions", TASKS),
    "chat": Arm(
        "local-chat-completions",
        "/v1/chat/completions",
        ("capitals_gen",),
        ("--apply_chat_template",),
    ),
}


def write_tasks(folder: Path) -> None:
    """The two tasks' YAML and their data in ``folder`` (lm-eval's ``--include_path``)."""
    cities = [c for _, c in CAPITALS]
    rows = []
    for i, (country, city) in enumerate(CAPITALS):
        wrong = [cities[(i + k) % len(cities)] for k in (3, 7, 11)]
        turn = i % 4  # the gold answer not always first
        choices = ([city, *wrong])[turn:] + ([city, *wrong])[:turn]
        rows.append(
            {"country": country, "answer": city, "choices": choices, "gold": choices.index(city)}
        )
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
    }
    ll = {
        "task": "capitals_ll",
        **common,
        "output_type": "multiple_choice",
        "doc_to_text": "The capital of {{country}} is",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{gold}}",
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc"}],
    }
    gen = {
        "task": "capitals_gen",
        **common,
        "output_type": "generate_until",
        "doc_to_text": SHOTS + "Q: What is the capital of {{country}}?\nA:",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 8, "do_sample": False},
        "filter_list": [
            {
                "name": "first_word",
                "filter": [
                    {"function": "regex", "regex_pattern": r"(\w[\w ]*)", "group_select": 0},
                    {"function": "take_first"},
                ],
            }
        ],
        "metric_list": [{"metric": "exact_match", "ignore_case": True, "ignore_punctuation": True}],
    }
    for task in (ll, gen):  # JSON is YAML
        (folder / f"{task['task']}.yaml").write_text(json.dumps(task, indent=1))


def run_lm_eval(
    python: str,
    url: str,
    tokenizer: str,
    tasks_dir: Path,
    out: Path,
    log: Path,
    arm: Arm,
    batch_size: int = 1,
) -> dict[str, Any]:
    """lm-eval's CLI against one server, as ``arm`` (``batch_size`` prompts a request:
    lm-eval's own batching, a completion of several prompts); (its results, its samples
    by task)."""
    from omni_bench.serve_load import SERVED_NAME

    model_args = ",".join(
        [
            f"base_url={url}{arm.path}",
            f"model={SERVED_NAME}",
            f"tokenizer={tokenizer}",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    cmd = [
        python,
        "-m",
        "lm_eval",
        "--model",
        arm.model,
        "--model_args",
        model_args,
        "--tasks",
        ",".join(arm.tasks),
        "--include_path",
        str(tasks_dir),
        "--output_path",
        str(out),
        "--log_samples",
        *(["--batch_size", str(batch_size)] if batch_size != 1 else []),
        *arm.flags,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(log, "wb") as f:
        r = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if r.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"lm-eval failed ({r.returncode}); its log ends:\n{tail}")
    (results,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    scores = json.loads(Path(results).read_text())["results"]
    samples: dict[str, list[dict[str, Any]]] = {}
    for task in arm.tasks:
        (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        lines = Path(path).read_text().splitlines()
        samples[task] = sorted((json.loads(x) for x in lines), key=lambda s: s["doc_id"])
    return {"scores": {t: scores[t][METRICS[t]] for t in arm.tasks}, "samples": samples}


def compare(omni: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """The two runs of one arm side by side: scores, the largest log-likelihood
    difference of one request (where the arm has log-likelihoods), and how many
    generations are the same text."""
    diffs: list[float] = []
    lls = zip(
        omni["samples"].get("capitals_ll", []), vllm["samples"].get("capitals_ll", []), strict=True
    )
    for a, b in lls:
        for (x, _), (y, _) in zip(
            [r[0] for r in a["resps"]], [r[0] for r in b["resps"]], strict=True
        ):
            diffs.append(abs(float(x) - float(y)))
    gen_o = [s["resps"][0][0] for s in omni["samples"]["capitals_gen"]]
    gen_v = [s["resps"][0][0] for s in vllm["samples"]["capitals_gen"]]
    same = sum(x == y for x, y in zip(gen_o, gen_v, strict=True))
    return {
        "equal_scores": omni["scores"] == vllm["scores"],
        "loglikelihood_requests": len(diffs),
        "max_abs_loglik_diff": max(diffs, default=0.0),
        "generations_same": f"{same} of {len(gen_o)}",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="omni bench lm-eval", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default="smollm2", help="a named model or a model directory")
    ap.add_argument(
        "--lm-eval",
        default=sys.executable,
        help="a Python interpreter with lm-eval[api] installed (default: this one)",
    )
    ap.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    ap.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"lm-eval's model types to run, comma-separated (of {', '.join(ARMS)})",
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="lm-eval's batch_size: prompts a completion request (default 1, lm-eval's)",
    )
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds per server start")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.batch_size < 1:
        print("omni bench lm-eval: --batch-size: at least 1", file=sys.stderr)
        return 2
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        print(f"omni bench lm-eval: --arms: unknown {unknown or 'none'}", file=sys.stderr)
        return 2
    probe = subprocess.run([args.lm_eval, "-c", "import lm_eval, tenacity"], capture_output=True)
    if probe.returncode != 0:
        print(
            f"omni bench lm-eval: {args.lm_eval} cannot import lm_eval: install "
            '"lm-eval[api]" there (a virtual environment of its own: its pins differ from '
            "vLLM's) and pass --lm-eval PATH/bin/python",
            file=sys.stderr,
        )
        return 2
    import yaml
    from omni_ar.models import resolve_model

    from omni_bench.serve import OMNI, SERVED_NAME, Server, free_port, omni_config, vllm_command

    model = str(resolve_model(args.model))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    vllm_env = {
        **base_env,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    cfg = omni_config(model, "fused")
    if args.engine == "transformers":
        for stage in cfg["stages"]:
            stage["options"] = {**stage["options"], "engine": "transformers"}
    runs: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in arms}
    with tempfile.TemporaryDirectory(prefix="omni-bench-lm-eval-") as tmp:
        work = Path(tmp)
        write_tasks(work)
        cfg_path = work / "omni.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        omni_cmd = [*OMNI, "serve", str(cfg_path), "--port", str(free_port())]
        servers = {
            "vllm": (vllm_command(model, free_port()), vllm_env),
            "omni": ([*omni_cmd, "--served-model-name", SERVED_NAME], base_env),
        }
        for name, (cmd, env) in servers.items():
            server = Server(name, cmd, env, work / f"{name}.log")
            try:
                server.wait_ready(args.ready_timeout)
                for arm in arms:
                    out, log = work / f"out-{name}-{arm}", work / f"lm-eval-{name}-{arm}.log"
                    runs[arm][name] = run_lm_eval(
                        args.lm_eval, server.url, model, work, out, log, ARMS[arm], args.batch_size
                    )
            except BaseException:
                print(f"omni bench lm-eval: {name} failed; its log ends:\n{server.tail()}")
                raise
            finally:
                server.stop()
    res: dict[str, Any] = {
        "model": args.model,
        "engine": args.engine,
        "batch_size": args.batch_size,
    }
    for arm in arms:
        run = runs[arm]
        res[arm] = {
            "lm_eval_model": ARMS[arm].model,
            "tasks": list(ARMS[arm].tasks),
            "vllm": run["vllm"]["scores"],
            "omni": run["omni"]["scores"],
            **compare(run["omni"], run["vllm"]),
        }
    res["targets_met"] = all(
        res[a]["equal_scores"] and res[a]["max_abs_loglik_diff"] < 1e-2 for a in arms
    )
    print(json.dumps(res) if args.json else json.dumps(res, indent=2))
    return 0
