"""The reference engine: Hugging Face transformers, in the stage's own process.

Prefill runs the prompt forward and returns the first token with the KV cache as plain
arrays (layers stacked: ``(layers, kv_heads, tokens, head_dim)``), so it can cross
processes through the shared-memory data plane; decode rebuilds a ``DynamicCache`` from
them and steps from there, giving the same tokens as ``model.generate``.

Decode is batched across requests (:class:`_Batch`): each request's iterator, when it has
no token queued, runs one forward of every request in flight, so a decode stage driving N
request generators (``max_inflight: N``) costs one forward per step, not N. Requests of
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
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from omni_core.worker.devices import default_dtype
from omni_hf import quiet_offline

from omni_ar.engines.cpu_turns import cpu_turn
from omni_ar.logits import Logits, adjusts, bad_word_ids, check_tokens, ends, warp
from omni_ar.multimodal.mrope import uses_mrope
from omni_ar.params import Sampled, SamplingParams
from omni_ar.structured import Grammars, Matcher

# the default of TransformersEngine.prefill_batch_tokens: a burst of 8 prompts of 1,024
# tokens in one forward; longer bursts split (the attention scores grow with the square)
PREFILL_BATCH_TOKENS = 8192


class TransformersEngine:
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
        self.model_dir = model
        self.device = device  # "cpu" or "cuda:0" (omni_core.worker.devices.place)
        self.dtype = default_dtype(device) if dtype == "auto" else dtype
        self.threads = threads
        self.model: Any = None
        self.tokenizer: Any = None
        self.batch = _Batch(self)
        self.turn = cpu_turn(cpu_turns, device)
        self.grammars: Grammars | None = None  # built at the first constrained request
        # the padded tokens (prompts x the longest) one batched prefill forward may hold
        self.prefill_batch_tokens = PREFILL_BATCH_TOKENS
        self.prefill_forwards = 0  # batched prefill forwards run (for tests and stats)

    def load_tokenizer(self) -> Any:
        """The model's tokenizer (and its chat template), kept as ``self.tokenizer``."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self.tokenizer

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
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    # -- tokens ---------------------------------------------------------------------
    def encode(self, source: str | list[dict[str, str]]) -> list[int]:
        """A prompt's token ids; chat messages go through the chat template first."""
        if isinstance(source, str):
            return list(self.tokenizer(source)["input_ids"])
        ids = self.tokenizer.apply_chat_template(source, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    # -- structured generation --------------------------------------------------------
    def _grammars(self) -> Grammars:
        """The constraints' compiler for this model's tokenizer (loaded on first use)."""
        if self.grammars is None:
            tokenizer = self.tokenizer or self.load_tokenizer()
            vocab = int(self.model.config.vocab_size)
            self.grammars = Grammars(tokenizer, vocab, self.eos_ids)
        return self.grammars

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

    def check_tokens(self, params: SamplingParams) -> None:
        """A RequestError naming the field where ``params`` name a token outside the
        model's vocabulary (:func:`omni_ar.logits.check_tokens`; not before the model
        is loaded)."""
        if self.model is None:
            return
        tokenizer = (self.tokenizer or self.load_tokenizer()) if params.bad_words else None
        check_tokens(params, int(self.model.config.vocab_size), tokenizer)

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
    def _pick(
        self,
        logits: Any,
        params: SamplingParams,
        gen: Any,
        matcher: Matcher | None = None,
        state: Logits | None = None,
    ) -> Sampled:
        """The next token of one request from its logits (only those its grammar allows
        next, with a ``matcher``, which then advances; processed by its ``state``, which
        then takes the token), with its logprob (before the processing, as vLLM's raw
        logprobs) and, for ``top_logprobs``, the most likely alternatives."""
        import torch

        logits = logits.float()
        if matcher is not None:
            logits = logits.clone()  # a view of the batch's logits otherwise
            matcher.mask(logits)
        logprobs = torch.log_softmax(logits, dim=-1)
        top: list[tuple[int, float]] = []
        if params.top_logprobs:
            vals, idx = torch.topk(logprobs, min(params.top_logprobs, logprobs.shape[-1]))
            top = list(zip(idx.tolist(), vals.tolist(), strict=True))
        if state is not None:
            logits = state.adjust(logits)
        if params.temperature == 0:
            tok = int(torch.argmax(logits))
        else:
            probs = torch.softmax(warp(logits / params.temperature, params), dim=-1)
            if params.top_p < 1.0:
                sorted_p, idx = torch.sort(probs, descending=True)
                keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
                probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
            tok = int(torch.multinomial(probs, 1, generator=gen))
        if matcher is not None:
            matcher.accept(tok)
        if state is not None:
            state.accept(tok)
        return Sampled((tok, float(logprobs[tok])), top)

    def generator(self, params: SamplingParams, offset: int = 0) -> Any:
        """The request's sampling generator, seeded, on the model's device (where the
        probabilities it samples from are): a seed gives the same tokens on every run on
        that device (not the same tokens on a CPU and a GPU)."""
        import torch

        if params.temperature == 0:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed((params.seed or 0) + offset)
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
    ) -> Iterator[tuple[int, float, np.ndarray, np.ndarray]]:
        """``prefill`` for each prompt, in order, the prompts that arrived together in
        one forward (:meth:`_prefill_batch`, in chunks of at most
        ``prefill_batch_tokens`` padded tokens) where the model allows it
        (:meth:`_batches_prefill`), else one forward each. ``priorities`` are not read:
        the worker already ordered the batch (see :meth:`decode`)."""
        if len(prompts) < 2 or not self._batches_prefill():
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

    def prefill(
        self, ids: list[int], params: SamplingParams
    ) -> tuple[int, float, np.ndarray, np.ndarray]:
        """(first token, its logprob, keys, values) for a prompt; a :class:`Sampled`,
        whose ``top`` holds the first token's alternatives."""
        import torch

        with self.turn, torch.inference_mode():
            out = self.model(self.tensor([ids]), use_cache=True, **self._last_logits())
        first = self._pick(
            out.logits[0, -1],
            params,
            self.generator(params),
            self.matcher(params),
            self.logits(params, ids),
        )
        keys, values = kv_arrays(_cache_of(out))
        return Sampled((*first, keys, values), first.top)

    def _prefill_batch(
        self, prompts: list[list[int]], params: list[SamplingParams]
    ) -> Iterator[tuple[int, float, np.ndarray, np.ndarray]]:
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
        cache = _cache_of(out)
        for row, (p, pad) in enumerate(zip(params, pads, strict=True)):
            state = self.logits(p, prompts[row])
            first = self._pick(out.logits[row, -1], p, self.generator(p), self.matcher(p), state)
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
    ) -> Iterator[tuple[int, float]]:
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
        req = _Request(params, self.generator(params, offset=1), first, params.max_tokens - 1)
        req.matcher = self.matcher(params, [first])
        req.logits = self.logits(params, prompt, [first])
        return _Steps(self.batch, self.batch.add(req, layers))

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

    def steps(
        self,
        first: int,
        cache: Any,
        params: SamplingParams,
        position_offset: int | None = None,
        prompt: list[int] | None = None,
    ) -> Iterator[tuple[int, float]]:
        """The tokens after ``first`` (the cache holds everything before it), one per
        step, until EOS or ``max_tokens`` in all: one request alone, in its own cache
        (the multimodal engine's resume; ``decode`` batches). ``position_offset``: each
        token's position is given, its index plus this (an M-RoPE model's delta), instead
        of left to the model; ``prompt``: its ids, for ``repetition_penalty``."""
        import torch

        gen = self.generator(params, offset=1)
        matcher = self.matcher(params, [first])
        state = self.logits(params, prompt, [first])
        tok = first
        for _ in range(params.max_tokens - 1):
            if ends(tok, params, self.eos_ids):
                return
            kwargs = {self.cache_kw: cache}
            if position_offset is not None:
                kwargs["position_ids"] = self.tensor([[cache.get_seq_length() + position_offset]])
            with torch.inference_mode():
                out = self.model(self.tensor([[tok]]), use_cache=True, **kwargs)
            cache = _cache_of(out)
            s = self._pick(out.logits[0, -1], params, gen, matcher, state)
            tok = s[0]
            yield s

    def generate(self, source: str | list[dict[str, str]], params: SamplingParams) -> list[int]:
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


