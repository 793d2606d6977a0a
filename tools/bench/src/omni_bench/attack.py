"""``omni bench attack``: the runtime under attack, measured (docs/security.md).

Arms, each against a live runtime:

* ``server``: ``omni serve configs/ar_chat.yaml`` with an API key (read from a file) in
  a process of its own, attacked over HTTP (:mod:`omni_bench.attack_server`): a body at
  the size limit while ``/health`` is sampled, slow-loris connections (headers and
  bodies a byte at a time) while normal clients are served.
* ``prompts``, ``connections``, ``image_headers``, ``keys``, ``keys_weighted``: one
  client attacks ``omni serve configs/mm_chat.yaml`` (a keys file: ``normal``,
  ``tiered`` and ``attacker``) while a
  normal client uses it (:mod:`omni_bench.attack_shares`): prompt bodies of several MB,
  hundreds of idle and half-sent connections from one address, PNGs of hundreds of
  thousands of empty chunks, a flood of requests with the attacker's key (against a key
  of the same weight, and against one weighing 3 times as much). Each: the
  normal client's p99 latency under the attack over its idle p99 (``ratio``).
* ``dataplane``: the shared-memory data plane and the cross-node channels
  (:mod:`omni_bench.attack_dataplane`): forged and replayed frames on a cross-node channel
  of a simulated Ray cluster, segment names that point outside ``/dev/shm`` or at a FIFO
  pushed into a worker, a squatted segment name at start.
* ``ray``: forged gateway calls from the other node of a simulated Ray cluster, channels
  off, while a normal client's requests cross the nodes
  (:func:`omni_bench.attack_dataplane.run_ray_gateway_attacks`).

Targets (``passed`` says whether every one held): ``health_p99_ms_during_big_body <= 50``,
every slow-loris connection closed by the server within its deadline, ``served_ratio >=
0.9``, ``ratio <= 2`` in each per-client arm and the ``ray`` arm, the attacker never
answered a 5xx but 503 (nor a 2xx but in the ``keys`` arms), ``forged_accepted == 0``,
``slots_freed_early == 0``, the stages keep serving, and ``lost == 0`` throughout.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

from omni_bench.report import emit, run_arms
from omni_bench.serve import OMNI, Server, free_port

SHARES = ("prompts", "connections", "image_headers", "keys", "keys_weighted")
ARMS = ("server", *SHARES, "dataplane", "ray")
ROOT = Path(__file__).resolve().parents[4]


def serve_command(config: str, port: int, key_file: Path, extra: list[str]) -> list[str]:
    return [
        *OMNI,
        "serve",
        config,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key-file",
        str(key_file),
        *extra,
    ]


def server_arm(args: argparse.Namespace) -> dict[str, Any]:
    from omni_bench.attack_server import run_server_attacks

    with tempfile.TemporaryDirectory(prefix="omni-bench-attack-") as tmp:
        key = secrets.token_urlsafe(24)
        key_file = Path(tmp) / "api-key"
        key_file.write_text(key + "\n")
        key_file.chmod(0o600)
        env = {k: v for k, v in os.environ.items() if k != "OMNI_API_KEY"}
        deadlines = [
            "--header-timeout",
            str(args.header_timeout),
            "--body-timeout",
            str(args.body_timeout),
        ]
        cmd = serve_command(args.config, free_port(), key_file, deadlines + args.serve_args)
        server = Server("omni", cmd, env, Path(tmp) / "serve.log")
        try:
            server.wait_ready(args.ready_timeout)
            return run_server_attacks(server.url, key, args.header_timeout, args.body_timeout)
        except BaseException:
            print(f"omni bench attack: the server's log ends:\n{server.tail()}", file=sys.stderr)
            raise
        finally:
            server.stop()


def dataplane_arm(args: argparse.Namespace) -> dict[str, Any]:
    from omni_bench.attack_dataplane import run_dataplane_attacks

    return run_dataplane_attacks()


def shares_arm(args: argparse.Namespace, server: Any, kind: str) -> dict[str, Any]:
    from omni_bench.attack_shares import TIERED_WEIGHT, run_arm

    specs: dict[str, dict[str, Any]] = {
        "prompts": {"prompt_mb": args.prompt_mb},
        "connections": {"held": args.held_connections, "dribble_s": 1.0},
        "image_headers": {"png_chunks": args.png_chunks},
        "keys": {},
        "keys_weighted": {"normal_weight": TIERED_WEIGHT, "attacker_weight": 1},
    }
    try:
        url, keys = server.get()
        return run_arm(url, keys, kind, specs[kind], args.measure_s)
    except BaseException:
        print(f"omni bench attack: the server's log ends:\n{server.tail()}", file=sys.stderr)
        raise


def ray_arm(args: argparse.Namespace) -> dict[str, Any]:
    from omni_bench.attack_dataplane import run_ray_gateway_attacks

    return run_ray_gateway_attacks(args.measure_s)


def verdict(res: dict[str, Any]) -> list[str]:
    """The targets a result misses (empty: every one held)."""
    missed = []
    srv, dp, ray = res.get("server", {}), res.get("dataplane", {}), res.get("ray", {})
    for name in SHARES:
        part = res.get(name, {})
        checks_of = [
            ("ratio", lambda v: v <= 2),
            ("attacker_5xx", lambda v: v == 0),
            ("lost", lambda v: v == 0),
        ]
        if name not in ("keys", "keys_weighted"):  # (a flood is served within its share)
            checks_of.append(("attacker_2xx", lambda v: v == 0))
        for key, ok in checks_of:
            if part and "error" not in part and (key not in part or not ok(part[key])):
                missed.append(f"{name}.{key}={part.get(key)!r}")
    checks = [
        (ray, "forged_accepted", lambda v: v == 0),
        (ray, "legit_ok", lambda v: v is True),
        (ray, "ratio", lambda v: v <= 2),
        (ray, "lost", lambda v: v == 0),
        (srv, "health_p99_ms_during_big_body", lambda v: v <= 50),
        (srv, "served_ratio", lambda v: v >= 0.9),
        (srv, "slowloris_open_past_deadline", lambda v: v == 0),
        (srv, "lost", lambda v: v == 0),
        (dp, "forged_accepted", lambda v: v == 0),
        (dp, "slots_freed_early", lambda v: v == 0),
        (dp, "lost", lambda v: v == 0),
    ]
    for part, key, ok in checks:
        if part and "error" not in part and (key not in part or not ok(part[key])):
            missed.append(f"{key}={part.get(key)!r}")
    for name, part in res.items():
        if isinstance(part, dict) and "error" in part:
            missed.append(f"{name}: {part['error']}")
    return missed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench attack", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--arms", default=",".join(ARMS), help="any of " + ", ".join(ARMS))
    ap.add_argument("--config", default=str(ROOT / "configs" / "ar_chat.yaml"))
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--header-timeout", type=float, default=10.0, help="the server's (its default)")
    ap.add_argument("--body-timeout", type=float, default=30.0, help="the server's (its default)")
    ap.add_argument(
        "--shares-config",
        default=str(ROOT / "configs" / "mm_chat.yaml"),
        help="the pipeline the per-client arms attack (it must take images)",
    )
    ap.add_argument("--measure-s", type=float, default=8.0, help="each arm's idle and attack")
    ap.add_argument("--prompt-mb", type=float, default=8.0, help="prompts: each body's MB")
    ap.add_argument(
        "--held-connections", type=int, default=512, help="connections: held from one address"
    )
    ap.add_argument(
        "--png-chunks", type=int, default=500_000, help="image_headers: empty chunks per PNG"
    )
    ap.add_argument(
        "--serve-arg",
        dest="serve_args",
        action="append",
        default=[],
        help="one more argument for `omni serve` (repeatable)",
    )
    args = ap.parse_args(argv)
    from omni_bench.attack_shares import SharesServer

    shared = SharesServer(args.shares_config, args.ready_timeout, args.serve_args)
    run = {"server": lambda: server_arm(args)}
    run.update({kind: (lambda k=kind: shares_arm(args, shared, k)) for kind in SHARES})
    run.update({"dataplane": lambda: dataplane_arm(args), "ray": lambda: ray_arm(args)})
    try:
        res, failed = run_arms(args.arms, run, ap.error)
    finally:
        shared.stop()
    missed = verdict(res)
    res["missed"] = missed
    res["passed"] = not missed and not failed
    emit(res, args.json)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
