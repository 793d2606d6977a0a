"""Train the embedded voice ``tiny-dial-voice`` (``omni_speech.voice``) on CPUs, from one
seed, in about a minute.

    hatch run python tools/train-voice/train.py --threads 1
    hatch run python tools/train-voice/train.py --out /tmp/voice --steps 200

1. draws ``--texts`` training texts (seeded): random words of random letters (English
   letter frequencies half the time, uniform the other half), capitalised ones, numbers
   (with "." "," ":" "-" inside), signs of every kind, words with punctuation after them,
   joined by spaces: every printable ASCII character, in contexts that are not English;
   none holds a held-out sentence of ``omni_speech.oracle`` (checked);
2. gives each its targets: each character's symbol (the code) and the reference
   speaker's rhythm (``voice.speaker_rhythm``: frames it sounds, frames of silence after);
3. trains the talker (``voice_net.TalkerNet``: residual 1-D convolutions over the
   characters, three heads) with cross-entropy on the three, Adam, batches of
   ``--batch`` texts;
4. writes ``config.json`` and ``talker.safetensors`` (float32) to ``--out`` and checks
   the held-out sentences: symbols and rhythm against the targets, and what the oracle
   hears in the rendered audio.
"""

from __future__ import annotations

import argparse
import random
import string
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omni_speech.oracle import HELD_OUT, listen
from omni_speech.voice import (
    GAP,
    MIN_GAP,
    MIN_TONE,
    SAMPLE_RATE,
    VOICE_DIR,
    frames_of,
    render,
    sayable,
    speaker_rhythm,
    symbols_of,
)
from omni_speech.voice_net import TalkerNet, save_talker

# English letter frequencies (per mille), a .. z
FREQ = (
    82,
    15,
    28,
    43,
    127,
    22,
    20,
    61,
    70,
    2,
    8,
    40,
    24,
    67,
    75,
    19,
    1,
    60,
    63,
    91,
    28,
    10,
    24,
    2,
    20,
    1,
)
SIGNS = string.punctuation  # every printable sign: !"#$%&'()*+,-./:;<=>?@[\]^_`{|}~
MAX_CHARS = 96


def log(msg: str, t0: float = time.time()) -> None:
    print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)


def word(rng: random.Random) -> str:
    """One token of training text."""
    letters = string.ascii_lowercase
    n = rng.randint(1, 9)
    if rng.random() < 0.5:
        w = "".join(rng.choices(letters, weights=FREQ, k=n))
    else:
        w = "".join(rng.choices(letters, k=n))
    kind = rng.random()
    if kind < 0.15:
        w = w.capitalize()
    elif kind < 0.22:
        w = w.upper()
    elif kind < 0.34:
        digits = "".join(rng.choices(string.digits, k=rng.randint(1, 5)))
        w = digits if rng.random() < 0.6 else digits + rng.choice(".,:-/") + str(rng.randint(0, 99))
    elif kind < 0.46:
        w = "".join(rng.choices(SIGNS, k=rng.randint(1, 3)))
    elif kind < 0.56:
        a, b = rng.choice(("()", "[]", "{}", "<>", '""', "''", "``", "**", "__")), w
        w = a[0] + b + a[1]
    elif kind < 0.62:
        w = (
            w
            + rng.choice(SIGNS)
            + "".join(rng.choices(letters + string.digits, k=rng.randint(1, 6)))
        )
    if rng.random() < 0.25:
        w += rng.choice(".,!?;:")
    return w


def training_text(rng: random.Random) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < rng.randint(8, MAX_CHARS):
        words.append(word(rng))
    return sayable(" ".join(words))[:MAX_CHARS].rstrip(" ")


def targets(texts: list[str]) -> tuple[torch.Tensor, ...]:
    """(ids, symbols, tone classes, gap classes), padded with GAP / -100 (ignored)."""
    n = max(len(t) for t in texts)
    ids = torch.full((len(texts), n), GAP)
    sym, tone, gap = (torch.full((len(texts), n), -100) for _ in range(3))
    for i, t in enumerate(texts):
        s = torch.tensor(symbols_of(t))
        tf, gf = speaker_rhythm(t)
        ids[i, : len(t)] = s
        sym[i, : len(t)] = s
        tone[i, : len(t)] = torch.tensor(tf) - MIN_TONE
        gap[i, : len(t)] = torch.tensor(gf) - MIN_GAP
    return ids, sym, tone, gap


def check(net: TalkerNet) -> dict[str, float]:
    """The held-out sentences: the share of characters whose symbol and whose rhythm
    are the targets', and of sentences the oracle hears back exactly."""
    chars = sym_ok = rhythm_ok = heard = 0
    for text in HELD_OUT:
        s, t, g = net.say(text)
        tt, gg = speaker_rhythm(text)
        chars += len(text)
        sym_ok += sum(a == b for a, b in zip(s, symbols_of(text), strict=True))
        rhythm_ok += sum(a == b and c == d for a, b, c, d in zip(t, tt, g, gg, strict=True))
        heard += listen(render(frames_of(s, t, g)), SAMPLE_RATE) == text
    return {
        "held_out_symbol_accuracy": round(sym_ok / chars, 4),
        "held_out_rhythm_accuracy": round(rhythm_ok / chars, 4),
        "held_out_oracle_rate": round(heard / len(HELD_OUT), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=VOICE_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--texts", type=int, default=20000, help="training texts drawn")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--kernel", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    texts = [training_text(rng) for _ in range(args.texts)]
    texts = [t for t in texts if t]
    seen = set("".join(texts))
    assert all(set(h) <= seen for h in HELD_OUT), "a held-out character is never trained"
    leaks = [h for h in HELD_OUT if any(h in t for t in texts)]
    assert not leaks, f"held-out text in training: {leaks}"
    log(f"{len(texts)} training texts, {sum(map(len, texts))} characters; e.g. {texts[:3]}")

    net = TalkerNet(args.width, args.layers, args.kernel)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.steps)
    loss = torch.tensor(0.0)
    for step in range(1, args.steps + 1):
        ids, sym, tone, gap = targets(rng.sample(texts, args.batch))
        ls, lt, lg = net(ids)
        loss = sum(
            F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
            for logits, y in ((ls, sym), (lt, tone), (lg, gap))
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 250 == 0 or step == args.steps:
            log(f"step {step}: loss {loss.item():.4f}")
    net.eval()
    train_s = round(time.time() - t0, 1)
    result = check(net)
    log(f"held-out: {result}")
    record = {
        "script": "tools/train-voice/train.py",
        "seed": args.seed,
        "texts": len(texts),
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "threads": torch.get_num_threads(),
        "final_loss": round(loss.item(), 5),
        "train_s": train_s,
        **result,
    }
    save_talker(net, args.out, record)
    params = sum(p.numel() for p in net.parameters())
    log(f"wrote {args.out} ({params} parameters)")


if __name__ == "__main__":
    main()
