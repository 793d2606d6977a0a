"""Logprobs between the stages: each token's alternatives as decode sends them
(``top_ids``) and as the caller sees them (text)."""

from __future__ import annotations

from typing import Any

from omni_ar.params import PromptLogprobs

TOP_IDS = "top_ids"  # decode -> postprocess: per token, its alternatives' [id, logprob]
# decode -> postprocess, with the first segment: the prompt's ids, logprobs and alternatives
PROMPT_LOGPROB_IDS = "prompt_logprob_ids"
# postprocess (or an inline-detokenizing decode) -> the caller: the same as text, every
# prompt token's, the first one's logprob and alternatives None (nothing comes before it)
PROMPT_LOGPROBS = "prompt_logprobs"


class Alternatives:
    """One request's ``top_ids`` from decode, by the token's index in its stream. A
    window may cut an event, whose payload (the whole list) then comes with each window
    it spans, so each event's list is taken once, by its sequence number."""

    def __init__(self) -> None:
        self.items: list[list[list[Any]]] = []
        self.last_seq = -1

    def add(self, window: Any) -> None:
        for p in window.pieces:
            if p.sequence > self.last_seq:
                self.items.extend(p.payload.get(TOP_IDS, ()))
                self.last_seq = p.sequence

    def take(self, start: int, n: int) -> list[list[list[Any]]]:
        return self.items[start : start + n]


def top_ids(s: tuple[int, float]) -> list[list[Any]]:
    """An engine token's alternatives as ``[id, logprob]`` lists (none from an engine
    that gave none)."""
    return [[t, lp] for t, lp in getattr(s, "top", ())]


def top_payload(tokenizer: Any, tops: list[list[list[Any]]]) -> list[list[list[Any]]]:
    """``top_ids`` as the segment payload's ``top_logprobs``: per token, its
    alternatives as ``[token_text, logprob]`` pairs, most likely first (the text as
    :func:`token_texts` gives it), for OpenAI's ``logprobs.content[].top_logprobs``."""
    out = []
    for alts in tops:
        texts = token_texts(tokenizer, [t for t, _ in alts])
        out.append([[text, lp] for text, (_, lp) in zip(texts, alts, strict=True)])
    return out


def token_texts(tokenizer: Any, tokens: list[int]) -> list[str]:
    """Each token's own text (special tokens included), for logprobs: what OpenAI's
    ``logprobs.content[].token`` holds."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]


def prompt_ids_payload(ids: list[int], prompt: PromptLogprobs) -> dict[str, Any]:
    """An engine's prompt logprobs of ``ids`` as the first segment carries them."""
    return {
        "ids": list(ids),
        "logprobs": [lp for lp, _, _ in prompt],
        "ranks": [rank for _, rank, _ in prompt],
        "top": [[[t, x] for t, x in top] for _, _, top in prompt],
    }


def prompt_text_payload(tokenizer: Any, sent: dict[str, Any]) -> dict[str, Any]:
    """:func:`prompt_ids_payload` for the caller: each prompt token's id and text, its
    logprob and rank, and its alternatives as ``[text, logprob]`` and as ``[id, logprob]``
    (None for the first token: nothing predicts it)."""
    return {
        "ids": sent["ids"],
        "tokens": token_texts(tokenizer, sent["ids"]),
        "logprobs": [None, *sent["logprobs"]],
        "ranks": [None, *sent["ranks"]],
        "top": [None, *top_payload(tokenizer, sent["top"])],
        "top_ids": [None, *sent["top"]],
    }
