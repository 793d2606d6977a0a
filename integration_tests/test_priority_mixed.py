"""Priority through the mixed AR + diffusion pipeline (tiny models): while the DiT sampler
(``max_batch_size`` 1) paints a long image, requests of mixed priorities reach its queue
one after another; under ``mrs.defaults.scheduler_policy: priority`` they are painted, and
finish, in (priority, arrival) order, under ``fcfs`` in arrival order. Every request
ends with its image."""

import io

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from omni_core import Pipeline  # noqa: E402
from omni_core.errors import UserInputError  # noqa: E402
from omni_dit import embedded  # noqa: E402
from omni_dit.testing import dit_config  # noqa: E402
from omni_testing.faults import wait_for  # noqa: E402
from PIL import Image  # noqa: E402

# arrival order; ties (-1, 0) keep it under priority
PRIORITIES = {"a": 3, "b": -1, "c": 0, "d": -1, "e": 0}
BLOCKER = {"steps": 100, "width": 256, "height": 256}  # the sampler busy for a while
SMALL = {"steps": 2, "width": 64, "height": 64}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from omni_ar.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sd3")
    embedded.build_tiny_sd3(path, conditioning_width=64)  # the tiny Llama's hidden size
    return str(path)


def mixed(llm, dit, policy):
    """intake -> prefill -> decode -> postprocess -> text (the Llama encodes the prompt it
    wrote) -> plan -> sample -> vae -> encode, every stage under ``policy``."""
    ar = {"model": llm, "threads": 1}
    stages = [
        {"name": "intake", "kind": "ar.intake", "options": {"model": llm}},
        {"name": "prefill", "kind": "ar.prefill", "options": ar},
        {"name": "decode", "kind": "ar.decode", "options": ar},
        {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": llm}},
        {"name": "text", "kind": "ar.text_encode", "options": {**ar, "max_tokens": 8}},
        *dit_config(dit, width=64)["stages"][1:],  # plan, sample, vae, encode
    ]
    names = [s["name"] for s in stages]
    edges = [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)]
    return {
        "heartbeat_interval_s": 0.05,
        "mrs": {"defaults": {"scheduler_policy": policy}},
        "stages": stages,
        "edges": edges,
    }


def received(pipe, stage):
    return pipe.metrics()["stages"][stage]["received"]


def painted_order(pipe, priorities):
    """Submit a blocker, then each of ``priorities`` (id -> priority) once the one before
    reached the sampler (so the submission order is their arrival there) while the
    blocker still samples; the ids in the order their images were made, each request
    checked to end with its image."""
    blocker = pipe.submit({"prompt": "a fox", "max_tokens": 2, "image": BLOCKER}, "blocker")
    wait_for(lambda: received(pipe, "sample") >= 1, 30, "the blocker at the sampler")
    handles = {}
    for i, (rid, p) in enumerate(priorities.items()):
        request = {"prompt": f"a cat {rid}", "max_tokens": 2, "image": SMALL}
        handles[rid] = pipe.submit(request if p == 0 else {**request, "priority": p}, rid)
        wait_for(lambda i=i: received(pipe, "sample") >= i + 2, 30, f"{rid} at the sampler")
    assert pipe.metrics()["stages"]["sample"]["completed"] == 0, (
        "the blocker finished before every request waited behind it: make BLOCKER longer"
    )
    made = {}
    for rid, h in {"blocker": blocker, **handles}.items():
        events = list(h)
        assert events[-1].event_type == "completed", events[-1]
        (final,) = [e for e in events if e.stage == "encode" and e.event_type == "image"]
        image = BLOCKER if rid == "blocker" else SMALL
        pic = Image.open(io.BytesIO(final.arrays["image"]))
        assert final.is_last and pic.size == (image["width"], image["height"])
        made[rid] = final.ts
    assert made["blocker"] < min(made[rid] for rid in handles)
    return sorted(handles, key=made.__getitem__)


def test_a_busy_sampler_paints_the_waiting_requests_by_priority_then_arrival(
    llm, dit, tmp_path, monkeypatch
):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    with Pipeline(mixed(llm, dit, "priority")) as pipe:
        order = painted_order(pipe, PRIORITIES)
    assert order == ["b", "d", "c", "e", "a"]  # (priority, arrival)


def test_first_come_first_served_paints_them_in_arrival_order(llm, dit, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    with Pipeline(mixed(llm, dit, "fcfs")) as pipe:
        # a fcfs pipeline refuses a priority that is not 0 (as vLLM's server does)
        with pytest.raises(UserInputError, match="field 'priority'"):
            pipe.submit({"prompt": "a cat", "priority": -1, "image": SMALL})
        order = painted_order(pipe, dict.fromkeys(PRIORITIES, 0))
    assert order == list(PRIORITIES)
