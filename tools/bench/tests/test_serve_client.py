"""``omni bench serve --client``: the arguments, and vLLM's benchmark client taking the
arguments the bench gives it (its own parser, no server)."""

from __future__ import annotations

import os

import pytest
from omni_bench.serve import parse_args
from omni_bench.serve_load import CLIENTS, SERVED_NAME, vllm_bench_args


def test_client_argument():
    assert parse_args([]).client == "openai" and parse_args([]).input_len == 64
    args = parse_args(["--client", "vllm-bench", "--input-len", "32"])
    assert args.client == "vllm-bench" and args.input_len == 32
    assert set(CLIENTS) == {"openai", "vllm-bench"}
    for bad in (["--client", "sglang"], ["--client", "vllm-bench", "--constraint", "json_schema"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_vllm_clients_own_parser_takes_the_bench_arguments():
    if os.environ.get("CI") is None:
        pytest.importorskip("vllm")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = vllm_bench_args("http://127.0.0.1:9", "/models/tok", 8, 16, 64, 32)
    ns = parser.parse_args(args)
    assert (ns.backend, ns.base_url, ns.endpoint) == (
        "openai",
        "http://127.0.0.1:9",
        "/v1/completions",
    )
    assert (ns.model, ns.tokenizer, ns.dataset_name) == (SERVED_NAME, "/models/tok", "random")
    assert (ns.max_concurrency, ns.num_prompts, ns.ignore_eos) == (8, 16, True)
    assert (ns.input_len, ns.output_len) == (64, 32)  # (its random dataset's lengths)
