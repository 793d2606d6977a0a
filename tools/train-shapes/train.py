"""Train the embedded ``tiny-sd3-shapes`` model on the procedural world of
``omni_dit.shapes``, on CPUs, from one seed.

    hatch run python tools/train-shapes/train.py --threads 2     # ~30 min on 2 cores
    hatch run python tools/train-shapes/train.py --out /tmp/shapes --vae-steps 50 --steps 50

1. draws the training scenes (every combination of shape and colours but the held-out
   ones, several pictures each) and gives each scene a pool of ``--phrasings`` captions:
   the five ``shapes.TEMPLATES`` and others drawn from ``shapes.TRAIN_PHRASINGS`` (the
   first letter sometimes capitalised), never a user phrasing of the benchmark, and
   ``--partial`` captions that name the shape with one colour or none;
2. encodes every caption with SmolLM2 exactly as ``ar.text_encode`` does (the same
   class, the same padding to ``--text-tokens``), so the model learns the conditioning
   the pipelines give it; each training picture takes one caption of its scene's pool;
3. trains a small ``AutoencoderKL`` (64 px -> 16 x 16 x 8 latents) on reconstruction,
   and sets its ``shift_factor`` / ``scaling_factor`` from the latents' statistics;
4. trains a small ``SD3Transformer2DModel`` by rectified flow (SD3's objective: predict
   ``noise - latents`` at a logit-normal ``sigma``), captions dropped to zeros one time in
   ten so zeros stand for "no prompt" under classifier-free guidance, with an EMA copy;
5. writes a diffusers pipeline directory (``model_index.json``, ``transformer/``,
   ``vae/``, ``scheduler/``; weights in float16 safetensors) and ``preview_rgb.npz``, the
   latent -> RGB preview map (a per-pixel MLP) fitted on the real latents; then samples the held-out
   scenes and prints how many the picture oracle reads right.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from omni_ar.text_encode import TextEncoder
from omni_dit import shapes

REPO = Path(__file__).resolve().parents[2]
LATENT_CHANNELS = 8
GUIDANCE = 7.0  # the shipped configs' image_defaults: what the check samples with
DEFAULT_OUT = REPO / "packages/omni-dit-stages/src/omni_dit/weights/tiny-sd3-shapes"


def log(msg: str, t0: float = time.time()) -> None:
    print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)


def build_vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 3,
        up_block_types=["UpDecoderBlock2D"] * 3,
        block_out_channels=[32, 64, 64],  # two halvings: 64 px -> 16 x 16 latents
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
        sample_size=shapes.SIZE,
    )


def build_transformer(width: int) -> SD3Transformer2DModel:
    return SD3Transformer2DModel(
        sample_size=shapes.SIZE // 4,
        patch_size=2,  # 8 x 8 tokens of 2 x 2 latent pixels
        in_channels=LATENT_CHANNELS,
        num_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=width,
        caption_projection_dim=128,
        pooled_projection_dim=width,
        out_channels=LATENT_CHANNELS,
        pos_embed_max_size=shapes.SIZE // 8,  # the 64 px it learned is also its largest
    )


def dataset(per_scene: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Pictures ``(n, 3, 64, 64)`` in [-1, 1] and the index of each one's scene in TRAIN."""
    rng = np.random.default_rng(seed)
    images, scene_ids = [], []
    for i, scene in enumerate(shapes.TRAIN):
        for _ in range(per_scene):
            images.append(shapes.draw(scene, rng))
            scene_ids.append(i)
    x = np.stack(images).astype(np.float32).transpose(0, 3, 1, 2) / 127.5 - 1.0
    return x, np.array(scene_ids)


# Captions naming the shape with one colour or none: the picture still has both colours,
# so the shape word alone has to decide the figure's outline. Without them the held-out
# scenes (a colour pair seen in training only with the other two shapes) came out with
# the pair's shapes blended, mostly round (docs/shapes-model.md, "Wording").
PARTIAL_PHRASINGS = (
    "a {shape}",
    "{shape}",
    "draw a {shape}",
    "a {fg} {shape}",
    "{fg} {shape}",
    "a {shape} on a {bg} background",
    "a {shape} on {bg}",
    "a {bg} background with a {shape}",
)


