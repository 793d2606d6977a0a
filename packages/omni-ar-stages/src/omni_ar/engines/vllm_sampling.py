"""omni's sampling params as vLLM's: every field with vLLM's meaning, and what omni's
own logits processors and KV connector read from a request (its handoff key, its
grammar's matcher, the first token another engine sampled)."""

from __future__ import annotations

from typing import Any

from omni_ar.params import SamplingParams


def sampling_params(
    params: SamplingParams,
    max_tokens: int,
    kv_key: str | None,
    grammar_key: str | None = None,
    requires_kv: bool = False,
    record: bool = False,
    first: int | None = None,
    bad: list[list[int]] | None = None,
) -> Any:
    """vLLM's sampling params of a request; ``grammar_key``: it continues another
    engine's request under its matcher (vllm_grammar), not vLLM's own grammar;
    ``requires_kv``: its media items are covered by the KV (the plugin's flag);
    ``record``: a producer's connector records the prompt as vLLM rendered it;
    ``first``: it continues from this token (one of its ``max_tokens`` already: the
    fields that read the output count it, see vllm_carried), with ``bad``, the bad
    words' token sequences (:func:`omni_ar.logits.bad_word_ids`)."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    from omni_ar.engines.kv_connector import PARAM, RECORD
    from omni_ar.engines.vllm_grammar import ARG
    from omni_ar.engines.vllm_requires_kv import FLAG

    extra: dict[str, Any] = {}
    if kv_key:
        flags = {FLAG: requires_kv, RECORD: record}
        extra["kv_transfer_params"] = {
            PARAM: kv_key,
            **{k: True for k, v in flags.items() if v},
        }
    structured = params.structured()
    if grammar_key is not None:
        extra[ARG] = grammar_key
        structured = None
    min_tokens = params.min_tokens
    if first is not None:
        from omni_ar.engines.vllm_carried import ARG as FIRST
        from omni_ar.engines.vllm_carried import carried

        min_tokens -= 1
        entry = carried(params, first, bad or [])
        if entry is not None:
            extra[FIRST] = entry
    return VllmParams(
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias={int(k): v for k, v in params.logit_bias.items()} if params.logit_bias else None,
        min_tokens=max(0, min(min_tokens, max_tokens)),
        stop_token_ids=list(params.stop_token_ids),
        bad_words=list(params.bad_words) or None,
        seed=params.seed if params.temperature > 0 else None,
        ignore_eos=params.ignore_eos,
        logprobs=params.top_logprobs if params.logprobs else None,
        # where the prompt is prefilled (a decode resuming from a first token is not)
        prompt_logprobs=params.prompt_logprobs if first is None else None,
        detokenize=False,  # the postprocess stage detokenizes
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra or None,
        structured_outputs=StructuredOutputsParams(**structured) if structured else None,
    )
