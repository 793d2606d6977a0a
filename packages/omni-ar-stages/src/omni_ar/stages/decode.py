"""``ar.decode`` (first token + KV -> the generated tokens) and ``ar.generate`` (prompt
ids -> the generated tokens, in one engine): both stream the tokens in segments."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from omni_core.plugin import StageContext, StageEvent, StageInput

from omni_ar.detokenizer import detokenizer
from omni_ar.engines.protocol import Closable, Preemptible, StreamingEngine
from omni_ar.errors import EngineRequestError, HandoffError
from omni_ar.handoff import Handoff, kv_of_arrays
from omni_ar.logits import ends
from omni_ar.params import (
    RequestError,
    Sampled,
    SamplingParams,
    params_payload,
)
from omni_ar.stages.base import ModelOptions, ModelStage
from omni_ar.stages.logprobs import (
    PROMPT_LOGPROB_IDS,
    PROMPT_LOGPROBS,
    TOP_IDS,
    prompt_ids_payload,
    prompt_text_payload,
    token_texts,
    top_ids,
    top_payload,
)

_END = object()  # the steps ran out


class DecodeOptions(ModelOptions, kw_only=True):
    """``ar.decode``'s and ``ar.generate``'s options: :class:`ModelOptions` and how
    tokens are flushed downstream."""

    max_segment_tokens: int = 8  # a segment goes out once it holds this many tokens
    min_flush_interval_ms: float = 50.0  # ... or once this long passed since the last one
    # detokenize in the decode loop itself (no postprocess stage): the baseline that
    # `omni bench ar` compares the separate postprocess process against
    inline_detokenize: bool = False


class Decode(ModelStage):
    """First token + KV -> the generated tokens, flushed in segments."""

    Options = DecodeOptions
    kv_role = "kv_consumer"

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        # on the transformers engine a paused request leaves the decode batch (its KV
        # kept) and joins it again on resume; vLLM preempts by its own rules
        self.preemptible = self.options.engine == "transformers"
        # request id -> its engine steps (to pause)
        self.streams: dict[str, Iterable[Sampled | None]] = {}

    def pause(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            steps = self.streams.get(rid)
            if isinstance(steps, Preemptible):
                steps.pause()

    def resume(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            steps = self.streams.get(rid)
            if isinstance(steps, Preemptible):
                steps.resume()

    def end_request(self, request_id: str) -> None:
        # cancelled while paused (its generator waits for its batch to resume): its KV
        # leaves the engine now, not when the batch runs again
        steps = self.streams.pop(request_id, None)
        if isinstance(steps, Closable):
            steps.close()

    def load(self) -> None:
        self.engine = self._engine()
        self.engine.load_model()
        if self.options.inline_detokenize:
            self.engine.load_tokenizer()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        for inp in batch:
            w = inp.window
            try:
                handoff = Handoff.read(w)
                params = self._check_sampling(handoff.params)
            except HandoffError as e:  # a broken upstream: this request only
                yield inp.fail(str(e))
                continue
            except RequestError as e:
                yield inp.fail(e)
                continue
            prompt = handoff.prompt_ids
            if handoff.local_prefill:  # prefill passed it on: prefilled here
                yield from self._generate(inp, prompt, params)
                continue
            kv = kv_of_arrays(w.arrays)
            if kv is None:
                yield inp.fail("prefill sent no KV (arrays 'keys'/'values' missing)")
                continue
            first, first_lp = w.tokens[0], w.logprobs[0] if w.logprobs else 0.0
            steps = self.engine.decode(first, *kv, params, prompt, priority=inp.priority)
            self.streams[inp.request_id] = steps
            try:
                # the first token goes out before any step; meanwhile the other requests
                # that arrived with this one enter the engine (vLLM batches them from
                # their first token on)
                so_far = [Sampled((first, first_lp), handoff.first_top)]
                yield from self._stream(
                    inp, params, so_far, steps, handoff.prompt_tokens, handoff.prompt_logprob_ids
                )
            finally:
                self._close(inp.request_id, steps)

    def _close(self, request_id: str, steps: Iterable[Any]) -> None:
        self.streams.pop(request_id, None)
        if isinstance(steps, Closable):
            steps.close()

    def _generate(
        self, inp: StageInput, ids: list[int], params: SamplingParams
    ) -> Iterator[StageEvent | None]:
        """Prefill and decode ``ids`` in this stage's engine, streamed in segments. With
        vLLM the request joins the engine's steps with every other one in flight."""
        engine = self.engine
        try:
            # vLLM: the request enters the engine now (a grammar it refuses: RequestError)
            steps: Iterable[Sampled | None] | None = (
                engine.stream(ids, params, inp.priority)
                if isinstance(engine, StreamingEngine)
                else None
            )
        except RequestError as e:
            yield inp.fail(e)
            return
        if steps is not None:
            so_far: list[tuple[int, float]] = []
        else:  # transformers: one prefill pass, then the decode loop
            pre = self.engine.prefill(ids, params)
            first, lp, keys, values = pre
            so_far = [Sampled((first, lp), pre.top, pre.prompt)]
            steps = self.engine.decode(first, keys, values, params, ids, priority=inp.priority)
        self.streams[inp.request_id] = steps
        try:
            if not so_far:
                # vLLM: the requests that arrived with this one enter the engine before
                # its first step (transformers: this one is in the batch already, and
                # its first token goes out at once)
                yield None
            yield from self._stream(inp, params, so_far, steps, len(ids), prompt_ids=ids)
        finally:
            self._close(inp.request_id, steps)

    def _stream(
        self,
        inp: StageInput,
        params: SamplingParams,
        tokens_so_far: list[tuple[int, float]],
        steps: Iterable[tuple[int, float] | None],
        prompt_tokens: int,
        prompt_logprobs: dict[str, Any] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[StageEvent | None]:
        """Flush ``tokens_so_far`` and then the tokens of ``steps`` in segments; the first
        carries ``prompt_tokens`` (the prompt's length, for usage counts downstream) and
        the request's params (for the stages downstream); the last, ``finish_reason``.
        A ``None`` step (the request waits inside vLLM) yields None: the stage's other
        requests go on meanwhile, and the tokens it holds go out once they are due. A
        request the engine ends with an error (:class:`EngineRequestError`) fails alone.
        With ``top_logprobs`` each segment's payload carries its tokens' alternatives
        (``top_ids``, made text by :func:`top_payload`)."""
        eos = self.engine.eos_ids
        stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else eos))
        counted = {**params_payload(params), "prompt_tokens": prompt_tokens}
        counted["stop_ids"] = stop_ids  # the tokens that end it, for the text downstream
        # prompt_logprobs: from prefill's handoff, or with the first token of this
        # engine's own prefill (``prompt_ids``: that prompt)
        given = (getattr(s, "prompt", None) for s in tokens_so_far)
        first_prompt = next((p for p in given if p is not None), None)  # [] for 1 token
        if prompt_logprobs is None and first_prompt is not None and prompt_ids is not None:
            prompt_logprobs = prompt_ids_payload(prompt_ids, first_prompt)
        if prompt_logprobs is not None:
            counted[PROMPT_LOGPROB_IDS] = prompt_logprobs
        o = self.options
        detok = (
            detokenizer(self.engine.tokenizer, params, stop_ids) if o.inline_detokenize else None
        )
        tokens, logprobs = [t for t, _ in tokens_so_far], [lp for _, lp in tokens_so_far]
        tops = [top_ids(s) for s in tokens_so_far]
        total = len(tokens)
        last_tok = tokens[-1] if tokens else None
        # the first token leaves at once (time to first token): the stage's other streams
        # may run engine steps before this one's next turn, and holding it for a segment
        # would make each stream's first text wait one step longer than the last one's
        last_flush = time.monotonic()
        if tokens:  # prefill's first token: out before decode's first step
            yield self._emit(inp, tokens, logprobs, tops, params, detok, counted)
            if detok is not None and detok.stopped is not None:
                return
            tokens, logprobs, tops = [], [], []
        else:
            last_flush = 0.0  # the first step's token flushes as soon as it comes
        steps = iter(steps)
        while True:
            try:
                s = next(steps, _END)
            except EngineRequestError as e:  # this request alone; the engine goes on
                yield inp.fail(str(e))
                return
            if s is _END:
                break
            if inp.cancelled:
                return
            if s is not None:
                tok, lp = s
                if getattr(s, "prompt", None) is not None and prompt_ids is not None:
                    counted[PROMPT_LOGPROB_IDS] = prompt_ids_payload(prompt_ids, s.prompt)
                tokens.append(tok)
                logprobs.append(lp)
                tops.append(top_ids(s))
                total += 1
                last_tok = tok
            now = time.monotonic()
            if tokens and (
                len(tokens) >= o.max_segment_tokens
                or (now - last_flush) * 1000 >= o.min_flush_interval_ms
            ):
                yield self._emit(inp, tokens, logprobs, tops, params, detok, counted)
                if detok is not None and detok.stopped is not None:
                    return
                tokens, logprobs, tops, last_flush = [], [], [], now
            else:  # the stage's other requests take their turn: those of a batched
                # engine take this step's tokens and the ones that arrived join the next
                yield None
        last = self._finish(params, total, last_tok)
        yield self._emit(inp, tokens, logprobs, tops, params, detok, counted, last)

    def _emit(self, inp, tokens, logprobs, tops, params, detok, counted, last=None):  # type: ignore[no-untyped-def]
        """A segment of the tokens so far; the first to go carries (and empties)
        ``counted``: the request's params and the prompt's length."""
        ev = self._segment(inp, tokens, logprobs, tops, params, detok, last=last)
        if detok is not None and PROMPT_LOGPROB_IDS in counted:  # the caller's: as text
            sent = counted.pop(PROMPT_LOGPROB_IDS)
            counted[PROMPT_LOGPROBS] = prompt_text_payload(detok.tokenizer, sent)
        ev.payload.update(counted)
        counted.clear()
        return ev

    def _finish(self, params: SamplingParams, total: int, last_tok: int | None) -> str:
        """Why generation ended: ``length`` when it reached ``max_tokens`` (the request's
        or the stage's default) without ending at EOS or a stop token, else ``stop``."""
        eos = self.engine.eos_ids
        at_eos = last_tok is not None and ends(last_tok, params, eos)
        return "length" if total >= params.max_tokens and not at_eos else "stop"

    @staticmethod
    def _segment(inp, tokens, logprobs, tops, params, detok, last):  # type: ignore[no-untyped-def]
        """A segment of ``tokens``; ``last``: None, or the finish reason of the last one
        (``stop`` or ``length``; a stop string found by ``detok`` makes it ``stop``)."""
        payload = {} if last is None else {"finish_reason": last}
        if detok is None and params.top_logprobs:  # postprocess makes them text
            payload[TOP_IDS] = tops
        if detok is not None:
            text = detok.add(tokens)
            if detok.stopped is not None:
                payload = {"text": text, "finish_reason": "stop"}
            elif last is not None:
                payload["text"] = text + detok.flush()
            else:
                payload = {"text": text}
            if params.logprobs:
                payload["token_texts"] = token_texts(detok.tokenizer, tokens)
            if params.top_logprobs:
                payload["top_logprobs"] = top_payload(detok.tokenizer, tops)
        lps = logprobs if params.logprobs else None
        return inp.segment(
            tokens, logprobs=lps, payload=payload, is_last="finish_reason" in payload
        )


class Generate(Decode):
    """Prompt ids -> every generated token, prefill and decode in one engine, flushed in
    segments: the fused stage for a model on one device. With vLLM the engine's own
    scheduler batches every request in flight (continuous batching, chunked prefill);
    no KV crosses a process. The prefill -> decode split (``ar.prefill`` + ``ar.decode``)
    is for when the two sit on different devices or nodes."""

    kv_role = None

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        for inp in batch:
            try:
                params = self._sampling_params(inp)
            except RequestError as e:
                yield inp.fail(e)
                continue
            yield from self._generate(inp, inp.window.tokens, params)
