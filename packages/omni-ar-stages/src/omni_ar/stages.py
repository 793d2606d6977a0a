"""The AR stages: intake -> prefill -> decode -> postprocess, each in its own worker.

* intake: validate the request, apply the chat template, tokenize (a source stage).
* prefill: the prompt forward pass; emits the first token and the KV cache as arrays,
  which cross to decode through the shared-memory data plane.
* decode: rebuilds the cache and steps; flushes a segment every ``max_segment_tokens``
  tokens, after ``min_flush_interval_ms``, or at the end; stops at its next step when
  the request is cancelled.
* postprocess: incremental detokenization and stop strings, off the decode loop; streams
  text to the caller directly.

The stages that hold a model (prefill, decode, talker) load it where
:func:`omni_core.worker.devices.place` puts them: the stage's ``devices`` (``cpu``, or GPUs: the
first one it is given) in its ``dtype`` (``auto``: float32 on a CPU, bfloat16 or float16
on a GPU). A GPU asked for where torch sees none fails the load, naming the stage.
Intake and postprocess load only a tokenizer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from omni_core import Stage, StageEvent, StageInput
from omni_core.worker.devices import place

from omni_ar.detokenizer import IncrementalDetokenizer
from omni_ar.engines import TRANSFORMERS_PRELOAD, load_engine
from omni_ar.models import resolve_model
from omni_ar.params import (
    RequestError,
    Sampled,
    SamplingParams,
    parse_request,
    template_error,
)


class ModelOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The options every AR stage takes (``options:`` of a stage in the YAML)."""

    model: str  # a Hugging Face model directory, or a named model ("smollm2")
    engine: Literal["transformers", "vllm"] = "transformers"  # what runs the model
    kv_connector: Literal["shm", "file"] = "shm"  # vLLM: how prefill's KV reaches decode
    engine_args: dict[str, Any] = msgspec.field(default_factory=dict)  # vLLM: extra args
    # the model's dtype; auto: float32 on a CPU, bfloat16 (else float16) on a GPU, and
    # vLLM's own choice on a GPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # vLLM on a GPU: the share of its memory the engine may take (weights + KV cache)
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    threads: int | None = None  # torch threads in this worker
    # on the CPU: engines naming the same turn compute one forward at a time, each on all
    # of its threads (a split pipeline's prefill and decode on one machine's cores)
    cpu_turns: str | None = None
    max_prompt_tokens: int = 2048  # intake refuses longer prompts
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 16  # for requests that do not say
    chat: bool = False  # a plain "prompt" goes through the chat template as a user turn
    system_prompt: str | None = None  # with chat: a system turn before a plain prompt


class _ModelStage(Stage):
    Options = ModelOptions
    preload = TRANSFORMERS_PRELOAD
    images: ClassVar[bool] = False  # requests may carry image parts (the ar.mm_* stages)
    kv_role: ClassVar[str | None] = None  # the vLLM engine's KV connector role
    # why this stage cannot sample under a response_format's grammar ("": it can, on vLLM)
    unstructured: ClassVar[str] = (
        "the prefill -> decode split restarts the grammar at decode's first token"
    )

    @classmethod
    def preload_modules(cls, options: dict[str, Any]) -> tuple[str, ...]:
        """vLLM reads its environment (set per stage, before its import) when it loads:
        it is imported in the worker, the tokenizer's modules in the zygote."""
        if options.get("engine") == "vllm":
            return ("torch", "transformers.models.auto.tokenization_auto")
        return cls.preload

    def _engine(self, model: bool = True):  # type: ignore[no-untyped-def]
        """The stage's engine; ``model``: it will load the model, on the device and in
        the dtype of the stage's placement (else only a tokenizer, on the CPU)."""
        o = self.options
        device, dtype = self._placement() if model else ("cpu", "float32")
        return load_engine(
            o.engine,
            resolve_model(o.model),
            dtype,
            o.threads,
            device,
            kv_role=self.kv_role,
            kv_connector=o.kv_connector,
            engine_args=o.engine_args,
            gpu_memory_utilization=o.gpu_memory_utilization,
            cpu_turns=o.cpu_turns,
        )

    def _placement(self) -> tuple[str, str]:
        """(device, dtype) of the stage's model: :func:`omni_core.worker.devices.place` of its
        ``devices`` and ``dtype`` (a :class:`omni_core.worker.devices.DeviceError` where it asks
        for a GPU torch does not see). vLLM on a GPU keeps ``auto``: it picks the dtype."""
        o = self.options
        p = place(self.ctx.name, self.ctx.devices, o.dtype)
        if o.engine == "vllm" and p.is_gpu and o.dtype == "auto":
            return p.device, "auto"
        return p.device, p.dtype

    def _params(self, inp: StageInput):  # type: ignore[no-untyped-def]
        """(prompt or messages, sampling params); every stage reads the request alike."""
        o = self.options
        request = inp.request
        if "max_tokens" not in request:
            request = {**request, "max_tokens": o.default_max_tokens}
        source, params = parse_request(request, o.max_tokens_limit, images=self.images)
        if o.chat and isinstance(source, str):
            source = [{"role": "user", "content": source}]
            if o.system_prompt:
                source.insert(0, {"role": "system", "content": o.system_prompt})
        return source, params

    def _sampling_params(self, inp: StageInput) -> tuple[Any, SamplingParams]:
        """``_params`` in a stage that samples: a RequestError naming ``response_format``
        where the request asks for structured output this stage cannot hold to. Only
        ``ar.generate`` on vLLM samples every token of a request under one grammar."""
        source, params = self._params(inp)
        if params.structured() is None:
            return source, params
        why = self.unstructured
        if not why and self.options.engine != "vllm":
            why = f"this stage runs engine {self.options.engine!r}"
        if why:
            raise RequestError(
                "field 'response_format': structured output needs the ar.generate stage "
                f"on engine vllm ({why})"
            )
        return source, params