@dataclass
class _Request:
    """A request in the decode batch: ``tok`` is the input of its next step."""

    params: SamplingParams
    gen: Any  # its seeded torch.Generator (None: greedy)
    tok: int
    left: int  # tokens it may still produce
    queue: deque[Sampled] = field(default_factory=deque)
    done: bool = False
    matcher: Matcher | None = None  # its grammar's state, for structured output
    logits: Logits | None = None  # its penalties, biases, bad words... (omni_ar.logits)


class _Batch:
    """The requests an engine decodes together, one forward per step for all of them.

    The cache holds one row per member, left-padded to the longest: row ``i`` has
    ``lengths[i]`` real positions at its right end, which ``mask`` marks; each step's
    position ids are the rows' own lengths, so a row computes what it would alone. A
    request joining or leaving marks the batch ``dirty``, and the next step rebuilds the
    cache from each member's own KV (cut out of the old cache, or handed in on join)."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine
        self.requests: dict[int, _Request] = {}
        self.pending: dict[int, list[tuple[Any, Any]]] = {}  # KV of requests not yet in
        # requests paused for better ones (preempted): out of the steps, their KV kept
        self.parked: dict[int, tuple[_Request, list[tuple[Any, Any]] | None]] = {}
        self.members: list[int] = []  # the cache's rows
        self.lengths: list[int] = []
        self.cache: Any = None
        self.mask: Any = None
        self.dirty = False
        self.next_id = 0
        self.forwards = 0  # batched forwards run (for tests and stats)

    def add(self, req: _Request, layers: list[tuple[Any, Any]]) -> int:
        """Admit a request with its KV, per layer ``(kv_heads, tokens, head_dim)``."""
        rid, self.next_id = self.next_id, self.next_id + 1
        self.requests[rid] = req
        self.pending[rid] = layers
        self.dirty = True
        return rid

    def remove(self, rid: int) -> None:
        """Drop a request (finished or closed); its KV goes with the next rebuild."""
        self.parked.pop(rid, None)
        if self.requests.pop(rid, None) is not None:
            self.pending.pop(rid, None)
            self.dirty = True

    def park(self, rid: int) -> None:
        """Take a request out of the steps (preempted), keeping a copy of its KV and
        the tokens it already has; :meth:`unpark` puts it back where it stopped."""
        req = self.requests.get(rid)
        if req is None:
            return
        layers = None
        if not req.done:  # a finished one has only its queued tokens left to give
            layers = [(k.clone(), v.clone()) for k, v in self._own_kv(rid)]
        del self.requests[rid]
        self.parked[rid] = (req, layers)
        self.dirty = True

    def unpark(self, rid: int) -> None:
        """A parked request joins the steps again with its own KV."""
        parked = self.parked.pop(rid, None)
        if parked is None:
            return
        req, layers = parked
        self.requests[rid] = req
        if layers is not None:
            self.pending[rid] = layers
            self.dirty = True

    def _own_kv(self, rid: int) -> list[tuple[Any, Any]]:
        """A member's KV without padding: a view of its row of the batch cache."""
        if rid in self.pending:
            return self.pending.pop(rid)
        row = self.members.index(rid)
        pad = self.mask.shape[1] - self.lengths[row]
        return [(ly.keys[row, :, pad:], ly.values[row, :, pad:]) for ly in self.cache.layers]

    def _rebuild(self) -> None:
        members = [r for r, q in self.requests.items() if not q.done]
        kv = [self._own_kv(r) for r in members]
        self.cache, self.mask, self.lengths = left_padded(kv, self.engine.device)
        self.members = members
        self.dirty = False

    def step(self) -> None:
        """One forward of every member: a token queued for each; the ones that end
        (EOS, ``max_tokens``) leave the batch."""
        import torch

        e = self.engine
        if self.dirty:
            self._rebuild()
        if not self.members:
            raise RuntimeError("transformers engine: a stream waits but no request is in flight")
        reqs = [self.requests[r] for r in self.members]
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(reqs), 1))], dim=1)
        with e.turn, torch.inference_mode():
            out = e.model(
                e.tensor([[q.tok] for q in reqs]),
                attention_mask=self.mask,
                position_ids=e.tensor([[n] for n in self.lengths]),
                use_cache=True,
                **{e.cache_kw: self.cache},
            )
        self.forwards += 1
        self.cache = _cache_of(out)
        self.lengths = [n + 1 for n in self.lengths]
        for row, q in enumerate(reqs):
            s = e._pick(out.logits[row, -1], q.params, q.gen, q.matcher, q.logits)
            q.queue.append(s)
            q.tok, q.left = s[0], q.left - 1
            if q.left <= 0 or ends(q.tok, q.params, e.eos_ids):
                q.done = self.dirty = True