def caption_pools(per_scene: int, seed: int, partial: int = 0) -> list[list[str]]:
    """Per training scene, ``per_scene`` distinct captions: the five ``shapes.TEMPLATES``
    (the canonical one first: what the main job's rewrite produces) and phrasings drawn
    from ``shapes.TRAIN_PHRASINGS``, a third of them with a capital first letter. A fixed
    pool bounds the encoding time; across scenes the pools cover the grammar.

    A third of the draws are phrasings that start with a colour ("red circle over blue"):
    there the colour is SmolLM2's first token (no BOS is added), and drawn as often as
    their share of the grammar (2%) the model left the held-out "red circle on blue" blank
    22 times in 24 (docs/shapes-model.md, "Wording").

    Then ``partial`` captions from :data:`PARTIAL_PHRASINGS` (the first ones)."""
    rng = random.Random(seed)
    colour_first = [p for p in shapes.TRAIN_PHRASINGS if p.startswith("{")]
    pools = []
    for scene in shapes.TRAIN:
        pool = [scene.caption(t) for t in range(len(shapes.TEMPLATES))]
        while len(pool) < per_scene:
            phrasings = colour_first if rng.random() < 1 / 3 else shapes.TRAIN_PHRASINGS
            text = scene.caption(rng.choice(phrasings))
            if rng.random() < 1 / 3:
                text = text[0].upper() + text[1:]
            if text not in pool:
                pool.append(text)
        pool += [scene.caption(p) for p in PARTIAL_PHRASINGS[:partial]]
        pools.append(pool)
    return pools


def text_encoder(text_tokens: int, threads: int, lead_token: str | None) -> TextEncoder:
    """SmolLM2 as ``ar.text_encode`` runs it in the shipped configs."""
    return TextEncoder("smollm2", "float32", threads, "cpu", text_tokens, -1, lead_token)


def encode_captions(
    pools: list[list[str]], encoder: TextEncoder
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scenes, phrasings, tokens, width)`` embeds and ``(scenes, phrasings, width)``
    pooled, for every training scene's pool of captions."""
    captions = [c for pool in pools for c in pool]
    embeds, pooled = [], []
    for i in range(0, len(captions), 64):
        for e, p, _ in encoder.encode(captions[i : i + 64]):
            embeds.append(e)
            pooled.append(p)
    shape = (len(pools), len(pools[0]))
    e = torch.from_numpy(np.stack(embeds)).reshape(*shape, encoder.max_tokens, -1)
    p = torch.from_numpy(np.stack(pooled)).reshape(*shape, -1)
    return e, p


def train_vae(x: torch.Tensor, steps: int, batch: int, seed: int, lr: float) -> AutoencoderKL:
    """Reconstruction from the posterior's mean (the latents the transformer learns), with
    a little noise so the decoder forgives a sampler's small errors, and a light KL term
    that keeps the latents near the origin."""
    torch.manual_seed(seed)
    vae = build_vae().train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(len(x), (batch,), generator=g)
        xb = x[idx]
        post = vae.encode(xb).latent_dist
        z = post.mean + 0.1 * post.mean.detach().std() * torch.randn(post.mean.shape, generator=g)
        rec = vae.decode(z).sample
        loss = F.mse_loss(rec, xb) + F.l1_loss(rec, xb) + 1e-6 * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step}/{steps} loss {loss.item():.4f}")
    return vae.eval()


