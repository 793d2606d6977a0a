"""The transformers engine's sampler: one request's next token from its logits, under
its grammar and its logits processing, with the logprobs vLLM would report."""

from __future__ import annotations

from typing import Any

from omni_ar.logits import Logits, warp
from omni_ar.params import PromptLogprobs, Sampled, SamplingParams
from omni_ar.structured import Matcher


def pick(
    logits: Any,
    params: SamplingParams,
    gen: Any,
    matcher: Matcher | None = None,
    state: Logits | None = None,
) -> Sampled:
    """The next token of one request from its logits (only those its grammar allows
    next, with a ``matcher``, which then advances; processed by its ``state``, which
    then takes the token), with its logprob (before the processing, as vLLM's raw
    logprobs) and, for ``top_logprobs``, the most likely alternatives. ``gen``: the
    request's seeded ``torch.Generator`` (None: greedy)."""
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


def prompt_logprobs(logits: Any, ids: list[int], k: int) -> PromptLogprobs:
    """Each prompt token's logprob after the first, from the prompt's logits (one row a
    position: ``logits[i]`` predicts ``ids[i + 1]``), raw as vLLM's prompt logprobs, with
    its rank (1 + the tokens likelier than it) and its ``k`` likeliest alternatives."""
    import torch

    lps = torch.log_softmax(logits[: len(ids) - 1].float(), dim=-1)
    nxt = torch.tensor(ids[1:], device=lps.device)
    picked = lps.gather(1, nxt[:, None])
    chosen = picked[:, 0].tolist()
    ranks = ((lps > picked).sum(dim=-1) + 1).tolist()
    if k:
        vals, idx = torch.topk(lps, min(k, lps.shape[-1]), dim=-1)
        tops = [
            list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)
        ]
    else:
        tops = [[] for _ in chosen]
    return list(zip(chosen, ranks, tops, strict=True))