class Intake(_ModelStage):
    """Request -> prompt token ids (one segment), or an error naming the bad field."""

    def load(self) -> None:
        self.engine = self._engine(model=False)
        self.engine.load_tokenizer()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            try:
                source, _ = self._params(inp)
                ids = self.engine.encode(source)
            except RequestError as e:
                yield inp.fail(e)
                continue
            except Exception as e:  # e.g. a chat template that rejects the messages
                yield inp.fail(template_error(e))
                continue
            if len(ids) > self.options.max_prompt_tokens:
                yield inp.fail(
                    RequestError(
                        f"field 'prompt': {len(ids)} tokens, over max_prompt_tokens="
                        f"{self.options.max_prompt_tokens}"
                    )
                )
                continue
            yield inp.segment(ids, is_last=True)


class PrefillOptions(ModelOptions, kw_only=True):
    """``ar.prefill``'s options: :class:`ModelOptions` and the local-prefill threshold."""

    # conditional disaggregation: a prompt of at most this many tokens is not prefilled
    # here but passed on, and the decode engine prefills it in its own steps, beside the
    # requests it is decoding (no KV crosses); 0: every prompt is prefilled here
    local_prefill_max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


class Prefill(_ModelStage):
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
                p = self._sampling_params(inp)[1]
            except RequestError as e:
                yield inp.fail(e)
                continue
            ids = inp.window.tokens
            if len(ids) <= local:  # no first token, no KV: decode prefills it
                payload = {"prompt_tokens": len(ids), "prompt_ids": ids, LOCAL_PREFILL: True}
                yield inp.segment([], payload=payload, is_last=True)
                continue
            here.append(inp)
            params.append(p)
        if not here:
            return
        batch = here
        prompts = [inp.window.tokens for inp in batch]
        results = self.engine.prefill_many(prompts, params)  # vLLM: one batch
        for inp, ids, p, res in zip(batch, prompts, params, results, strict=True):
            tok, lp, keys, values = res
            payload: dict[str, Any] = {"prompt_tokens": len(ids), "prompt_ids": ids}
            if p.top_logprobs:
                payload[TOP_IDS] = [_top(res)]
            yield inp.segment(
                [tok],
                logprobs=[lp],
                arrays={"keys": keys, "values": values},
                payload=payload,
                is_last=True,
            )


class DecodeOptions(ModelOptions, kw_only=True):
    """``ar.decode``'s and ``ar.generate``'s options: :class:`ModelOptions` and how
    tokens are flushed downstream."""

    max_segment_tokens: int = 8  # a segment goes out once it holds this many tokens
    min_flush_interval_ms: float = 50.0  # ... or once this long passed since the last one
    # detokenize in the decode loop itself (no postprocess stage): the baseline that
    # `omni bench ar` compares the separate postprocess process against
    inline_detokenize: bool = False