@torch.no_grad()
def encode_latents(vae: AutoencoderKL, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([vae.encode(x[i : i + 256]).latent_dist.mean for i in range(0, len(x), 256)])


def train_transformer(
    latents: torch.Tensor,
    scene_ids: torch.Tensor,
    embeds: torch.Tensor,
    pooled: torch.Tensor,
    steps: int,
    batch: int,
    seed: int,
    lr: float = 6e-4,
    start: Path | None = None,
) -> SD3Transformer2DModel:
    """From scratch, or from the transformer in ``start`` (to go on training one)."""
    torch.manual_seed(seed)
    if start is None:
        model = build_transformer(embeds.shape[-1]).train()
    else:
        model = SD3Transformer2DModel.from_pretrained(start, torch_dtype=torch.float32).train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 50)

    def lr_at(step: int) -> float:  # warm up, then cosine down to a tenth
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    g = torch.Generator().manual_seed(seed)
    templates = embeds.shape[1]
    for step in range(steps):
        idx = torch.randint(len(latents), (batch,), generator=g)
        x0 = latents[idx]
        scene = scene_ids[idx]
        template = torch.randint(templates, (batch,), generator=g)
        e, p = embeds[scene, template], pooled[scene, template]
        keep = (torch.rand(batch, generator=g) > 0.1).float()  # 10%: the zeros of no prompt
        e, p = e * keep[:, None, None], p * keep[:, None]
        sigma = torch.sigmoid(torch.randn(batch, generator=g))  # logit-normal, as SD3
        noise = torch.randn(x0.shape, generator=g)
        s = sigma[:, None, None, None]
        xt = (1 - s) * x0 + s * noise
        pred = model(
            hidden_states=xt,
            timestep=sigma * 1000,
            encoder_hidden_states=e,
            pooled_projections=p,
            return_dict=False,
        )[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
                pe.lerp_(pm, 1 - decay)
        if step % 100 == 0 or step == steps - 1:
            log(f"transformer step {step}/{steps} loss {loss.item():.4f}")
    return ema


def fit_preview(latents: torch.Tensor, x: torch.Tensor, seed: int) -> dict[str, np.ndarray]:
    """The preview map (see ``omni_dit.preview``): a per-pixel MLP, latent pixel -> 32
    SiLU units -> the picture's colour there (pooled to latent size), fitted on real
    latents. A linear map reads this VAE's latents badly (mean error 29/255 against 9)."""
    torch.manual_seed(seed)
    rgb = F.adaptive_avg_pool2d(x, latents.shape[-2:]).permute(0, 2, 3, 1).reshape(-1, 3)
    z = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
    mlp = torch.nn.Sequential(
        torch.nn.Linear(z.shape[1], 32), torch.nn.SiLU(), torch.nn.Linear(32, 3)
    )
    opt = torch.optim.Adam(mlp.parameters(), 1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(2000):
        idx = torch.randint(len(z), (4096,), generator=g)
        loss = F.mse_loss(mlp(z[idx]), rgb[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        err = (mlp(z).clamp(-1, 1) - rgb).abs().mean().item() * 127.5
    log(f"preview map: mean error {err:.1f}/255")
    first, second = mlp[0], mlp[2]
    return {
        "w1": first.weight.detach().T.numpy().copy(),
        "b1": first.bias.detach().numpy().copy(),
        "w2": second.weight.detach().T.numpy().copy(),
        "b2": second.bias.detach().numpy().copy(),
    }


def save(
    out: Path, vae: AutoencoderKL, model: SD3Transformer2DModel, preview: np.ndarray, meta: dict
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out / "transformer")
    config = json.loads((out / "transformer/config.json").read_text())
    if config.pop("_name_or_path", None) is not None:  # where an earlier run lay
        (out / "transformer/config.json").write_text(json.dumps(config, indent=2) + "\n")
    vae.to(torch.float16).save_pretrained(out / "vae")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0).save_pretrained(
        out / "scheduler"
    )
    np.savez(out / "preview_rgb.npz", **preview)
    index = {
        "_class_name": "StableDiffusion3Pipeline",
        "_omni_note": "trained by tools/train-shapes/train.py on omni_dit.shapes",
        "_omni_training": meta,
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=1) + "\n")
    model.float()
    vae.float()


@torch.no_grad()
def check(
    vae: AutoencoderKL,
    model: SD3Transformer2DModel,
    encoder: TextEncoder,
    steps: int,
    guidance: float,
    phrasing: int | str = 0,
) -> dict[str, float]:
    """Sample every held-out scene in one phrasing (seed 0, Euler, the shipped scheduler)
    and read the pictures with the oracle."""
    encoded = encoder.encode([s.caption(phrasing) for s in shapes.HELD_OUT])
    e = torch.from_numpy(np.stack([x[0] for x in encoded]))
    p = torch.from_numpy(np.stack([x[1] for x in encoded]))
    n = len(e)
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    sched.set_timesteps(steps)
    side = shapes.SIZE // 4
    x = torch.randn(n, LATENT_CHANNELS, side, side, generator=torch.Generator().manual_seed(0))
    for t in sched.timesteps:
        xin = torch.cat([x, x]) if guidance > 1 else x
        ein = torch.cat([torch.zeros_like(e), e]) if guidance > 1 else e
        pin = torch.cat([torch.zeros_like(p), p]) if guidance > 1 else p
        v = model(
            hidden_states=xin,
            timestep=t.expand(len(xin)),
            encoder_hidden_states=ein,
            pooled_projections=pin,
            return_dict=False,
        )[0]
        if guidance > 1:
            vu, vc = v.chunk(2)
            v = vu + guidance * (vc - vu)
        x = sched.step(v, t, x).prev_sample
    c = vae.config
    images = vae.decode(x / c.scaling_factor + c.shift_factor).sample
    images = ((images.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    verdicts = [shapes.judge(im) for im in images]
    colour = sum(v.colours_right(s) for v, s in zip(verdicts, shapes.HELD_OUT, strict=True)) / n
    shape = sum(v.shape_right(s) for v, s in zip(verdicts, shapes.HELD_OUT, strict=True)) / n
    blank = sum(v.fg is None for v in verdicts) / n
    return {"colour_rate": round(colour, 3), "shape_rate": round(shape, 3), "blank_rate": blank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-scene", type=int, default=64, help="pictures of each training scene")
    ap.add_argument("--text-tokens", type=int, default=16, help="ar.text_encode's max_tokens")
    ap.add_argument(
        "--lead-token",
        default="<|endoftext|>",
        help="ar.text_encode's lead_token ('' for none): the configs must set the same",
    )
    ap.add_argument("--phrasings", type=int, default=32, help="captions encoded per scene")
    ap.add_argument(
        "--partial",
        type=int,
        default=len(PARTIAL_PHRASINGS),
        help="captions per scene that name the shape with one colour or none",
    )
    ap.add_argument("--vae-steps", type=int, default=300)
    ap.add_argument("--vae-batch", type=int, default=16)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--vae", type=Path, help="a trained vae/ directory to reuse")
    ap.add_argument(
        "--preview-only",
        action="store_true",
        help="refit only the preview map of the model in --out, from its own VAE",
    )
    ap.add_argument("--steps", type=int, default=7000, help="transformer steps")
    ap.add_argument("--lr", type=float, default=6e-4, help="the transformer's peak rate")
    ap.add_argument(
        "--transformer", type=Path, help="a trained transformer/ directory to go on training"
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.time()
    x_np, ids_np = dataset(args.per_scene, args.seed)
    x, scene_ids = torch.from_numpy(x_np), torch.from_numpy(ids_np)
    log(f"{len(x)} pictures of {len(shapes.TRAIN)} scenes ({len(shapes.HELD_OUT)} held out)")
    if args.preview_only:
        vae = AutoencoderKL.from_pretrained(args.out / "vae", torch_dtype=torch.float32).eval()
        c = vae.config
        latents = (encode_latents(vae, x) - c.shift_factor) * c.scaling_factor
        np.savez(args.out / "preview_rgb.npz", **fit_preview(latents, x, args.seed + 3))
        log(f"wrote {args.out / 'preview_rgb.npz'}")
        return
    pools = caption_pools(args.phrasings, args.seed + 4, args.partial)
    encoder = text_encoder(args.text_tokens, torch.get_num_threads(), args.lead_token or None)
    embeds, pooled = encode_captions(pools, encoder)
    log(f"captions encoded: {tuple(embeds.shape)}")
    if args.vae:  # a VAE trained before (to try transformer settings without retraining it)
        vae = AutoencoderKL.from_pretrained(args.vae, torch_dtype=torch.float32).eval()
        raw = encode_latents(vae, x)
        shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    else:
        vae = train_vae(x, args.vae_steps, args.vae_batch, args.seed + 1, args.vae_lr)
        raw = encode_latents(vae, x)
        shift, scale = raw.mean().item(), 1.0 / raw.std().item()
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    latents = (raw - shift) * scale
    with torch.no_grad():
        rec = vae.decode(raw[:256]).sample
    mse = F.mse_loss(rec, x[:256]).item()
    log(f"vae: shift {shift:.4f} scale {scale:.4f}, reconstruction mse {mse:.5f}")
    model = train_transformer(
        latents,
        scene_ids,
        embeds,
        pooled,
        args.steps,
        args.batch,
        args.seed + 2,
        args.lr,
        args.transformer,
    )
    meta = {
        "seed": args.seed,
        "per_scene": args.per_scene,
        "text_tokens": args.text_tokens,
        "lead_token": args.lead_token or None,
        "phrasings": args.phrasings,
        "partial": args.partial,
        "vae": "reused" if args.vae else "trained",
        "vae_steps": args.vae_steps,
        "steps": args.steps,
        "lr": args.lr,
        "transformer": "went on from an earlier run" if args.transformer else "from scratch",
        "batch": args.batch,
        "minutes": round((time.time() - t0) / 60, 1),
    }
    earlier = args.transformer.parent / "model_index.json" if args.transformer else None
    if earlier is not None and earlier.exists():  # the history of the weights gone on from
        meta["went_on_from"] = json.loads(earlier.read_text()).get("_omni_training")
    save(args.out, vae, model, fit_preview(latents, x, args.seed + 3), meta)
    log(f"wrote {args.out}")
    for guidance in (1.0, GUIDANCE):
        rates = check(vae, model, encoder, 20, guidance)
        log(f"held-out, 20 steps, guidance {guidance}: {rates}")
    for phrasing in shapes.USER_PHRASINGS:
        rates = check(vae, model, encoder, 20, GUIDANCE, phrasing)
        log(f"held-out, {phrasing!r}, guidance {GUIDANCE}: {rates}")


if __name__ == "__main__":
    main()
