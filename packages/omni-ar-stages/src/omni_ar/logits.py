"""The sampling fields past temperature and top_p, with vLLM's meaning, on any engine.

vLLM's sampler processes a request's logits in this order, and the transformers engine
does the same (:class:`Logits`, one per request, so each request in a batched decode has
its own): bad words, min_tokens (the end-of-sequence and stop tokens masked until
``min_tokens`` were generated) and logit_bias; then the repetition penalty (a logit of a
token in the prompt or the output divided by it where positive, multiplied where not, as
transformers' ``RepetitionPenaltyLogitsProcessor``), and the frequency and presence
penalties over the output tokens only (OpenAI's definition); greedy takes the argmax of
that. Sampling then divides by the temperature and keeps the tokens at least ``min_p``
times the likeliest's probability and the ``top_k`` likeliest (transformers'
``MinPLogitsWarper`` and ``TopKLogitsWarper``), before top_p.

Bad words are tokenized as vLLM does (each both as written and after a space, where that
makes other tokens of the same count) and banned as transformers' ``NoBadWordsLogitsProcessor``
bans them, over the output tokens: a word's last token is masked where the output ends
with the rest of it. :func:`check_tokens` refuses token ids outside the model's vocabulary
(``logit_bias``'s keys, ``stop_token_ids``, bad words' tokens), naming the field.
"""

from __future__ import annotations

from typing import Any

from omni_ar.errors import RequestError
from omni_ar.params import SamplingParams


def bad_word_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token sequences ``words`` ban, as vLLM's ``update_from_tokenizer`` makes them:
    each word without its leading blanks, and after a space where that gives a sequence
    of the same length that starts otherwise (the word in the middle of a text)."""
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise RequestError(f"field 'bad_words': {word[:40]!r} makes no token")
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def check_tokens(params: SamplingParams, vocab: int, tokenizer: Any = None) -> list[list[int]]:
    """A RequestError naming the field where a token id of ``params`` is outside a
    vocabulary of ``vocab`` ids; the bad words' token sequences (``tokenizer`` needed
    only where there are bad words)."""
    for key in params.logit_bias or {}:
        if int(key) >= vocab:
            raise RequestError(
                f"field 'logit_bias': token id {key} is not in the vocabulary (0..{vocab - 1})"
            )
    for t in params.stop_token_ids:
        if t >= vocab:
            raise RequestError(
                f"field 'stop_token_ids': token id {t} is not in the vocabulary (0..{vocab - 1})"
            )
    if not params.bad_words:
        return []
    seqs = bad_word_ids(tokenizer, params.bad_words)
    if any(t >= vocab for s in seqs for t in s):
        raise RequestError("field 'bad_words': a word makes a token outside the vocabulary")
    return seqs


def adjusts(params: SamplingParams) -> bool:
    """Whether ``params`` change the logits before sampling (greedy included)."""
    return bool(
        params.frequency_penalty
        or params.presence_penalty
        or params.repetition_penalty != 1.0
        or params.logit_bias
        or params.min_tokens
        or params.bad_words
        or (params.temperature > 0 and (params.top_k > 0 or params.min_p > 0))
    )


def ends(tok: int, params: SamplingParams, eos_ids: set[int]) -> bool:
    """Whether ``tok`` ends the request: an end-of-sequence token (but with
    ``ignore_eos``) or one of its ``stop_token_ids``."""
    return (tok in eos_ids and not params.ignore_eos) or tok in params.stop_token_ids


class Logits:
    """One request's logits processing (see the module's text): its prompt's tokens,
    the tokens generated so far (:meth:`accept`), and its bad words' sequences."""

    def __init__(
        self,
        params: SamplingParams,
        prompt: list[int],
        eos_ids: set[int],
        bad_words: list[list[int]] | None = None,
        output: list[int] | None = None,
    ) -> None:
        self.params = params
        self.prompt = list(prompt)
        self.output: list[int] = list(output or [])
        self.stops = sorted(set(eos_ids) | set(params.stop_token_ids))
        self.bad = bad_words or []
        self.bias = {int(k): v for k, v in (params.logit_bias or {}).items()}

    def accept(self, tok: int) -> None:
        self.output.append(tok)

    def adjust(self, logits: Any) -> Any:
        """``logits`` (one row, float32) with bad words, min_tokens, logit_bias and the
        penalties applied: a new tensor."""
        import torch

        p = self.params
        logits = logits.float().clone()
        vocab = logits.shape[-1]
        out = self.output
        for seq in self.bad:
            prefix = seq[:-1]
            if len(prefix) <= len(out) and (not prefix or out[len(out) - len(prefix) :] == prefix):
                logits[seq[-1]] = float("-inf")
        if len(out) < p.min_tokens and self.stops:
            logits[[t for t in self.stops if t < vocab]] = float("-inf")
        for t, b in self.bias.items():
            if t < vocab:
                logits[t] += b
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(self.prompt) | set(out)), dtype=torch.long)
            seen = seen[seen < vocab].to(logits.device)
            score = logits[seen]
            score = torch.where(
                score > 0, score / p.repetition_penalty, score * p.repetition_penalty
            )
            logits[seen] = score
        if (p.frequency_penalty or p.presence_penalty) and out:
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)
            counts = counts[:vocab].to(device=logits.device, dtype=logits.dtype)
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        return logits


def warp(logits: Any, params: SamplingParams) -> Any:
    """Temperature-scaled ``logits`` (one row) with min_p and then top_k applied, as
    vLLM's sampler does before top_p: the tokens they drop at -inf."""
    import torch

    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits
