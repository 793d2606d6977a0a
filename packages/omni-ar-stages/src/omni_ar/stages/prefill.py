"""``ar.prefill``: prompt ids -> the first token and the prompt's KV, for decode."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import msgspec
from omni_core.plugin import StageEvent, StageInput

from omni_ar.handoff import Handoff
from omni_ar.params import RequestError, SamplingParams
from omni_ar.stages.base import ModelOptions, ModelStage
from omni_ar.stages.logprobs import prompt_ids_payload, top_ids


class PrefillOptions(ModelOptions, kw_only=True):
    """``ar.prefill``'s options: :class:`ModelOptions`, the local-prefill threshold and
    whether a batch's prompts share a forward."""

    # conditional disaggregation: a prompt of at most this many tokens is not prefilled
    # here but passed on, and the decode engine prefills it in its own steps, beside the
    # requests it is decoding (no KV crosses); 0: every prompt is prefilled here
    local_prefill_max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # the prompts of one batch (max_batch_size) in one forward where the engine can
    # (transformers: left-padded; vLLM: its scheduler's steps); false: one prompt after
    # another, each alone, for outputs bit for bit those of a lone prompt (a padded
    # batch's sums round differently: ~1e-6 in float32, in bfloat16 enough to flip a
    # near tie between two tokens)
    batch_prefill: bool = True


class Prefill(ModelStage):
    """Prompt ids -> the first token, with the prompt's KV cache as arrays; or, for a
    prompt of at most ``local_prefill_max_tokens``, the prompt alone, for decode to
    prefill (a short prompt costs little to compute where it is decoded, and moving its
    KV between two engines on one device costs more than it saves)."""

    Options = PrefillOptions
    kv_role = "kv_producer"

    def load(self) -> None:
        self.engine = self._engine()
        self.engine.load_model()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        local = self.options.local_prefill_max_tokens
        here: list[StageInput] = []
        params: list[SamplingParams] = []
        for inp in batch:
            try:
                p = self._sampling_params(inp)
            except RequestError as e:
                yield inp.fail(e)
                continue
            ids = inp.window.tokens
            if len(ids) <= local:  # no first token, no KV: decode prefills it
                handoff = Handoff(params=p, prompt_ids=ids, prompt_tokens=len(ids))
                handoff.local_prefill = True
                yield handoff.segment(inp, [])
                continue
            here.append(inp)
            params.append(p)
        if not here:
            return
        batch = here
        prompts = [inp.window.tokens for inp in batch]
        priorities = [inp.priority for inp in batch]
        one = zip(prompts, params, priorities, strict=True)
        if not self.options.batch_prefill:
            results: list[Any] = [self._prefill_one(*x) for x in one]
        else:
            try:
                results = list(self.engine.prefill_many(prompts, params, priorities))
            except RequestError as e:  # vLLM refused a prompt as it entered: find it
                results = [e] if len(batch) == 1 else [self._prefill_one(*x) for x in one]
        for inp, ids, p, res in zip(batch, prompts, params, results, strict=True):
            if isinstance(res, RequestError):
                yield inp.fail(res)
                continue
            tok, lp, keys, values = res
            handoff = Handoff(params=p, prompt_ids=ids, prompt_tokens=len(ids))
            if p.top_logprobs:
                handoff.top_ids = [top_ids(res)]
            if res.prompt is not None:
                handoff.prompt_logprob_ids = prompt_ids_payload(ids, res.prompt)
            yield handoff.segment(inp, [tok], [lp], (keys, values))

    def _prefill_one(self, ids: list[int], params: SamplingParams, priority: int) -> Any:
        """One prompt's prefill, or the RequestError it raised."""
        try:
            return next(self.engine.prefill_many([ids], [params], [priority]))
        except RequestError as e:
            return e