class Decode(_ModelStage):
    """First token + KV -> the generated tokens, flushed in segments."""

    Options = DecodeOptions
    kv_role = "kv_consumer"

    def load(self) -> None:
        self.engine = self._engine()
        self.engine.load_model()
        if self.options.inline_detokenize:
            self.engine.load_tokenizer()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        for inp in batch:
            try:
                _, params = self._sampling_params(inp)
            except RequestError as e:
                yield inp.fail(e)
                continue
            w = inp.window
            prompt = w.payloads[0].get("prompt_ids")
            if w.payloads[0].get(LOCAL_PREFILL):  # prefill passed it on: prefilled here
                yield from self._generate(inp, prompt, params)
                continue
            arrays = w.arrays
            first, first_lp = w.tokens[0], w.logprobs[0] if w.logprobs else 0.0
            first_top = [tuple(a) for a in w.payloads[0].get(TOP_IDS, [[]])[0]]
            steps = self.engine.decode(first, arrays["keys"], arrays["values"], params, prompt)
            n_prompt = w.payloads[0].get("prompt_tokens")
            try:
                # the first token goes out before any step; meanwhile the other requests
                # that arrived with this one enter the engine (vLLM batches them from
                # their first token on)
                so_far = [Sampled((first, first_lp), first_top)]
                yield from self._stream(inp, params, so_far, steps, n_prompt)
            finally:
                close = getattr(steps, "close", None)
                if close is not None:
                    close()

    def _generate(
        self, inp: StageInput, ids: list[int], params: SamplingParams
    ) -> Iterator[StageEvent | None]:
        """Prefill and decode ``ids`` in this stage's engine, streamed in segments. With
        vLLM the request joins the engine's steps with every other one in flight."""
        stream = getattr(self.engine, "stream", None)
        try:
            # vLLM: the request enters the engine now (a grammar it refuses: RequestError)
            steps: Iterable[tuple[int, float]] | None = (
                stream(ids, params) if stream is not None else None
            )
        except RequestError as e:
            yield inp.fail(e)
            return
        if steps is not None:
            so_far: list[tuple[int, float]] = []
        else:  # transformers: one prefill pass, then the decode loop
            pre = self.engine.prefill(ids, params)
            first, lp, keys, values = pre
            so_far = [Sampled((first, lp), pre.top)]
            steps = self.engine.decode(first, keys, values, params, ids)
        try:
            yield None  # the requests that arrived with this one join the same steps
            yield from self._stream(inp, params, so_far, steps, len(ids))
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                close()

    def _stream(
        self,
        inp: StageInput,
        params: SamplingParams,
        tokens_so_far: list[tuple[int, float]],
        steps: Iterable[tuple[int, float]],
        prompt_tokens: int | None = None,
    ) -> Iterator[StageEvent]:
        """Flush ``tokens_so_far`` and then the tokens of ``steps`` in segments; the first
        carries ``prompt_tokens`` (the prompt's length, for usage counts downstream).
        With ``top_logprobs`` each segment's payload carries its tokens' alternatives
        (``top_ids``, made text by :func:`top_payload`)."""
        counted = {"prompt_tokens": prompt_tokens} if prompt_tokens is not None else {}
        o = self.options
        detok = (
            IncrementalDetokenizer(self.engine.tokenizer, stop=params.stop)
            if o.inline_detokenize
            else None
        )
        tokens, logprobs = [t for t, _ in tokens_so_far], [lp for _, lp in tokens_so_far]
        tops = [_top(s) for s in tokens_so_far]
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
        for s in steps:
            if inp.cancelled:
                return
            tok, lp = s
            tokens.append(tok)
            logprobs.append(lp)
            tops.append(_top(s))
            total += 1
            last_tok = tok
            now = time.monotonic()
            if (
                len(tokens) >= o.max_segment_tokens
                or (now - last_flush) * 1000 >= o.min_flush_interval_ms
            ):
                yield self._emit(inp, tokens, logprobs, tops, params, detok, counted)
                if detok is not None and detok.stopped is not None:
                    return
                tokens, logprobs, tops, last_flush = [], [], [], now
        last = self._finish(params, total, last_tok)
        yield self._emit(inp, tokens, logprobs, tops, params, detok, counted, last)

    def _emit(self, inp, tokens, logprobs, tops, params, detok, counted, last=None):  # type: ignore[no-untyped-def]
        """A segment of the tokens so far; the first to go carries (and empties)
        ``counted``, the prompt's length."""
        ev = self._segment(inp, tokens, logprobs, tops, params, detok, last=last)
        ev.payload.update(counted)
        counted.clear()
        return ev

    def _finish(self, params: SamplingParams, total: int, last_tok: int | None) -> str:
        """Why generation ended: ``length`` when it reached ``max_tokens`` (the request's
        or the stage's default) without ending at EOS, else ``stop`` (EOS)."""
        eos = getattr(self.engine, "eos_ids", None) or set()
        at_eos = last_tok in eos and not params.ignore_eos
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
    unstructured = ""

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        for inp in batch:
            try:
                _, params = self._sampling_params(inp)
            except RequestError as e:
                yield inp.fail(e)
                continue
            yield from self._generate(inp, inp.window.tokens, params)


