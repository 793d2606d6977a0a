"""The reference engine: Hugging Face transformers, in the stage's own process.

Prefill runs the prompt forward and returns the first token with the KV cache as plain
arrays (layers stacked: ``(layers, kv_heads, tokens, head_dim)``), so it can cross
processes through the shared-memory data plane; decode rebuilds a ``DynamicCache`` from
them and steps from there, giving the same tokens as ``model.generate``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import numpy as np

from omni_ar.models import quiet_offline
from omni_ar.params import SamplingParams


class TransformersEngine:
    def __init__(self, model: str, dtype: str = "float32", threads: int | None = None) -> None:
        quiet_offline()
        self.model_dir = model
        self.dtype = dtype
        self.threads = threads
        self.model: Any = None
        self.tokenizer: Any = None

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self.tokenizer

    def load_model(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if self.threads:
            torch.set_num_threads(self.threads)
        self.adopt(
            AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, self.dtype))
        )

    def adopt(self, model: Any) -> None:
        """Use ``model`` (a causal LM) for prefill and decode."""
        self.model = model.eval()
        # transformers renamed `past_key_values` to `cache` during 5.x: use what this has
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    # -- tokens ---------------------------------------------------------------------
    def encode(self, source: str | list[dict[str, str]]) -> list[int]:
        if isinstance(source, str):
            return list(self.tokenizer(source)["input_ids"])
        ids = self.tokenizer.apply_chat_template(source, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    # -- model ----------------------------------------------------------------------
    def _pick(self, logits: Any, params: SamplingParams, gen: Any) -> tuple[int, float]:
        import torch

        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if params.temperature == 0:
            tok = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits.float() / params.temperature, dim=-1)
            if params.top_p < 1.0:
                sorted_p, idx = torch.sort(probs, descending=True)
                keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
                probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
            tok = int(torch.multinomial(probs, 1, generator=gen))
        return tok, float(logprobs[tok])

    def generator(self, params: SamplingParams, offset: int = 0) -> Any:
        import torch

        if params.temperature == 0:
            return None
        g = torch.Generator()
        g.manual_seed((params.seed or 0) + offset)
        return g

    def prefill_many(
        self, prompts: list[list[int]], params: list[SamplingParams]
    ) -> Iterator[tuple[int, float, np.ndarray, np.ndarray]]:
        """``prefill`` for each prompt, in order (one forward pass each)."""
        for ids, p in zip(prompts, params, strict=True):
            yield self.prefill(ids, p)

    def prefill(
        self, ids: list[int], params: SamplingParams
    ) -> tuple[int, float, np.ndarray, np.ndarray]:
        """(first token, its logprob, keys, values) for a prompt."""
        import torch

        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), use_cache=True)
        tok, lp = self._pick(out.logits[0, -1], params, self.generator(params))
        keys, values = kv_arrays(_cache_of(out))
        return tok, lp, keys, values

    def decode(
        self,
        first: int,
        keys: np.ndarray,
        values: np.ndarray,
        params: SamplingParams,
        prompt: list[int] | None = None,  # not needed here: the KV holds the prompt
    ) -> Iterator[tuple[int, float]]:
        """Tokens after ``first``, one per step, until EOS or ``max_tokens`` in all."""
        return self.steps(first, self.cache_from(keys, values), params)

    @staticmethod
    def cache_from(keys: np.ndarray, values: np.ndarray) -> Any:
        """A ``DynamicCache`` holding copies of stacked ``(L, kvH, T, D)`` KV arrays."""
        import torch
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(keys.shape[0]):  # copies: the arrays may be read-only shared views
            cache.update(torch.tensor(keys[i])[None], torch.tensor(values[i])[None], i)
        return cache

    def steps(self, first: int, cache: Any, params: SamplingParams) -> Iterator[tuple[int, float]]:
        """The tokens after ``first`` (the cache holds everything before it), one per
        step, until EOS or ``max_tokens`` in all."""
        import torch

        gen = self.generator(params, offset=1)
        tok = first
        for _ in range(params.max_tokens - 1):
            if tok in self.eos_ids and not params.ignore_eos:
                return
            with torch.inference_mode():
                out = self.model(torch.tensor([[tok]]), use_cache=True, **{self.cache_kw: cache})
            cache = _cache_of(out)
            tok, lp = self._pick(out.logits[0, -1], params, gen)
            yield tok, lp

    def generate(self, source: str | list[dict[str, str]], params: SamplingParams) -> list[int]:
        """The whole request in one call (the parity oracle's one-process run)."""
        first, lp, keys, values = self.prefill(self.encode(source), params)
        return [first, *(t for t, _ in self.decode(first, keys, values, params))]

    def hidden_states(self, ids: list[list[int]], layer: int = -1) -> np.ndarray:
        """Per-token hidden states ``(batch, tokens, hidden)`` of one layer (-1: the
        last, after the final norm) for equal-length prompts: a text encoder's output."""
        import torch

        with torch.inference_mode():
            out = self.model(torch.tensor(ids), output_hidden_states=True)
        return out.hidden_states[layer].float().numpy()


def kv_arrays(cache: Any) -> tuple[np.ndarray, np.ndarray]:
    """A batch-of-one cache as stacked ``(layers, kv_heads, tokens, head_dim)`` arrays."""
    import torch

    keys = torch.stack([layer.keys[0] for layer in cache.layers]).numpy()
    values = torch.stack([layer.values[0] for layer in cache.layers]).numpy()
    return keys, values


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
