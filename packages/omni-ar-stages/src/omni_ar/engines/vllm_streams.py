"""The vLLM engine's requests as streams: the tokens each engine step gave a request,
queued until its reader takes them (:class:`StreamState`), and the iterator a decode
returns (:class:`VllmSteps`), whose ``close`` aborts the request in vLLM."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from omni_ar.engines.vllm_requires_kv import forget_failure
from omni_ar.params import PromptLogprobs, Sampled

if TYPE_CHECKING:
    from collections.abc import Iterator


class StreamingEngine(Protocol):
    """What a stream reads of its engine (:class:`~omni_ar.engines.vllm_engine.VllmEngine`);
    a protocol, so that this module, which the engine imports, does not import it."""

    streams: dict[str, StreamState]
    """The requests in the engine, by id."""
    engine: Any
    """vLLM's ``LLMEngine``."""

    def request_tokens(self, rid: str) -> Iterator[Sampled | None]:
        """The request's tokens (``None`` after a step that gave it none)."""
        ...


@dataclass
class StreamState:
    """One request's tokens not read yet, and how vLLM ended it."""

    tokens: deque[Sampled] = field(default_factory=deque)
    done: bool = False
    top: int = 0  # alternatives per token it asked for (top_logprobs)
    kv_key: str | None = None  # its handoff key: where the plugin keeps its failure
    error: str | None = None  # why vLLM ended it with finish_reason "error"
    prompt: int | None = None  # prompt_logprobs asked for, until they came with a token


def prompt_of(out: Any, k: int) -> PromptLogprobs | None:
    """vLLM's prompt logprobs of a request output (on its first; None on the others) as
    :data:`PromptLogprobs`: vLLM's position i > 0 holds a dict of the prompt token (at
    its rank) and the ``k`` likeliest (ranks 1..k)."""
    given = getattr(out, "prompt_logprobs", None)
    if not given:
        return None
    ids = out.prompt_token_ids
    rows: PromptLogprobs = []
    for i in range(1, len(ids)):
        d = given[i] or {}
        top = sorted((lp.rank, t, lp.logprob) for t, lp in d.items() if 0 < (lp.rank or 0) <= k)
        rank = d[ids[i]].rank or 1 + sum(lp.logprob > d[ids[i]].logprob for lp in d.values())
        rows.append((d[ids[i]].logprob, rank, [(t, x) for _, t, x in top]))
    return rows


class VllmSteps:
    """The tokens of a request already in the engine; ``close`` aborts it even when it
    was never iterated (a generator's ``finally`` would not run then)."""

    def __init__(
        self, engine: StreamingEngine, rid: str, kv_key: str | None, grammar_key: str | None = None
    ) -> None:
        self.engine = engine
        self.rid = rid
        self.kv_key = kv_key
        self.grammar_key = grammar_key  # its matcher in vllm_grammar.MATCHERS
        self.gen = engine.request_tokens(rid)

    def __iter__(self) -> VllmSteps:
        return self

    def __next__(self) -> Sampled | None:
        try:
            s = next(self.gen)
        except StopIteration:
            self.close()
            raise
        if self.grammar_key is not None:
            from omni_ar.engines.vllm_grammar import MATCHERS

            state = MATCHERS.get(self.grammar_key)
            if state is not None and state.error is not None:
                self.close()
                raise RuntimeError(f"structured output: {state.error}")
        return s

    @property
    def ended(self) -> bool:
        """vLLM ended the request and every token it gave has been read."""
        st = self.engine.streams.get(self.rid)
        return st is None or (st.done and not st.tokens)

    def close(self) -> None:
        from omni_ar.engines.kv_connector import INBOX

        self.gen.close()  # a started stream aborts in its own finally
        st = self.engine.streams.pop(self.rid, None)
        if st is not None and not st.done:  # never iterated
            self.engine.engine.abort_request([self.rid])
        INBOX.pop(self.kv_key or "", None)  # never loaded (cancelled while waiting)
        forget_failure(self.kv_key)
        if self.grammar_key is not None:
            from omni_ar.engines.vllm_grammar import MATCHERS

            MATCHERS.pop(self.grammar_key, None)
