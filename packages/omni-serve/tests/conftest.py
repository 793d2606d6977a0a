"""Real servers for the tests: ``omni serve`` started as a subprocess on 127.0.0.1 (any
free port) over tiny pipelines, once per test session each, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

# dtype auto runs text models in float32 here, as the tests' references are, whatever the
# CPU (its workers inherit this); OMNI_CPU_BF16=1 runs them as a BF16 CPU would
os.environ.setdefault("OMNI_CPU_BF16", "0")

OMNI = "import sys; from omni_core.cli import main; sys.exit(main())"
START_TIMEOUT_S = 240


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10)


def start_server(config: dict[str, Any] | Path, where: Path, *args: str) -> Server:
    """``omni serve`` of ``config`` (a YAML file, or a dict written as YAML: JSON is YAML)
    once it is healthy."""
    if isinstance(config, Path):
        cfg = config
    else:
        cfg = where / "pipeline.yaml"
        cfg.write_text(json.dumps(config))
    log_path = where / "server.log"
    env = {**os.environ, "OMNI_CACHE_DIR": str(where / "cache")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", OMNI, "serve", str(cfg), "--port", "0", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    end = time.monotonic() + START_TIMEOUT_S
    url = None
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"omni serve exited ({proc.returncode}):\n{log_path.read_text()}")
        m = re.search(r"listening on (http://\S+)", log_path.read_text(errors="replace"))
        if m:
            url = m.group(1)
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return Server(url, proc, log_path)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    stop_server(Server(url or "", proc, log_path))
    raise AssertionError(f"omni serve did not become healthy:\n{log_path.read_text()}")


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("transformers")
    from omni_ar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_dit(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip(
        "diffusers", reason="needs the DiT family (omni-dit-stages); runs in the workspace"
    )
    from omni_dit import embedded

    path = tmp_path_factory.mktemp("tiny-sd3")
    embedded.build_tiny_sd3(path, conditioning_width=64)  # the tiny Llama's hidden size
    return str(path)


def ar_stages(model: str) -> list[dict[str, Any]]:
    opts = {"model": model, "threads": 1}
    return [
        {
            "name": "intake",
            "kind": "ar.intake",
            "options": {"model": model, "max_prompt_tokens": 64},
        },
        {"name": "prefill", "kind": "ar.prefill", "options": opts},
        {"name": "decode", "kind": "ar.decode", "options": {**opts, "max_segment_tokens": 2}},
        {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": model}},
    ]


def chained(name: str, stages: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    """Stages in a chain; decode -> postprocess token by token, as configs/ar_chat_split.yaml."""
    names = [s["name"] for s in stages]
    edges = [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)]
    for e in edges:
        if e["from"] == "decode":
            e["window"] = {"size": 1}
    return {"name": name, "heartbeat_interval_s": 0.1, "stages": stages, "edges": edges, **top}


@pytest.fixture(scope="session")
def text_server(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """ar_chat on the tiny Llama (intake -> prefill -> decode -> postprocess)."""
    server = start_server(
        chained("tiny_chat", ar_stages(tiny_llama)),
        tmp_path_factory.mktemp("text-server"),
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(text_server: Server) -> Any:
    """The ``openai`` client on :func:`text_server` (a module that drives another server
    defines its own ``client``, which overrides this one)."""
    import openai

    return openai.OpenAI(base_url=f"{text_server.url}/v1", api_key="unused", max_retries=0)


def mixed_config(name: str, tiny_llama: str, tiny_dit: str, **top: Any) -> dict[str, Any]:
    """The mixed pipeline on tiny models: the Llama writes the prompt (streamed), encodes
    it, and the tiny SD3 paints it with a preview every step (64 x 64, 4 steps)."""
    from omni_dit.testing import dit_config

    dit = dit_config(tiny_dit, width=64)["stages"][1:]  # plan, sample, vae, encode
    dit[0]["options"]["image_defaults"] = {"width": 64, "height": 64, "steps": 4}
    dit[0]["options"]["image_defaults"]["preview_every"] = 1
    encoder = {
        "name": "text",
        "kind": "ar.text_encode",
        "options": {"model": tiny_llama, "threads": 1, "max_tokens": 16},
    }
    stages = ar_stages(tiny_llama)
    stages[-1]["client_stream"] = True  # the expanded prompt, as text
    return chained(name, [*stages, encoder, *dit], **top)


@pytest.fixture(scope="session")
def image_server(
    tiny_llama: str, tiny_dit: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """:func:`mixed_config`'s pipeline, served."""
    config = mixed_config("tiny_mixed", tiny_llama, tiny_dit)
    server = start_server(config, tmp_path_factory.mktemp("image-server"), "--max-images", "2")
    yield server
    stop_server(server)


def intake_then(name: str, model: str, *stages: dict[str, Any]) -> dict[str, Any]:
    """``ar.intake`` (so the server offers the text endpoints) then synthetic stages: the
    intake checks and tokenizes the request, the synthetic stages stand in for a model
    (slow, failing) and send no text (an answer's text is empty)."""
    intake = {
        "name": "intake",
        "kind": "ar.intake",
        "options": {"model": model, "max_prompt_tokens": 64},
    }
    return chained(name, [intake, *stages])


def slow(hold_s: float) -> dict[str, Any]:
    """A stage that holds each request ``hold_s`` (it cannot be interrupted)."""
    return {"name": "slow", "kind": "synthetic.sleep", "options": {"hold_s": hold_s}}


@pytest.fixture(scope="session")
def boom_server(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """intake -> a stage that raises on every request (``KeyError: 'expect'``)."""
    boom = {"name": "boom", "kind": "synthetic.rendezvous", "options": {}}
    s = start_server(intake_then("boom", tiny_llama, boom), tmp_path_factory.mktemp("boom"))
    yield s
    stop_server(s)


@pytest.fixture
def image_host(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A local HTTP server of the files in a folder: (its URL, ``cat.png`` in it, a
    synthetic image; anything missing answers 404)."""
    import functools
    import http.server
    import threading

    from omni_ar.multimodal.testing import synthetic_image

    (tmp_path / "cat.png").write_bytes(synthetic_image(0))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", tmp_path / "cat.png"
    httpd.shutdown()
    httpd.server_close()
