"""A tiny Llama with random weights and a byte-level BPE tokenizer trained offline.

For tests: it builds in well under a second, needs no download, and greedy decoding is
not degenerate (untied embeddings and a large ``initializer_range``), so parity checks
compare varied token streams. Nothing here is committed as a binary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a red fox in the snow, under a pale winter sky",
    "héllo wörld, ünïcode ✓ 猫 and emoji 🦊 too",
    "omni pipelines stream tokens from stage to stage",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def build_tokenizer(vocab_size: int = 320, extra_special: tuple[str, ...] = ()) -> Any:
    """A byte-level BPE tokenizer trained on :data:`CORPUS` (``<unk> <s> </s>`` are ids
    0-2; ``extra_special`` tokens follow them), with :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(
    vocab_size: int, head_dim: int | None = None, max_positions: int = 512
) -> Any:
    """The tiny Llama's config: untied embeddings, a large init range (varied output)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_tiny_llama(
    path: str | Path,
    seed: int = 0,
    vocab_size: int = 320,
    head_dim: int | None = None,
    max_positions: int = 512,
) -> Path:
    """Write a tiny Llama checkpoint and tokenizer into ``path``; returns it.

    ``head_dim`` overrides hidden_size / heads (16); vLLM's CPU attention needs >= 32.
    ``max_positions``: the longest sequence it takes (vLLM's ``max_model_len`` at most).
    """
    import torch
    from transformers import LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer(vocab_size)
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    config = tiny_llama_config(len(fast), head_dim, max_positions)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def run_oracle(script: str, *args: str, timeout: float = 300) -> Any:
    """Run ``script`` (Python source) in a fresh interpreter with ``args``; its answer is
    the JSON after ``ORACLE`` on the last line that starts so (a reference engine, e.g.
    vLLM's ``LLM``, run in a process of its own: no engine state leaks into the test's)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("ORACLE")]
    if out.returncode != 0 or not lines:
        raise AssertionError(f"the oracle failed (exit {out.returncode}): {out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("ORACLE"))


def require_vllm() -> None:
    """At the top of a test module that runs vLLM: skip the module where vLLM is not
    installed, except under CI (env ``CI`` set), where that fails: CI must run them."""
    import importlib.util
    import os

    import pytest

    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("CI"):
        pytest.fail("vLLM is not installed, and CI must run the vLLM tests", pytrace=False)
    pytest.skip(
        "vLLM is not installed (pip install 'omni-ar-stages[vllm]')", allow_module_level=True
    )


def kv_engine_pair(model: str, engine_args: dict[str, Any]) -> list[Any]:
    """Two loaded vLLM engines on ``model``: prefill's (a KV producer, which runs whole
    requests too) and decode's (a KV consumer), each with its tokenizer."""
    from omni_ar.engines.vllm_engine import VllmEngine

    out = []
    for role in ("kv_producer", "kv_consumer"):
        e = VllmEngine(model, kv_role=role, engine_args=engine_args)
        e.load_model()
        e.load_tokenizer()
        out.append(e)
    return out


def layout_config(model: str, layout: str, **engine: Any) -> dict[str, Any]:
    """A text pipeline on ``model`` in ``layout``: intake -> ``ar.generate`` (``fused``) or
    ``ar.prefill`` -> ``ar.decode`` (``split-window-1``, ``split-window-4``: the window to
    postprocess) -> postprocess, or intake -> an inline-detokenizing ``ar.generate``
    (``inline``); segments of 3 tokens; ``engine``: more options of the model stages
    (``engine="vllm"``, its ``engine_args``)."""
    model_opts = {"model": model, "threads": 1, **engine}
    opts = {**model_opts, "max_segment_tokens": 3}
    text = {"model": model}
    if layout == "inline":
        stages = [
            {"name": "intake", "kind": "ar.intake", "options": text},
            {"name": "gen", "kind": "ar.generate", "options": {**opts, "inline_detokenize": True}},
        ]
    else:
        gen = [{"name": "gen", "kind": "ar.generate", "max_inflight": 4, "options": opts}]
        if layout.startswith("split"):
            gen = [
                {"name": "prefill", "kind": "ar.prefill", "options": model_opts},
                {"name": "gen", "kind": "ar.decode", "max_inflight": 4, "options": opts},
            ]
        stages = [
            {"name": "intake", "kind": "ar.intake", "options": text},
            *gen,
            {"name": "postprocess", "kind": "ar.postprocess", "options": text},
        ]
    names = [s["name"] for s in stages]
    window = 4 if layout == "split-window-4" else 1
    edges: list[dict[str, Any]] = [
        {"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)
    ]
    if layout != "inline":
        edges[-1]["window"] = {"size": window}
    return {"heartbeat_interval_s": 0.1, "ready_timeout_s": 300, "stages": stages, "edges": edges}


class PromptForward(NamedTuple):
    """:func:`prompt_forward`'s answer: the prompt's token ids and texts; for each token
    after the first its logprob, its rank, and the ``k`` likeliest tokens after the
    position before it as (text, logprob) and as (id, logprob)."""

    ids: list[int]
    texts: list[str]
    chosen: list[float]
    ranks: list[int]
    tops: list[list[tuple[str, float]]]
    top_ids: list[list[tuple[int, float]]]


def prompt_forward(model_dir: str, text: str, k: int) -> PromptForward:
    """The oracle of prompt logprobs (:class:`PromptForward`), from transformers' own
    forward over the whole prompt in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok(text)["input_ids"]
    with torch.inference_mode():
        lps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    chosen = [float(lps[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    ranks = [int((lps[i] > lps[i, ids[i + 1]]).sum()) + 1 for i in range(len(ids) - 1)]
    vals, idx = torch.topk(lps[:-1], k, dim=-1)
    top_ids = [
        list(zip(ti, vi, strict=True)) for ti, vi in zip(idx.tolist(), vals.tolist(), strict=True)
    ]
    tops = [[(tok.decode([t]), v) for t, v in row] for row in top_ids]
    return PromptForward(ids, [tok.decode([t]) for t in ids], chosen, ranks, tops, top_ids)
