"""Structured output for a request vLLM continues from another engine's first token.

vLLM's own structured outputs start a request's grammar at the first token it samples,
but a decode engine receives the request as prompt + prefill's first token: under its
own grammar the second token would be checked as if it were the first. So the decode
engine holds a handed-off request to its constraint with this logits processor instead:
the engine puts the request's :class:`omni_ar.structured.Matcher` (already past the
first token) in :data:`MATCHERS` under a key the request carries in its sampling
params' ``extra_args``; each step the processor advances the matcher by the tokens vLLM
sampled and masks the request's logits row. The matcher compiles the constraint with
vLLM's settings (xgrammar, JSON without free whitespace), so the tokens allowed are the
ones vLLM's own grammar would allow at the same place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omni_ar.engines.vllm_rows import RowLogitsProcessor
from omni_ar.structured import Matcher

ARG = "omni_grammar"  # the extra_args key naming a request's matcher in MATCHERS


@dataclass
class Constrained:
    """A request's matcher and how many of its output tokens the matcher accepted (it
    outlives the request's place in the batch: a preempted request comes back with its
    output so far)."""

    matcher: Matcher
    accepted: int = 0
    error: str | None = None  # the grammar refused a token: the engine fails the request


MATCHERS: dict[str, Constrained] = {}  # key -> state, put and removed by the engine


@dataclass
class _Row:
    state: Constrained
    output: list[int]  # vLLM's live list of the request's output tokens


class GrammarLogitsProcessor(RowLogitsProcessor[_Row]):
    """Masks the logits of the requests that name a matcher in :data:`MATCHERS`."""

    def row(self, extra_args: dict[str, Any], output: list[int]) -> _Row | None:
        key = extra_args.get(ARG)
        state = MATCHERS.get(key) if isinstance(key, str) else None
        return _Row(state, output) if state is not None else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row advanced by the tokens sampled since its last mask, then masked. Here,
        not in ``update_state``: under async scheduling (vLLM's default on a GPU) the
        output list holds a ``-1`` placeholder for the step in flight until just before
        sampling; a placeholder still there ends the advance (it is taken next time)."""
        for index, row in list(self.rows.items()):
            st = row.state
            try:
                for tok in row.output[st.accepted :]:
                    if tok < 0:
                        break
                    st.matcher.accept(tok)
                    st.accepted += 1
            except RuntimeError as e:  # never in vLLM's step: the engine fails the request
                st.error = str(e)
                del self.rows[index]
                continue
            st.matcher.mask(logits[index])
        return logits