class Postprocess(_ModelStage):
    """Token segments -> text deltas, with stop strings; streams to the caller."""

    def load(self) -> None:
        self.engine = self._engine(model=False)
        self.tokenizer = self.engine.load_tokenizer()
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.counts: dict[str, int] = {}
        self.prompt_tokens: dict[str, int] = {}  # until passed on with the next event
        self.finish: dict[str, str] = {}  # decode's finish reason, once it sent it
        self.want_logprobs: dict[str, bool] = {}
        self.tops: dict[str, _Alternatives] = {}  # the requests that want top_logprobs

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            rid = inp.request_id
            d = self.detoks.get(rid)
            if d is None:
                _, params = self._params(inp)
                d = self.detoks[rid] = IncrementalDetokenizer(self.tokenizer, stop=params.stop)
                self.want_logprobs[rid] = params.logprobs
                if params.top_logprobs:
                    self.tops[rid] = _Alternatives()
            if d.stopped is not None:
                continue  # the text already ended at a stop string
            for p in inp.window.payloads:
                if "prompt_tokens" in p:
                    self.prompt_tokens[rid] = p["prompt_tokens"]
                if "finish_reason" in p:  # decode's: "length" or "stop" (EOS)
                    self.finish[rid] = p["finish_reason"]
            alts = self.tops.get(rid)
            if alts is not None:
                alts.add(inp.window)
            new = inp.window.new_tokens
            text = d.add(new)
            self.counts[rid] = self.counts.get(rid, 0) + len(new)
            if d.stopped is not None:
                payload = {"text": text, "finish_reason": "stop"}
            elif inp.last:
                reason = self.finish.get(rid, "stop")
                payload = {"text": text + d.flush(), "finish_reason": reason}
            elif new or text:
                payload = {"text": text}
            else:
                continue
            if rid in self.prompt_tokens:
                payload["prompt_tokens"] = self.prompt_tokens.pop(rid)
            lps = None
            if self.want_logprobs.get(
                rid
            ):  # the decode step's logprobs of the new tokens, with their text
                window_lps = inp.window.logprobs
                lps = window_lps[len(window_lps) - len(new) :] if new else []
                if len(lps) != len(new):  # an upstream that sent none: no logprobs
                    lps = None
                else:
                    payload["token_texts"] = token_texts(self.tokenizer, new)
                    tops = alts.take(inp.window.start, len(new)) if alts is not None else []
                    if alts is not None and len(tops) == len(new):
                        payload["top_logprobs"] = top_payload(self.tokenizer, tops)
            yield inp.segment(
                new, logprobs=lps, payload=payload, is_last="finish_reason" in payload
            )

    def end_request(self, request_id: str) -> None:
        self.detoks.pop(request_id, None)
        self.counts.pop(request_id, None)
        self.prompt_tokens.pop(request_id, None)
        self.finish.pop(request_id, None)
        self.want_logprobs.pop(request_id, None)
        self.tops.pop(request_id, None)


TOP_IDS = "top_ids"  # decode -> postprocess: per token, its alternatives' [id, logprob]
LOCAL_PREFILL = "local_prefill"  # prefill -> decode: the prompt alone, decode prefills it


class _Alternatives:
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


def _top(s: tuple[int, float]) -> list[list[Any]]:
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


class Talker(_ModelStage):
    """A second AR stage fed by the first one's tokens in windows (the thinker -> talker
    shape of omni models): for each window it runs the model over the window's tokens
    (its left-context overlap included) and emits the next token it predicts."""

    def load(self) -> None:
        self.engine = self._engine()
        self.engine.load_model()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            w = inp.window
            if not w.new_tokens:  # an empty closing window
                yield inp.segment([], is_last=inp.last)
                continue
            _, params = self._params(inp)
            tok, lp, _, _ = self.engine.prefill(w.tokens, params)
            yield inp.segment(
                [tok],
                logprobs=[lp],
                payload={"window": w.index, "tokens_in": len(w.tokens), "context": w.overlap},
                is_last=inp.last,
            )
