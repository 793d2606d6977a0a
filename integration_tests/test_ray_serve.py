"""``omni serve --backend ray`` on a simulated two-node cluster (three nodes: the one that
hosts decode and postprocess is removed and replaced), driven by the real ``openai``
client: chat (whole and streamed) over the tiny Llama split across nodes, ``/health`` 503
while that node is gone, and the stages restarting on the replacement node, serving the
same text again; and images (whole and streamed with previews) from the tiny SD3 with its
sampler and VAE on the other node."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="ray is not installed")
pytest.importorskip("transformers", reason="the transformers engine extra is not installed")

import httpx  # noqa: E402
import openai  # noqa: E402
from omni_ray.testing import add_node, on, simulated_cluster, split_ar_config  # noqa: E402

OMNI = "import sys; from omni_core.cli import main; sys.exit(main())"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from omni_ar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def chat_config(model: str) -> dict:
    return {
        "name": "tiny_chat",
        "heartbeat_interval_s": 0.1,
        **split_ar_config(model, far="node_c", window=1, restart_backoff_s=0.2),
    }


def start_server(config: dict, where: Path, address: str) -> tuple[subprocess.Popen, str, Path]:
    cfg = where / "pipeline.yaml"
    cfg.write_text(json.dumps(config))  # JSON is YAML
    log_path = where / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OMNI_CACHE_DIR"] = str(where / "cache")
    args = ["serve", str(cfg), "--port", "0", "--backend", "ray", "--address", address]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", OMNI, *args], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    end = time.monotonic() + 180
    while time.monotonic() < end:
        text = log_path.read_text(errors="replace")
        if proc.poll() is not None:
            raise AssertionError(f"omni serve exited ({proc.returncode}):\n{text[-5000:]}")
        m = re.search(r"listening on (http://\S+)", text)
        if m:
            return proc, m.group(1), log_path
        time.sleep(0.2)
    stop(proc)
    raise AssertionError(f"omni serve did not start:\n{log_path.read_text()[-5000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_health(url: str, status: int, timeout_s: float) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{url}/health", timeout=10)
        if r.status_code == status:
            return r.json()
        assert time.monotonic() < end, (status, r.status_code, r.text)
        time.sleep(0.1)


def stage_nodes() -> dict[str, str]:
    """Where each stage's live actor runs (asked of the actors themselves)."""
    import ray

    nodes = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        m = re.fullmatch(r"omni-[0-9a-f]+-(\w+)-[0-9a-f]{6}", a["name"])
        if m is None:
            continue
        try:
            actor = ray.get_actor(a["name"], namespace=a["namespace"])
            nodes[m.group(1)] = ray.get(actor.where.remote(), timeout=10)["node"]
        except (ValueError, ray.exceptions.RayError):
            continue  # an earlier life, gone
    return nodes


def chat(client: openai.OpenAI) -> str:
    full = client.chat.completions.create(
        model="tiny_chat", messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert full.usage.completion_tokens == 10
    text = full.choices[0].message.content
    assert text
    stream = client.chat.completions.create(
        model="tiny_chat", messages=MESSAGES, max_tokens=10, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([d for d in deltas if d]) > 1  # it streamed, across the nodes
    assert "".join(deltas) == text
    return text


def test_omni_serve_on_a_ray_cluster_chats_and_survives_a_node(tiny_model, tmp_path):
    with simulated_cluster(nodes=2, num_cpus=4) as cluster:
        node_c = add_node(cluster, "node_c", num_cpus=4)
        proc, url, log = start_server(chat_config(tiny_model), tmp_path, cluster.address)
        try:
            wait_health(url, 200, 180)
            where = stage_nodes()
            assert where["intake"] == where["prefill"] == cluster.head_node.node_id
            assert where["decode"] == where["postprocess"] == node_c.node_id
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            before = chat(client)

            cluster.remove_node(node_c)  # decode and postprocess go with it
            body = wait_health(url, 503, 60)
            assert body["status"] == "unhealthy"
            assert body["stages"]["decode"]["state"] != "ready", body

            replacement = add_node(cluster, "node_c", num_cpus=4)
            body = wait_health(url, 200, 180)  # restarted on the replacement node
            assert body["stages"]["decode"]["restarts"] >= 1
            where = stage_nodes()
            assert where["decode"] == where["postprocess"] == replacement.node_id
            assert chat(client) == before
        except BaseException:
            print(log.read_text(errors="replace")[-8000:])
            raise
        finally:
            stop(proc)


def image_config(model: str) -> dict:
    """The tiny SD3 (hash text encoder, 3 steps, a preview each): text, plan and encode on
    ``node_a``, sample and vae on ``node_b``, so latents and the image cross nodes."""
    from omni_dit.testing import dit_config

    cfg = dit_config(
        model,
        image_defaults={"width": 64, "height": 64, "steps": 3, "preview_every": 1},
        name="tiny_images",
    )
    for st in cfg["stages"]:
        st.update(on("node_b" if st["name"] in ("sample", "vae") else "node_a"))
    return cfg


def test_omni_serve_on_a_ray_cluster_paints_images(tmp_path):
    pytest.importorskip("diffusers", reason="needs the DiT family (omni-dit-stages)")
    from omni_dit import embedded
    from PIL import Image

    model = tmp_path / "tiny-sd3"
    embedded.build_tiny_sd3(model, conditioning_width=32)  # dit_config's hash width
    with simulated_cluster(nodes=2, num_cpus=4) as cluster:
        proc, url, log = start_server(image_config(str(model)), tmp_path, cluster.address)
        try:
            wait_health(url, 200, 180)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            full = client.images.generate(
                model="tiny_images", prompt="a red fox", size="64x64", response_format="b64_json"
            )
            (item,) = full.data
            img = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
            assert img.size == (64, 64)
            events = list(
                client.images.generate(model="tiny_images", prompt="a red fox", stream=True)
            )
            assert events[-1].type == "image_generation.completed"
            assert events[-1].b64_json == item.b64_json  # the same image, bit for bit
            partials = [e for e in events if e.type == "image_generation.partial_image"]
            assert 1 <= len(partials) <= 2  # a preview after each step but the last (droppable)
        except BaseException:
            print(log.read_text(errors="replace")[-8000:])
            raise
        finally:
            stop(proc)
