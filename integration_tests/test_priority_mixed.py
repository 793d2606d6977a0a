"""Priority through the mixed AR + diffusion pipeline (tiny models): while the DiT sampler
(``max_batch_size`` 1) paints a long image, requests of mixed priorities reach its queue
one after another; under ``mrs.defaults.scheduler_policy: priority`` they are painted, and
finish, in (priority, arrival) order, under ``fcfs`` in arrival order; a better request
preempts a worse one sampling, which resumes to the same image. Every request ends with
its image."""

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
# the sampler busy for a while (~0.6 s at best); temperature 0: the same prompt each time
BLOCKER = {
    "prompt": "a fox",
    "max_tokens": 2,
    "temperature": 0,
    "image": {"steps": 100, "width": 256, "height": 256, "format": "png"},
}
SMALL = {"steps": 2, "width": 64, "height": 64}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """policy -> the mixed pipeline on tiny models, every stage under that policy: intake
    -> prefill -> decode -> postprocess -> text (the Llama encodes the prompt it wrote) ->
    plan -> sample -> vae -> encode."""
    from omni_ar.testing import build_tiny_llama

    llm = str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
    dit = tmp_path_factory.mktemp("tiny-sd3")
    embedded.build_tiny_sd3(dit, conditioning_width=64)  # the tiny Llama's hidden size
    ar = {"model": llm, "threads": 1}
    stages = [
        {"name": "intake", "kind": "ar.intake", "options": {"model": llm}},
        {"name": "prefill", "kind": "ar.prefill", "options": ar},
        {"name": "decode", "kind": "ar.decode", "options": ar},
        {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": llm}},
        {"name": "text", "kind": "ar.text_encode", "options": {**ar, "max_tokens": 8}},
        *dit_config(str(dit), width=64)["stages"][1:],  # plan, sample, vae, encode
    ]
    names = [s["name"] for s in stages]
    edges = [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)]

    def config(policy):
        return {
            "heartbeat_interval_s": 0.05,
            "mrs": {"defaults": {"scheduler_policy": policy}},
            "stages": stages,
            "edges": edges,
        }

    return config


def stats(pipe, stage):
    return pipe.metrics()["stages"][stage]


def final_image(events, image):
    """The request ended with its image (of ``image``'s size): its encoded bytes, and
    when they were made."""
    assert events[-1].event_type == "completed", events[-1]
    (final,) = [e for e in events if e.stage == "encode" and e.event_type == "image"]
    pic = Image.open(io.BytesIO(final.arrays["image"]))
    assert final.is_last and pic.size == (image["width"], image["height"])
    return final.arrays["image"], final.ts


def painted_order(pipe, blocker_priority, priorities):
    """Submit the blocker, then each of ``priorities`` (id -> priority) once the one
    before reached the sampler (so the submission order is their arrival there) while the
    blocker still samples; the ids in the order their images were made (after the
    blocker's: none is better than it), and the blocker's image."""
    blocker = pipe.submit({**BLOCKER, "priority": blocker_priority}, "blocker")
    wait_for(lambda: stats(pipe, "sample")["dequeued"] >= 1, 30, "the blocker sampling")
    handles = {}
    for i, (rid, p) in enumerate(priorities.items()):
        request = {"prompt": f"a cat {rid}", "max_tokens": 2, "image": SMALL}
        handles[rid] = pipe.submit(request if p == 0 else {**request, "priority": p}, rid)
        wait_for(lambda i=i: stats(pipe, "sample")["queue_depth"] > i, 30, f"{rid} waiting")
    assert stats(pipe, "sample")["completed"] == 0, (
        "the blocker finished before every request waited behind it: make BLOCKER longer"
    )
    image, blocker_made = final_image(list(blocker), BLOCKER["image"])
    made = {rid: final_image(list(h), SMALL)[1] for rid, h in handles.items()}
    assert blocker_made < min(made.values())
    assert stats(pipe, "sample")["preemptions"] == 0
    return sorted(handles, key=made.__getitem__), image


def test_a_busy_sampler_paints_the_waiting_requests_by_priority_then_arrival(
    mixed, tmp_path, monkeypatch
):
    """The waiting requests by (priority, arrival); then a better request preempts a
    worse one that samples, which resumes where it stopped: the same image."""
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    with Pipeline(mixed("priority")) as pipe:
        order, image = painted_order(pipe, -5, PRIORITIES)  # no waiting one is better
        assert order == ["b", "d", "c", "e", "a"]  # (priority, arrival)

        steps = stats(pipe, "sample")["steps"]  # (10 covers a late heartbeat's count)
        worse = pipe.submit({**BLOCKER, "priority": 5})
        wait_for(lambda: stats(pipe, "sample")["dequeued"] == 7, 30, "the worse one")
        wait_for(lambda: stats(pipe, "sample")["steps"] >= steps + 10, 30, "it sampling")
        better = pipe.submit({"prompt": "a dog", "max_tokens": 2, "priority": 4, "image": SMALL})
        _, better_made = final_image(list(better), SMALL)
        resumed, worse_made = final_image(list(worse), BLOCKER["image"])
        assert better_made < worse_made and stats(pipe, "sample")["preemptions"] == 1
        assert resumed == image  # nothing lost or repeated


def test_first_come_first_served_paints_them_in_arrival_order(mixed, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    with Pipeline(mixed("fcfs")) as pipe:
        # a fcfs pipeline refuses a priority that is not 0 (as vLLM's server does)
        with pytest.raises(UserInputError, match="field 'priority'"):
            pipe.submit({"prompt": "a cat", "priority": -1, "image": SMALL})
        order, _ = painted_order(pipe, 0, dict.fromkeys(PRIORITIES, 0))
    assert order == list(PRIORITIES)
