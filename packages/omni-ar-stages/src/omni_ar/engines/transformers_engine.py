"""The reference engine: Hugging Face transformers, in the stage's own process.

Prefill runs the prompt forward and returns the first token with the KV cache as plain
arrays (layers stacked: ``(layers, kv_heads, tokens, head_dim)``), so it can cross
processes through the shared-memory data plane; decode rebuilds a ``DynamicCache`` from
them and steps from there, giving the same tokens as ``model.generate``.

Decode is batched across requests
(:class:`~omni_ar.engines.transformers_batch.DecodeBatch`): each request's iterator, when
it has no token queued, runs one forward of every request in flight, so a decode stage
driving N request generators (``max_inflight: N``) costs one forward per step, not N. Requests of
different lengths share one cache, left-padded, with an attention mask and explicit
position ids; it is rebuilt only when a request joins or leaves. Prompts that arrive
together prefill the same way, in one left-padded forward (``prefill_many``), each cut
out of it with what it would have alone.

The model lives on the engine's ``device`` (``"cpu"``, or ``"cuda:0"``: the first GPU
the worker sees) in its ``dtype``; the inputs it builds go there, and what it hands out
(KV, hidden states) comes back to the CPU, one copy per array, for the data plane.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import numpy as np
from omni_hf import quiet_offline

from omni_ar.engines.base import TokenizedEngine, eos_set
from omni_ar.engines.cpu_turns import cpu_turn
from omni_ar.engines.dtype import resolve_dtype
from omni_ar.engines.protocol import Source
from omni_ar.engines.transformers_batch import BatchRequest, BatchSteps, DecodeBatch
from omni_ar.engines.transformers_kv import cache_of, kv_arrays
from omni_ar.engines.transformers_sampling import pick, prompt_logprobs
from omni_ar.logits import Logits, adjusts, bad_word_ids, ends
from omni_ar.multimodal.mrope import uses_mrope
from omni_ar.params import Sampled, SamplingParams
from omni_ar.structured import Matcher

# the default of TransformersEngine.prefill_batch_tokens: a burst of 8 prompts of 1,024
# tokens in one forward; longer bursts split (the attention scores grow with the square)
PREFILL_BATCH_TOKENS = 8192


class TransformersEngine(TokenizedEngine):
    """A causal LM on Hugging Face transformers: prefill, and a decode loop that batches
    every stream open on the engine into one forward per step."""

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        threads: int | None = None,
        device: str = "cpu",
        cpu_turns: str | None = None,
    ) -> None:
        """``cpu_turns``: on the CPU, each forward holds this turn
        (:mod:`omni_ar.engines.cpu_turns`)."""
        quiet_offline()
        super().__init__(model)
        self.device = device  # "cpu" or "cuda:0" (omni_core.plugin.StageContext.place)
        self.dtype = resolve_dtype(device, dtype)
        self.threads = threads
        self.model: Any = None
        self.batch = DecodeBatch(self)
        self.turn = cpu_turn(cpu_turns, device)
        # the padded tokens (prompts x the longest) one batched prefill forward may hold
        self.prefill_batch_tokens = PREFILL_BATCH_TOKENS
        self.prefill_forwards = 0  # batched prefill forwards run (for tests and stats)

    def load_model(self) -> None:
        """The model's weights, in the engine's dtype, on its device."""
        import torch
        from transformers import AutoModelForCausalLM

        if self.threads:
            torch.set_num_threads(self.threads)
        self.adopt(
            AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=getattr(torch, self.dtype), **self._device_map()
            )
        )

    def _device_map(self) -> dict[str, Any]:
        """``from_pretrained`` arguments that load the weights straight onto a GPU (none
        on the CPU, where they load as they always have)."""
        return {} if self.device == "cpu" else {"device_map": self.device}

    def adopt(self, model: Any) -> None:
        """Use ``model`` (a causal LM) for prefill and decode, on this engine's device."""
        self.model = model.eval()
        if self.device != "cpu":
            self.model.to(self.device)  # a no-op for what from_pretrained put there
        # transformers renamed `past_key_values` to `cache` during 5.x: use what this has
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = eos_set(eos)

    # -- structured generation --------------------------------------------------------
    def vocab_size(self) -> int | None:
        """The loaded model's vocabulary (its logits' width); None before it loads."""
        return None if self.model is None else int(self.model.config.vocab_size)

    def check_constraint(
        self, constraint: dict[str, Any], field: str = "structured_outputs"
    ) -> None:
        """A checked constraint compiled for this model's tokenizer (cached), or a
        ConstraintError naming ``field`` (see :meth:`omni_ar.structured.Grammars.matcher`)."""
        self._grammars().matcher(constraint, field=field)

    def matcher(self, params: SamplingParams, sampled: list[int] | None = None) -> Matcher | None:
        """The request's grammar matcher, past the tokens it ``sampled`` already (a
        decode continuing prefill's first token), or None for free text."""
        constraint = params.structured()
        if constraint is None:
            return None
        return self._grammars().matcher(constraint, sampled or [])

    def logits(
        self, params: SamplingParams, prompt: list[int] | None, output: list[int] | None = None
    ) -> Logits | None:
        """The request's logits processing (:class:`omni_ar.logits.Logits`) past its
        ``output`` so far, or None where its params change nothing."""
        if not adjusts(params):
            return None
        bad = None
        if params.bad_words:
            bad = bad_word_ids(self.tokenizer or self.load_tokenizer(), params.bad_words)
        return Logits(params, prompt or [], self.eos_ids, bad, output)

    # -- model ----------------------------------------------------------------------
    def generator(self, params: SamplingParams, offset: int = 0) -> Any:
        """The request's sampling generator, seeded, on the model's device (where the
        probabilities it samples from are): a seed gives the same tokens on every run on
        that device (not the same tokens on a CPU and a GPU); without one, each request
        draws from a fresh random seed, as vLLM's unseeded requests do."""
        import torch

        if params.temperature == 0:
            return None
        g = torch.Generator(device=self.device)
        if params.seed is None:
            g.seed()  # nondeterministic: two unseeded requests sample apart
        else:
            g.manual_seed(params.seed + offset)
        return g

    def tensor(self, ids: list[int] | list[list[int]]) -> Any:
        """Token ids as a tensor on the model's device."""
        import torch

        return torch.tensor(ids, device=self.device)

    def prefill_many(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        priorities: list[int] | None = None,
    ) -> Iterator[Sampled]:
        """``prefill`` for each prompt, in order, the prompts that arrived together in
        one forward (:meth:`_prefill_batch`, in chunks of at most
        ``prefill_batch_tokens`` padded tokens) where the model allows it
        (:meth:`_batches_prefill`), else one forward each. ``priorities`` are not read:
        the worker already ordered the batch (see :meth:`decode`)."""
        alone = any(p.prompt_logprobs is not None for p in params)  # every position's logits
        if len(prompts) < 2 or alone or not self._batches_prefill():
            for ids, p in zip(prompts, params, strict=True):
                yield self.prefill(ids, p)
            return
        for chunk in _chunks([len(ids) for ids in prompts], self.prefill_batch_tokens):
            if len(chunk) == 1:
                yield self.prefill(prompts[chunk[0]], params[chunk[0]])
            else:
                yield from self._prefill_batch(
                    [prompts[i] for i in chunk], [params[i] for i in chunk]
                )

    def prefill(self, ids: list[int], params: SamplingParams) -> Sampled:
        """(first token, its logprob, keys, values) for a prompt; a :class:`Sampled`,
        whose ``top`` holds the first token's alternatives."""
        import torch

        every = params.prompt_logprobs is not None
        with self.turn, torch.inference_mode():
            last = {} if every else self._last_logits()
            out = self.model(self.tensor([ids]), use_cache=True, **last)
        first = pick(
            out.logits[0, -1],
            params,
            self.generator(params),
            self.matcher(params),
            self.logits(params, ids),
        )
        prompt = prompt_logprobs(out.logits[0], ids, params.prompt_logprobs or 0) if every else None
        keys, values = kv_arrays(cache_of(out))
        return Sampled((*first, keys, values), first.top, prompt)

    def _prefill_batch(
        self, prompts: list[list[int]], params: list[SamplingParams]
    ) -> Iterator[Sampled]:
        """``prefill`` of several prompts in one forward, as the decode :class:`_Batch`
        steps: left-padded to the longest, an attention mask hiding the padding, and each
        row's own positions (0 for the padding), so a row computes what it would alone
        (up to float rounding: the sums run over a padded width). Each prompt's first
        token is picked from its row with its own generator and grammar, and its KV is
        its row with the padding cut off: ``prefill``'s arrays."""
        import torch

        lengths = [len(ids) for ids in prompts]
        width = max(lengths)
        pads = [width - n for n in lengths]
        ids = [[0] * pad + list(p) for p, pad in zip(prompts, pads, strict=True)]
        mask = [[0] * pad + [1] * n for pad, n in zip(pads, lengths, strict=True)]
        positions = [[0] * pad + list(range(n)) for pad, n in zip(pads, lengths, strict=True)]
        with self.turn, torch.inference_mode():
            out = self.model(
                self.tensor(ids),
                attention_mask=self.tensor(mask),
                position_ids=self.tensor(positions),
                use_cache=True,
                **self._last_logits(),
            )
        self.prefill_forwards += 1
        cache = cache_of(out)
        for row, (p, pad) in enumerate(zip(params, pads, strict=True)):
            state = self.logits(p, prompts[row])
            first = pick(out.logits[row, -1], p, self.generator(p), self.matcher(p), state)
            keys, values = kv_arrays(cache, row, pad)
            yield Sampled((*first, keys, values), first.top)

    def _last_logits(self) -> dict[str, Any]:
        """The forward's argument that computes the logits of the last position only
        (the one prefill samples from; also what ``generate`` asks for), where the model
        takes it."""
        params = inspect.signature(self.model.forward).parameters
        return {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def _batches_prefill(self) -> bool:
        """Whether prompts that arrive together may share a forward. Not on an M-RoPE
        model (its positions are 3-D and come from the images: one prompt at a time),
        nor on one whose cache is not attention KV alone (a recurrent or hybrid layer
        would run over the padding: no mask stops it); there prefill stays one by one."""
        config = self.model.config
        if uses_mrope(config):
            return False
        kinds = set(getattr(config.get_text_config(), "layer_types", None) or ["full_attention"])
        return kinds <= {"full_attention", "sliding_attention"}

    def decode(
        self,
        first: int,
        keys: np.ndarray,
        values: np.ndarray,
        params: SamplingParams,
        prompt: list[int] | None = None,  # the prompt's ids: for repetition_penalty only
        priority: int = 0,
    ) -> Iterator[Sampled]:
        """Tokens after ``first``, one per step, until EOS or ``max_tokens`` in all,
        decoded in one batch with every other request in flight.

        The request joins the batch at this call, not at the first ``next``: requests
        that arrive together share steps from the first one. Close the iterator to leave
        the batch (also before iterating), which frees the request's KV. ``priority`` is
        not read: nothing waits in this engine (every request joins at once), and the
        worker admits requests up to ``max_inflight`` by the stage's policy."""
        if params.max_tokens <= 1 or ends(first, params, self.eos_ids):
            return iter(())
        layers = [
            (self._kv_tensor(keys[i]), self._kv_tensor(values[i])) for i in range(keys.shape[0])
        ]
        return self._join(first, layers, params, prompt)

    def continue_from(
        self,
        first: Sampled,
        cache: Any,
        params: SamplingParams,
        prompt: list[int] | None = None,
        position_offset: int = 0,
    ) -> Iterator[Sampled]:
        """``first`` (already picked), then the tokens after it until EOS or
        ``max_tokens`` in all, decoded in the batch with every other request in flight
        (the multimodal engine's resume). ``cache`` (one row) holds every position before
        ``first``; it joins the batch at this call. ``position_offset``: each token sits at
        its index plus this (an M-RoPE model's delta); ``prompt``: its ids, for
        ``repetition_penalty``."""
        if params.max_tokens <= 1 or ends(first[0], params, self.eos_ids):
            return iter([first])
        layers = [(ly.keys[0], ly.values[0]) for ly in cache.layers]
        return self._join(first[0], layers, params, prompt, position_offset, queued=first)

    def join_before_first(
        self,
        last: int,
        cache: Any,
        params: SamplingParams,
        prompt: list[int],
        position_offset: int = 0,
    ) -> Iterator[Sampled]:
        """A request whose first token is still to pick, into the decode batch: ``last``
        (its prompt's last token) is the input of its first step, where the batch picks
        the first token with everyone else's next one; ``cache`` (one row) holds every
        position before ``last`` (the multimodal engine's resume: one forward fewer a
        request than picking the first token alone). ``position_offset`` and ``prompt``:
        as :meth:`continue_from`. The first pick uses the generator a request picking its
        first token alone would, the rest :meth:`continue_from`'s: a seed gives the same
        tokens either way."""
        layers = [(ly.keys[0], ly.values[0]) for ly in cache.layers]
        return self._join(last, layers, params, prompt, position_offset, picked=False)

    def _join(
        self,
        tok: int,
        layers: list[tuple[Any, Any]],
        params: SamplingParams,
        prompt: list[int] | None,
        position_offset: int = 0,
        queued: Sampled | None = None,
        picked: bool = True,
    ) -> BatchSteps:
        """A request into the decode batch: ``tok`` is its next step's input, its KV
        ``layers`` everything before it; ``queued``: a token it gives before any step.
        ``picked``: ``tok`` is its first token, else its prompt's last, and the batch's
        first step picks the first token with the generator a request picking it alone
        would use (the rest with the next one): a seed gives the same tokens either way."""
        out = [tok] if picked else []
        req = BatchRequest(
            params,
            self.generator(params, offset=len(out)),
            tok,
            params.max_tokens - len(out),
            position_offset=position_offset,
            gen_after=None if picked else self.generator(params, offset=1),
        )
        if queued is not None:
            req.queue.append(queued)
        req.matcher = self.matcher(params, out)
        req.logits = self.logits(params, prompt, out)
        return BatchSteps(self.batch, self.batch.add(req, layers))

    def cache_from(self, keys: Any, values: Any) -> Any:
        """A ``DynamicCache`` on the model's device, in its dtype, holding copies of
        stacked ``(L, kvH, T, D)`` KV arrays (numpy, or CPU torch tensors for bfloat16)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(keys.shape[0]):  # copies: the arrays may be read-only shared views
            cache.update(self._kv_tensor(keys[i])[None], self._kv_tensor(values[i])[None], i)
        return cache

    def _kv_tensor(self, a: Any) -> Any:
        """A copy of one layer's KV on the model's device, in the model's dtype."""
        import torch

        dtype = getattr(torch, self.dtype)
        if isinstance(a, torch.Tensor):
            return a.to(device=self.device, dtype=dtype, copy=True)
        return torch.tensor(a, device=self.device, dtype=dtype)

    def generate(self, source: Source, params: SamplingParams) -> list[int]:
        """The whole request in one call (the parity oracle's one-process run)."""
        first, _, keys, values = self.prefill(self.encode(source), params)
        return [first, *(t for t, _ in self.decode(first, keys, values, params))]

    def hidden_states(self, ids: list[list[int]], layer: int = -1) -> np.ndarray:
        """Per-token hidden states ``(batch, tokens, hidden)`` of one layer (-1: the
        last, after the final norm) for equal-length prompts: a text encoder's output,
        float32 on the CPU whatever the model's device and dtype."""
        import torch

        with self.turn, torch.inference_mode():
            out = self.model(self.tensor(ids), output_hidden_states=True)
        return out.hidden_states[layer].to("cpu").float().numpy()


def _chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """The indices of ``lengths``, in order, cut into runs whose padded size (the run's
    count times its longest) stays within ``budget``; a longer prompt runs alone."""
    runs: list[list[int]] = []
    width = 0
    for i, n in enumerate(lengths):
        if runs and (len(runs[-1]) + 1) * max(width, n) <= budget:
            runs[-1].append(i)
            width = max(width, n)
        else:
            runs.append([i])
            width = n
    return runs
