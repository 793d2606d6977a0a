"""``omni bench dit``: the staged DiT pipeline vs diffusers' own pipeline, same parts.

Both arms use the same SD3-layout model (default: the embedded ``tiny-sd3``), the same
conditioning (``dit.hash_encode``, a stand-in text encoder, so no language model is
timed) and the same image settings, and both end in encoded JPEG bytes.

* stock: ``StableDiffusion3Pipeline`` (text encoders None, embeddings given) called once
  per request in this process, then Pillow's JPEG encoder; run with one torch thread and
  with one per core, and the faster of the two counts.
* staged: hash_encode -> plan -> sample -> vae -> encode, one process each (one torch
  thread each), ``--concurrency`` requests in flight, sample's ``max_batch_size`` as the
  configs ship it (``--batch``, 8: alike requests share one forward pass per step); also
  with ``max_batch_size: 1`` (``staged_unbatched_img_per_s_c*``).
* previews: the staged pipeline with a preview every step, and every 4 steps, vs none
  (``preview_cost_pct``, ``preview_every_4_cost_pct``: targets <= 10 and <= 3): each
  round runs the three back to back, a cost is the median over the rounds of one
  round's loss of images/s; ``preview_cpu_cost_pct`` and ``preview_every_4_cpu_cost_pct``
  the same in CPU seconds per image (every process of the session).
* hop (``--arms hop``): one request at a time, staged vs the same stages in one process
  (``mrs.enabled: false``): the latency the process hops add (``hop_overhead_pct``).
* full_layout: a complete checkpoint (``--full-model``, default the embedded
  ``tiny-sd3-full``: CLIP-L, CLIP-G, T5) through ``configs/sd3_image.yaml`` as shipped
  (the prompt encoded by ``dit.text_encode`` as a stage; every worker with torch's
  default threads), against diffusers' ``StableDiffusion3Pipeline.from_pretrained`` doing
  everything in one process (``full_layout_vs_stock``); the same for the second
  architecture (``--second-model``, default ``tiny-flux``, through
  ``configs/flux_image.yaml``: ``FluxPipeline``, ``second_arch_vs_stock``). Each uses
  its architecture's usual guidance (SD3: CFG 4.5 against the empty negative prompt;
  Flux: embedded guidance 3.5); the stock runs (1 thread, one per core) and the staged
  run alternate for ``--rounds``, best of each.

* quality (``--arms quality``): the picture oracle of ``omni_dit.shapes`` on the
  held-out scenes of the embedded ``tiny-sd3-shapes`` (combinations of shape and colours
  it never saw in training), through ``configs/dit_image.yaml`` as shipped
  (``quality_colour_rate``, ``quality_shape_rate``) and through the main job,
  ``configs/mixed_ar_dit.yaml``, where SmolLM2 rewrites each caption first
  (``mixed_quality_colour_rate``, ``mixed_quality_shape_rate``); ``--quality-scenes``
  takes the first n. Those keys are the canonical caption ("a red circle on a blue
  background"); the same scenes also go through each of ``omni_dit.shapes.USER_PHRASINGS``
  (plain user wording never trained on): ``quality_user_colour_rate``,
  ``quality_user_shape_rate`` and ``quality_user_blank_rate`` (pictures with no figure)
  over all of them, ``quality_by_phrasing`` per phrasing (the same with ``mixed_``);
  ``--quality-phrasings`` takes the first n of them.
* rewrite (``--arms rewrite``): the main job's rewrite alone, as its users run it: the
  stages of ``configs/mixed_ar_dit.yaml`` as shipped that write the caption (those before
  its text encoder: SmolLM2 under the grammar, with the config's worked examples), no
  painting, over the same held-out scenes. A rewrite is right when it is the scene's
  canonical caption (``omni_dit.shapes.rewrite_right``): ``rewrite_rate`` over the
  canonical caption and the user phrasings (``--quality-phrasings``),
  ``rewrite_other_rate`` over ``omni_dit.shapes.OTHER_WORDINGS`` (wordings far from the
  examples; ``--other-wordings`` takes the first n), ``rewrite_by_phrasing`` each,
  ``rewrite_right`` / ``rewrite_asked`` (and ``rewrite_other_*``) as counts, and
  ``rewrite_wrong``: up to two wrong rewrites of each phrasing.

On a GPU (``--device auto``, the default, takes one where torch sees it) both arms run
there in the same dtype (``--dtype``, default the device's: bfloat16 on a GPU): the stock
pipelines are moved with ``.to(device, dtype)``, the stages placed by their ``devices``.

Images/s are completions over the wall time of ``--requests`` requests after a warm-up;
the staged arms with and without previews alternate for ``--rounds`` and keep their best.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from omni_core import Pipeline
from omni_core.config import PipelineConfig

from omni_bench.report import emit
from omni_bench.serve import session_cpu

if TYPE_CHECKING:
    from omni_dit.shapes import Scene

CONFIGS = Path(__file__).resolve().parents[4] / "configs"  # the repository's
# the shipped real-checkpoint configs, and the variable each takes its checkpoint from
CHECKPOINT_CONFIGS = {"sd3_image.yaml": "OMNI_SD3_MODEL", "flux_image.yaml": "OMNI_FLUX_MODEL"}


def _requests(
    n: int, size: int, steps: int, preview_every: int, **image: Any
) -> list[dict[str, Any]]:
    return [
        {
            "prompt": f"picture number {i}",
            "image": {
                "width": size,
                "height": size,
                "steps": steps,
                "seed": i,
                "preview_every": preview_every,
                **image,
            },
        }
        for i in range(n)
    ]


def _config(model: str, width: int, batch: int, dtype: str) -> dict[str, Any]:
    from omni_dit.testing import dit_config

    cfg = dit_config(model, width=width, sample={"max_batch_size": batch})
    for st in cfg["stages"]:
        if st["kind"] in ("dit.sample", "dit.vae"):
            st["options"]["dtype"] = dtype  # the stock arm's dtype: like for like
    return cfg


def device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """``auto``: the GPU where torch sees one (the staged stages' own default), else the
    CPU; its default dtype (bfloat16 / float16 on a GPU, float32 on a CPU)."""
    import torch
    from omni_core.plugin import default_dtype

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, default_dtype(device) if dtype == "auto" else dtype


def staged(pipe: Pipeline, reqs: list[dict[str, Any]], concurrency: int) -> float:
    """Images/s with ``concurrency`` requests in flight."""
    # warm up every stage, at the batch sizes the run will see (a new batch size is a new
    # set of kernels the first time)
    for n in sorted({1, concurrency}):
        pipe.generate(reqs[:n])
    t0 = time.monotonic()
    pending = list(reqs)
    inflight = []
    while pending or inflight:
        while pending and len(inflight) < concurrency:
            inflight.append(pipe.submit(pending.pop(0)))
        last = None
        for ev in inflight.pop(0):
            last = ev
        if last is None or last.event_type != "completed":
            raise RuntimeError(f"bench request failed: {last}")
    return len(reqs) / (time.monotonic() - t0)


def staged_cpu(pipe: Pipeline, reqs: list[dict[str, Any]], concurrency: int) -> tuple[float, float]:
    """:func:`staged`'s images/s, and the CPU seconds per image of every process of this
    session (the pipeline's workers and the caller) meanwhile."""
    sid = os.getsid(0)
    before = session_cpu(sid)
    rate = staged(pipe, reqs, concurrency)
    after = session_cpu(sid)
    spent = sum(cpu - before.get(pid, (name, 0.0))[1] for pid, (name, cpu) in after.items())
    return rate, spent / len(reqs)


def stock(
    model: str, width: int, reqs: list[dict[str, Any]], threads: int, device: str, dtype: str
) -> float:
    import torch
    from omni_dit.testing import stock_image, stock_pipeline
    from omni_testing.encoders import hash_conditioning

    kind = getattr(torch, dtype)
    pipe = stock_pipeline(model, width).to(device, kind)
    torch.set_num_threads(threads)

    def one(r: dict[str, Any]) -> bytes:
        embeds, pooled = hash_conditioning(r["prompt"], width, 8)
        e = torch.from_numpy(embeds)[None].to(device, kind)
        p = torch.from_numpy(pooled)[None].to(device, kind)
        return _jpeg(stock_image(pipe, e, p, r["image"], output_type="pil"))

    return _one_at_a_time(one, reqs)


def _one_at_a_time(one: Any, reqs: list[dict[str, Any]]) -> float:
    """Images/s of ``one(request)`` over ``reqs`` in turn, after one warm-up call."""
    one(reqs[0])
    t0 = time.monotonic()
    for r in reqs:
        one(r)
    return len(reqs) / (time.monotonic() - t0)


def _jpeg(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def full_layout(
    model: str,
    config: str,
    reqs: list[dict[str, Any]],
    concurrency: int,
    rounds: int,
    cores: int,
    device: str,
    dtype: str,
) -> dict[str, Any]:
    """Staged (the shipped ``config``, text encoders as a stage, the checkpoint given as
    its users give it: the environment variable the config names) vs diffusers' pipeline
    from the checkpoint doing everything, one request at a time; the arms alternate for
    ``rounds``, best of each."""
    import torch
    from omni_core import load_config
    from omni_dit.testing import checkpoint_image, checkpoint_pipeline

    stock_pipe = checkpoint_pipeline(model).to(device, getattr(torch, dtype))

    def stock_rate(threads: int) -> float:
        torch.set_num_threads(threads)
        return _one_at_a_time(
            lambda r: _jpeg(checkpoint_image(stock_pipe, r, output_type="pil")), reqs
        )

    by_threads = dict.fromkeys(sorted({1, cores}), 0.0)
    staged_rate = 0.0
    os.environ[CHECKPOINT_CONFIGS[config]] = model
    os.environ["OMNI_DIT_DTYPE"] = dtype  # the configs' dtype: the stock arm's
    with Pipeline(load_config(CONFIGS / config)) as pipe:
        for _ in range(rounds):
            for n in by_threads:
                by_threads[n] = max(by_threads[n], stock_rate(n))
            staged_rate = max(staged_rate, staged(pipe, reqs, concurrency))
    stock_best = max(by_threads.values())
    return {
        f"staged_img_per_s_c{concurrency}": round(staged_rate, 3),
        "stock_img_per_s": round(stock_best, 3),
        "stock_img_per_s_by_threads": {n: round(r, 3) for n, r in by_threads.items()},
        "vs_stock": round(staged_rate / stock_best, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni bench dit", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default="tiny-sd3", help="SD3-layout directory or tiny-sd3")
    ap.add_argument("--width", type=int, default=576, help="conditioning width (tiny-sd3)")
    ap.add_argument("--size", type=int, default=256, help="image side in pixels")
    ap.add_argument("--steps", type=int, default=28, help="SD3's default step count")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="sample's max_batch_size")
    ap.add_argument("--rounds", type=int, default=2, help="staged runs with/without previews")
    ap.add_argument("--full-model", default="tiny-sd3-full", help="complete SD3 checkpoint")
    ap.add_argument("--second-model", default="tiny-flux", help="complete Flux checkpoint")
    ap.add_argument(
        "--arms",
        default="embeds,full,second,quality",
        help="any of embeds, full, second, hop, quality, rewrite",
    )
    ap.add_argument("--quality-scenes", type=int, default=24, help="held-out scenes judged")
    ap.add_argument(
        "--quality-phrasings", type=int, default=4, help="user phrasings (shapes.USER_PHRASINGS)"
    )
    ap.add_argument(
        "--other-wordings", type=int, default=4, help="rewrite arm: shapes.OTHER_WORDINGS"
    )
    ap.add_argument(
        "--device", default="auto", help="auto (a GPU where torch sees one), cuda or cpu"
    )
    ap.add_argument("--dtype", default="auto", help="auto (the device's default) or a dtype")
    args = ap.parse_args(argv)
    args.device, args.dtype = device_and_dtype(args.device, args.dtype)
    from omni_hf import quiet_hub  # comes with the DiT family, which this benchmark runs

    quiet_hub()
    arms = set(args.arms.split(","))
    c = args.concurrency
    cores = len(os.sched_getaffinity(0))
    res: dict[str, Any] = {}
    if "embeds" in arms:
        res.update(embeds_arm(args, c, cores))
    if "hop" in arms:
        res.update(hop_arm(args))
    if "full" in arms:
        sd3 = _requests(args.requests, args.size, args.steps, 0, guidance=4.5)
        full = full_layout(
            args.full_model, "sd3_image.yaml", sd3, c, args.rounds, cores, args.device, args.dtype
        )
        res["full_layout"] = full
        res["full_layout_vs_stock"] = full["vs_stock"]
    if "second" in arms:
        flux = _requests(args.requests, args.size, args.steps, 0, guidance=3.5)
        second = full_layout(
            args.second_model,
            "flux_image.yaml",
            flux,
            c,
            args.rounds,
            cores,
            args.device,
            args.dtype,
        )
        res["second_arch"] = second
        res["second_arch_vs_stock"] = second["vs_stock"]
    if "quality" in arms:
        res.update(quality_arm(args.quality_scenes, args.quality_phrasings))
    if "rewrite" in arms:
        res.update(rewrite_arm(args.quality_scenes, args.quality_phrasings, args.other_wordings))
    res["settings"] = {
        "device": args.device,
        "dtype": args.dtype,
        "model": args.model,
        "full_model": args.full_model,
        "second_model": args.second_model,
        "size": args.size,
        "steps": args.steps,
        "requests": args.requests,
        "batch": args.batch,
    }
    emit(res, args.json)
    return 0


def quality_arm(scenes: int, phrasings: int = 4) -> dict[str, Any]:
    """The picture oracle's rates on the held-out scenes, through the two shipped
    pipelines that paint with ``tiny-sd3-shapes``, as a user runs them: in the canonical
    caption, then in each of the first ``phrasings`` user phrasings."""
    from omni_core import load_config
    from omni_dit.shapes import HELD_OUT, USER_PHRASINGS, score

    res: dict[str, Any] = {}
    for prefix, config in (("", "dit_image.yaml"), ("mixed_", "mixed_ar_dit.yaml")):
        with Pipeline(load_config(CONFIGS / config)) as pipe:
            r = score(pipe, HELD_OUT[:scenes])
            by_phrasing = {p: score(pipe, HELD_OUT[:scenes], p) for p in USER_PHRASINGS[:phrasings]}
        res[f"{prefix}quality_colour_rate"] = r["colour_rate"]
        res[f"{prefix}quality_shape_rate"] = r["shape_rate"]
        res[f"{prefix}quality_blank_rate"] = r["blank_rate"]
        res[f"{prefix}quality_pictures"] = r["pictures"]
        keys = ["colour_rate", "shape_rate", "blank_rate"]
        if "rewrite_rate" in r:  # the main job: how often the rewrite is the caption asked
            res[f"{prefix}quality_rewrite_rate"] = r["rewrite_rate"]
            keys.append("rewrite_rate")
        for key in keys:  # all user phrasings
            rates = [b.get(key, 0.0) for b in by_phrasing.values()]
            res[f"{prefix}quality_user_{key}"] = round(sum(rates) / max(len(rates), 1), 3)
        res[f"{prefix}quality_by_phrasing"] = by_phrasing
    return res


def rewrite_config(cfg: PipelineConfig) -> PipelineConfig:
    """The stages of ``cfg`` that write its prompt's rewrite, with the edges between them:
    every stage upstream of its text encoder (``ar.text_encode``), none of the painter's."""
    keep: set[str] = set()
    pending = [s.name for s in cfg.stages if s.kind == "ar.text_encode"]
    while pending:
        for edge in cfg.inbound(pending.pop()):
            if edge.source not in keep:
                keep.add(edge.source)
                pending.append(edge.source)
    if not keep:
        raise ValueError(f"{cfg.source_file}: no stage rewrites the prompt before ar.text_encode")
    stages = [s for s in cfg.stages if s.name in keep]
    edges = [e for e in cfg.edges if e.source in keep and e.target in keep]
    return msgspec.structs.replace(cfg, stages=stages, edges=edges)


def rewrite_arm(scenes: int, phrasings: int = 4, others: int = 4) -> dict[str, Any]:
    """How often the main job's rewrite alone is the scene's canonical caption, on the
    first ``scenes`` held-out scenes: in the canonical caption and the first ``phrasings``
    user phrasings, and in the first ``others`` of the other wordings."""
    from omni_core import load_config
    from omni_dit.shapes import HELD_OUT, OTHER_WORDINGS, TEMPLATES, USER_PHRASINGS

    sets = {"": (TEMPLATES[0], *USER_PHRASINGS[:phrasings]), "other_": OTHER_WORDINGS[:others]}
    with Pipeline(rewrite_config(load_config(CONFIGS / "mixed_ar_dit.yaml"))) as pipe:
        return rewrite_rates(pipe, HELD_OUT[:scenes], sets)


def rewrite_rates(
    pipe: Any, scenes: Sequence[Scene], sets: dict[str, Sequence[str]]
) -> dict[str, Any]:
    """Each scene's caption in each phrasing of each set through ``pipe`` (a pipeline
    that streams a rewrite as text), all at once: the share and count of rewrites that
    are the scene's canonical caption per set (``rewrite_{set}rate``), the share per
    phrasing, and up to two wrong rewrites of each phrasing."""
    from omni_dit.shapes import rewrite_right, streamed_text

    asked = [(p, s) for ps in sets.values() for p in ps for s in scenes]
    outs = pipe.generate([{"prompt": s.caption(p)} for p, s in asked])
    right: dict[str, int] = dict.fromkeys([p for ps in sets.values() for p in ps], 0)
    wrong: list[dict[str, Any]] = []
    for (phrasing, scene), out in zip(asked, outs, strict=True):
        text = streamed_text(out)
        if out.ok and rewrite_right(scene, text):
            right[phrasing] += 1
        elif sum(w["phrasing"] == phrasing for w in wrong) < 2:  # a few of each
            entry = {"phrasing": phrasing, "prompt": scene.caption(phrasing), "rewrite": text}
            entry["caption"] = scene.caption()
            if not out.ok:
                entry["error"] = out.error
            wrong.append(entry)
    res: dict[str, Any] = {}
    for prefix, ps in sets.items():
        got, total = sum(right[p] for p in ps), len(ps) * len(scenes)
        res[f"rewrite_{prefix}rate"] = round(got / max(total, 1), 3)
        res[f"rewrite_{prefix}right"] = got
        res[f"rewrite_{prefix}asked"] = total
    res["rewrite_by_phrasing"] = {p: round(r / max(len(scenes), 1), 3) for p, r in right.items()}
    res["rewrite_wrong"] = wrong
    return res


def hop_arm(args: argparse.Namespace) -> dict[str, Any]:
    """One request at a time: the staged pipeline (a process per stage, latents from
    sample to vae through the data plane) against the same stages called in one process
    (``mrs.enabled: false``): what the hops add to a request's latency."""
    from omni_dit.testing import dit_config

    reqs = _requests(args.requests, args.size, args.steps, 0)
    pipes = {}
    for enabled in (True, False):
        cfg = dit_config(args.model, width=args.width, encode=False, enabled=enabled)
        for st in cfg["stages"]:
            if st["kind"] in ("dit.sample", "dit.vae"):
                st["options"]["dtype"] = args.dtype
        pipes[enabled] = Pipeline(cfg).start()
    latency = dict.fromkeys(pipes, float("inf"))
    try:  # alternating rounds, best of each
        for _ in range(args.rounds):
            for enabled, pipe in pipes.items():
                latency[enabled] = min(latency[enabled], 1 / staged(pipe, reqs, 1))
    finally:
        for pipe in pipes.values():
            pipe.close()
    return {
        "hop_staged_latency_s_c1": round(latency[True], 4),
        "hop_one_process_latency_s_c1": round(latency[False], 4),
        "hop_overhead_pct": round(100 * (latency[True] / latency[False] - 1), 2),
    }


def embeds_arm(args: argparse.Namespace, c: int, cores: int) -> dict[str, Any]:
    """tiny-sd3 conditioned by dit.hash_encode: the sampling stages alone."""
    reqs = _requests(args.requests, args.size, args.steps, 0)
    previews = _requests(args.requests, args.size, args.steps, 1)
    previews4 = _requests(args.requests, args.size, args.steps, 4)
    stock_by_threads = {
        n: stock(args.model, args.width, reqs, n, args.device, args.dtype)
        for n in sorted({1, cores})
    }
    stock_rate = max(stock_by_threads.values())
    with Pipeline(_config(args.model, args.width, args.batch, args.dtype)) as pipe:
        # alternating rounds (none, every step, every 4 steps), best of each: a noisy
        # moment hurts neither arm alone
        rounds = [
            [staged_cpu(pipe, r, c) for r in (reqs, previews, previews4)]
            for _ in range(args.rounds)
        ]
    staged_rate, preview_rate, preview4_rate = (
        max(rate for rate, _ in arm) for arm in zip(*rounds, strict=True)
    )
    # each preview cost from the runs of one round (adjacent, so a slow minute of a shared
    # machine weighs on both sides), the median over the rounds: in images/s, and in the
    # CPU seconds an image took (the pipeline's processes and this one), which a busy
    # neighbour on the machine moves less
    costs = [statistics.median(100 * (1 - r[k][0] / r[0][0]) for r in rounds) for k in (1, 2)]
    cpu_costs = [statistics.median(100 * (r[k][1] / r[0][1] - 1) for r in rounds) for k in (1, 2)]
    with Pipeline(_config(args.model, args.width, 1, args.dtype)) as pipe:
        unbatched = max(staged(pipe, reqs, c) for _ in range(args.rounds))
    return {
        f"staged_img_per_s_c{c}": round(staged_rate, 3),
        f"staged_unbatched_img_per_s_c{c}": round(unbatched, 3),
        "stock_img_per_s": round(stock_rate, 3),
        "stock_img_per_s_by_threads": {n: round(r, 3) for n, r in stock_by_threads.items()},
        "staged_vs_stock": round(staged_rate / stock_rate, 3),
        "preview_every_step_img_per_s": round(preview_rate, 3),
        "no_preview_img_per_s": round(staged_rate, 3),
        "preview_cost_pct": round(costs[0], 2),
        "preview_every_4_img_per_s": round(preview4_rate, 3),
        "preview_every_4_cost_pct": round(costs[1], 2),
        "preview_cpu_cost_pct": round(cpu_costs[0], 2),
        "preview_every_4_cpu_cost_pct": round(cpu_costs[1], 2),
        "cpu_s_per_image_no_preview": round(statistics.median(r[0][1] for r in rounds), 4),
    }
