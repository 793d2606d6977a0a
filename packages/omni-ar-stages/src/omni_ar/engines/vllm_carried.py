"""The sampling fields that read the output so far, for a request vLLM continues from
another engine's first token.

A decode engine receives the request as prompt + prefill's first token, so vLLM counts
that token as the prompt's: the frequency and presence penalties (over the output only)
would miss it, and a bad word whose other tokens start with it would not be banned.
(The repetition penalty counts prompt and output alike, and ``min_tokens`` is passed on
less one.) This logits processor puts them back for the requests that carry
:data:`ARG` in their ``extra_args``: ``{"token": first, "frequency": f, "presence": p,
"repetition": r, "bad": [[ids], ...]}``. vLLM runs it after its logit bias and before its
penalties, so it sets the first token's logit to what, once vLLM's repetition penalty
``rep`` and its own penalties have run, gives the logit vLLM would have had with that
token in the output: ``rep_inverse(rep(logit) - f - p)`` (``p`` only while the output
holds no copy of it, which vLLM's own presence penalty then counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omni_ar.engines.vllm_rows import RowLogitsProcessor

ARG = "omni_first"  # the extra_args key: the first token and the fields that read it


@dataclass
class _Row:
    carried: dict[str, Any]
    output: list[int]  # vLLM's live list of the request's output tokens


def carried(params: Any, first: int, bad: list[list[int]]) -> dict[str, Any] | None:
    """The :data:`ARG` entry of a decode request with ``params`` (omni's) continuing from
    ``first``, or None where nothing of it reads the output."""
    bad = [s for s in bad if len(s) > 1 and s[0] == first]
    if not (params.frequency_penalty or params.presence_penalty or bad):
        return None
    return {
        "token": first,
        "frequency": params.frequency_penalty,
        "presence": params.presence_penalty,
        "repetition": params.repetition_penalty,
        "bad": bad,
    }


class FirstTokenLogitsProcessor(RowLogitsProcessor[_Row]):
    """The first token's penalties and the bad words that span it (see the module)."""

    def row(self, extra_args: dict[str, Any], output: list[int]) -> _Row | None:
        entry = extra_args.get(ARG)
        return _Row(entry, output) if isinstance(entry, dict) else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, row in self.rows.items():
            c = row.carried
            out = [t for t in row.output if t >= 0]  # -1: async scheduling's placeholder
            seen = [c["token"], *out]
            for seq in c["bad"]:
                prefix = seq[:-1]
                if len(out) < len(prefix) <= len(seen) and seen[-len(prefix) :] == prefix:
                    logits[index, seq[-1]] = float("-inf")
            penalty = c["frequency"] + (0.0 if c["token"] in out else c["presence"])
            if penalty:
                tok, r = c["token"], c["repetition"]
                value = logits[index, tok]
                target = (value / r if value > 0 else value * r) - penalty
                logits[index, tok] = target * r if target > 0 else target / r
        return logits