class _Steps:
    """A request's tokens from the batch; ``close`` takes it out even when it was never
    iterated (a generator's ``finally`` would not run then)."""

    def __init__(self, batch: _Batch, rid: int) -> None:
        self.batch = batch
        self.rid = rid

    def __iter__(self) -> _Steps:
        return self

    def __next__(self) -> Sampled:
        req = self.batch.requests.get(self.rid)
        if req is None:
            if self.rid in self.batch.parked:  # a paused request must be resumed first
                raise RuntimeError(f"decode request {self.rid} was advanced while paused")
            raise StopIteration
        while not req.queue:
            if req.done:
                self.close()
                raise StopIteration
            self.batch.step()
        return req.queue.popleft()

    def close(self) -> None:
        self.batch.remove(self.rid)

    def pause(self) -> None:
        """Out of the batch's steps until :meth:`resume` (the request is preempted)."""
        self.batch.park(self.rid)

    def resume(self) -> None:
        self.batch.unpark(self.rid)


def left_padded(kv: list[list[tuple[Any, Any]]], device: str) -> tuple[Any, Any, list[int]]:
    """One cache of several requests' KV (each a list per layer of ``(kv_heads, tokens,
    head_dim)`` keys and values), each row left-padded to the longest: the cache, the
    mask of each row's real positions, and each row's length (a batched decode's rows)."""
    import torch
    from transformers import DynamicCache

    lengths = [layers[0][0].shape[1] for layers in kv]
    width = max(lengths, default=0)
    cache = DynamicCache()
    for i in range(len(kv[0]) if kv else 0):
        k0 = kv[0][i][0]
        shape = (len(kv), k0.shape[0], width, k0.shape[2])
        keys, values = k0.new_zeros(shape), k0.new_zeros(shape)
        for row, (layers, n) in enumerate(zip(kv, lengths, strict=True)):
            keys[row, :, width - n :] = layers[i][0]
            values[row, :, width - n :] = layers[i][1]
        cache.update(keys, values, i)
    mask = torch.zeros((len(kv), width), dtype=torch.long, device=device)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return cache, mask, lengths


def kv_arrays(cache: Any, row: int = 0, start: int = 0) -> tuple[Any, Any]:
    """One row of a cache as stacked ``(layers, kv_heads, tokens, head_dim)`` arrays on
    the CPU (see :func:`to_host`), its positions from ``start`` on (past a left padding)."""
    import torch

    keys = torch.stack([layer.keys[row, :, start:] for layer in cache.layers])
    values = torch.stack([layer.values[row, :, start:] for layer in cache.layers])
    return to_host(keys), to_host(values)


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


def to_host(t: Any) -> Any:
    """A tensor as an array for the data plane: copied to the CPU once (no copy there
    already), a numpy array where numpy has its dtype (float32, float16), else a CPU
    torch tensor (bfloat16, which the data plane carries as it is)."""
    import torch

    t = t.detach().to("cpu")
    return t if t.dtype == torch.bfloat16 else t.numpy()


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
