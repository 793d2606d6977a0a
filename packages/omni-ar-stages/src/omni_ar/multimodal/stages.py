"""The multimodal AR stages: ar.mm_intake -> ar.mm_prefill -> ar.mm_decode -> ar.mm_postprocess.

* mm_intake (source): validates the request, reads and decodes its images (bytes or a
  base64 data URL; a local path only with ``allow_local_images``; never the network),
  each checked against ``max_image_pixels`` and ``max_total_pixels`` from its header
  before it is decoded, hashes each, tokenizes with one
  placeholder run per image; emits the ids, the decoded pixels as arrays and per image
  ``{"hash", "offset", "length"}``. A bad image ends that request with an error naming
  the part.
* mm_prefill: image processor + vision encoder + prompt forward (a prefix cache keyed by
  block hashes skips both for a repeated image + prefix); emits the ``handoff`` payload
  and the KV arrays, and drops the media from the request it forwards.
* mm_decode: never loads the vision tower; admits the request only if every check of
  :func:`omni_ar.multimodal.handoff.admit` passes, then continues from the KV.
  ``media: reprocess`` is the full-media baseline of ``omni bench mm-handoff``: decode
  receives the media and renders the prompt from it again.
* mm_postprocess: ar.postprocess for requests that carry image parts.

mm_prefill and mm_decode load their models where their ``devices`` and ``dtype`` place
them, as the text stages do (:mod:`omni_ar.stages`); mm_intake loads only the processor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from omni_core.plugin import StageEvent, StageInput

from omni_ar.engines.threads import thread_count
from omni_ar.errors import HandoffError
from omni_ar.handoff import Handoff, MMHandoff, MMItem, MRope
from omni_ar.models import resolve_model
from omni_ar.multimodal.engine import VLMEngine, check_model_dir
from omni_ar.multimodal.handoff import (
    AdmissionError,
    PrefixCache,
    admit,
    admit_paged,
    block_hashes,
)
from omni_ar.multimodal.media import (
    has_media,
    image_hash,
    image_parts,
    load_images,
    strip_media,
)
from omni_ar.multimodal.mrope import position_delta
from omni_ar.params import (
    RAW_PROMPT_KEY,
    RequestError,
    Sampled,
    carried_params,
    params_payload,
    template_error,
)
from omni_ar.stages.base import ModelOptions, ModelStage
from omni_ar.stages.decode import Decode, DecodeOptions
from omni_ar.stages.logprobs import top_ids
from omni_ar.stages.postprocess import Postprocess


class MMOptions(ModelOptions, kw_only=True):
    """The ``ar.mm_*`` stages' options: :class:`~omni_ar.stages.base.ModelOptions` and image
    limits."""

    block_size: int = 16  # tokens per KV block; prefill and decode must agree
    max_images: int = 8  # images per request at most
    max_image_pixels: int = 16_000_000  # width x height of one image at most
    max_total_pixels: int = 32_000_000  # of all a request's images (~96 MB as RGB)
    allow_local_images: bool = False  # read paths and file:// URLs (the Python API's)


class _MMStage(ModelStage):
    Options = MMOptions
    images = True
    unstructured = "not built for the multimodal stages (ar.mm_*)"

    def _engine(self, model: bool = True, **vllm_options: Any) -> Any:
        """The stage's engine (``model``: it loads the model, else only the processor,
        which is the transformers one on either engine); a model the handoff cannot
        serve is refused first, from its config alone."""
        o = self.options
        path = resolve_model(o.model)
        check_model_dir(path)  # before the processor or a weight is read
        if o.engine == "vllm" and model:
            if vllm_options.get("media_free"):  # omni's vLLM plugin, or why it is not there
                from omni_ar.engines.vllm_requires_kv import require

                require()
            return super()._engine(model, multimodal=True, **vllm_options)
        device, dtype = self._placement() if model else ("cpu", "float32")
        return VLMEngine(path, dtype=dtype, threads=thread_count(o.threads), device=device)

    @property
    def vllm(self) -> bool:
        return self.options.engine == "vllm"

    def _messages(self, inp: StageInput) -> list[dict[str, Any]] | None:
        """The request's chat messages (a plain prompt as a user turn with ``chat``), or
        None for a plain prompt; mm_intake checked them."""
        request = inp.request
        if "messages" in request:
            source = self._chat(request["messages"])
        else:
            source = self._chat(request["prompt"], request.get(RAW_PROMPT_KEY, False))
        return source if isinstance(source, list) else None


class MMIntake(_MMStage):
    """Request -> prompt ids with placeholders, decoded images and their hashes."""

    def load(self) -> None:
        self.engine = self._engine(model=False)
        self.engine.load_tokenizer()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        o = self.options
        for inp in batch:
            try:
                source, params = self.read(inp.request)
                # a response_format that asks for structured output fails here already
                self._check_sampling(params)
                if params.prompt_logprobs is not None:
                    raise RequestError(
                        "field 'prompt_logprobs': not on the multimodal stages (a prompt of "
                        "images has no token logprobs to give)"
                    )
                messages = source if isinstance(source, list) else None
                pixels: list[Any] = []
                if messages is not None:
                    count = sum(1 for _ in image_parts(messages))
                    if count > o.max_images:
                        raise RequestError(
                            f"field 'messages': {count} images, over max_images={o.max_images}"
                        )
                    pixels = load_images(
                        messages, o.max_image_pixels, o.max_total_pixels, o.allow_local_images
                    )
            except RequestError as e:
                yield inp.fail(e)
                continue
            try:
                if messages is None:
                    ids, spans = self.engine.encode(inp.request["prompt"]), []
                else:
                    ids, spans = self.engine.encode_mm(messages, [p.shape[:2] for p in pixels])
            except Exception as e:  # e.g. a chat template that rejects the messages
                yield inp.fail(template_error(e))
                continue
            if len(ids) > o.max_prompt_tokens:
                yield inp.fail(
                    RequestError(
                        f"field 'messages': {len(ids)} tokens with image placeholders, over "
                        f"max_prompt_tokens={o.max_prompt_tokens}"
                    )
                )
                continue
            items = _items(pixels, spans)
            yield inp.segment(
                ids,
                arrays={f"image_{i}": px for i, px in enumerate(pixels)},
                payload={"mm_items": items, **params_payload(params)},
                is_last=True,
            )


class MMPrefillOptions(MMOptions, kw_only=True):
    """``ar.mm_prefill``'s options."""

    prefix_cache_blocks: int = 4096  # KV blocks kept for repeated prefixes (0: none)
    forward_media: bool = False  # the full-media baseline: leave the media in the request


class MMPrefill(_MMStage):
    """Ids + images -> the ``handoff`` payload and the KV of every position but the last."""

    Options = MMPrefillOptions
    kv_role = "kv_producer"  # vLLM's

    def load(self) -> None:
        o = self.options
        self.cache = None
        if self.vllm:  # vLLM's own prefix cache (engine_args' enable_prefix_caching)
            self.engine = self._engine(max_images=o.max_images)
            self.engine.load_model()
            return
        self.engine = self._engine()
        self.engine.load_tokenizer()
        self.engine.load_model(vision=True)
        self.cache = PrefixCache(o.prefix_cache_blocks) if o.prefix_cache_blocks else None

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        o = self.options
        prefilled = self._vllm_prefill(batch) if self.vllm else None
        for k, inp in enumerate(batch):
            w = inp.window
            ids = w.tokens
            items = w.payloads[0]["mm_items"]
            params = carried_params(w)
            first: Sampled | None = None
            if prefilled is not None:
                done = prefilled[k]
                if isinstance(done, str):
                    yield inp.fail(f"vLLM multimodal prefill: {done}")
                    continue
                first, kv, names = done.first, (done.keys, done.values), done.block_hashes
                block, cached, mrope = self.engine.block_size, None, getattr(done, "mrope", None)
            else:
                images = [w.arrays[f"image_{i}"] for i in range(len(items))]
                keys, values, cached, mrope = self.engine.prefill_kv(
                    ids, items, images, o.block_size, self.cache
                )
                kv, block = (keys, values), o.block_size
                names = block_hashes(ids, items, block, keys.shape[2])
            messages = inp.request.get("messages")
            if messages is not None and not o.forward_media:
                # The request this stage forwards is this very dict: each receiving stage
                # decodes its own copy off the wire, so this edits no one else's.
                strip_media(messages, [it["hash"] for it in items])
            contract = MMHandoff(
                requires_kv=bool(items),
                prompt_token_ids=ids,
                block_size=block,
                mm_items=items,
                kv_block_hashes=names,
                mrope=mrope,
            )
            handoff = Handoff(params=params, mm=contract, cached_tokens=cached)
            if first is None:  # transformers: decode computes the final prompt token
                yield handoff.segment(inp, kv=kv)
                continue
            if params.top_logprobs:
                handoff.top_ids = [top_ids(first)]
            yield handoff.segment(inp, [first[0]], [first[1]], kv)

    def _vllm_prefill(self, batch: list[StageInput]) -> list[Any]:
        """The batch's prompts prefilled on vLLM in the same engine steps: each one's
        ``MMPrefilled``, or why it failed (a ``str``). A prompt vLLM refuses (it raises
        for the whole call) is found by prefilling them one by one, so it fails alone."""
        from omni_ar.engines.vllm_mm import MMPrompt

        prompts, params = [], []
        for inp in batch:
            w = inp.window
            items = w.payloads[0]["mm_items"]
            images = [w.arrays[f"image_{i}"] for i in range(len(items))]
            prompts.append(MMPrompt(w.tokens, items, images))
            params.append(carried_params(w))
        priorities = [inp.priority for inp in batch]
        try:
            return list(self.engine.prefill_mm_many(prompts, params, priorities))
        except (RuntimeError, ValueError, RequestError) as e:
            if len(batch) == 1:
                return [str(e)]
        out: list[Any] = []
        for one in zip(prompts, params, priorities, strict=True):
            out += self._vllm_prefill_one(*one)
        return out

    def _vllm_prefill_one(self, prompt: Any, params: Any, priority: int) -> list[Any]:
        try:
            return list(self.engine.prefill_mm_many([prompt], [params], [priority]))
        except (RuntimeError, ValueError, RequestError) as e:
            return [str(e)]


class MMDecodeOptions(DecodeOptions, kw_only=True):
    """``ar.mm_decode``'s options."""

    block_size: int = 16  # tokens per KV block; as prefill's
    # with media: reprocess, the image limits of mm_intake's options
    max_image_pixels: int = 16_000_000
    max_total_pixels: int = 32_000_000
    allow_local_images: bool = False
    # "none": the requires_kv handoff; "reprocess": the full-media baseline (decode gets
    # the media and renders the prompt from it again, as a decode without the contract must)
    media: Literal["none", "reprocess"] = "none"


class MMDecode(_MMStage, Decode):
    """Handoff + KV -> the generated tokens, without media or a vision tower."""

    Options = MMDecodeOptions

    def load(self) -> None:
        o = self.options
        reprocess = o.media == "reprocess"
        if self.vllm:
            # media-free: no vision tower; reprocess: vLLM takes the images again
            self.engine = self._engine(media_free=not reprocess)
            self.engine.load_model()
            if o.inline_detokenize:
                self.engine.load_tokenizer()
            # the processor that renders a prompt as ar.mm_intake does (reprocess)
            self.render = self._engine(model=False) if reprocess else None
            if self.render is not None:
                self.render.load_tokenizer()
            self.placeholder_id = self.engine.placeholder_id
            return
        self.engine = self.render = self._engine()
        self.engine.load_model(vision=False)
        if o.inline_detokenize or reprocess:
            self.engine.load_tokenizer()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        if self.vllm:
            yield from self._process_paged(batch)
            return
        for inp in batch:
            messages = self._messages(inp)
            w = inp.window
            sent = MMHandoff.as_sent(w)
            try:
                if self.options.media == "reprocess":
                    sent, _ = self._rerender(messages, sent)
                elif messages is not None and has_media(messages):
                    raise AdmissionError(
                        "media payload: the request still carries image data; a requires_kv "
                        "request carries only item hashes"
                    )
                adm = admit(
                    sent,
                    w.arrays,
                    self.options.block_size,
                    self.engine.kv_shape,
                    self.engine.placeholder_id,
                    self.engine.merge,
                )
                params = Handoff.read(w).params  # as the intake parsed and checked them
                keys, values = adm.kv
                ids = adm.handoff.prompt_token_ids
                steps = self.engine.resume(
                    ids, keys, values, adm.kv_tokens, params, adm.handoff.mrope
                )
                first = next(steps)
            except (AdmissionError, HandoffError) as e:
                yield inp.fail(f"requires_kv admission: {e}")
                continue
            self.streams[inp.request_id] = steps  # (to pause: it is in the decode batch)
            try:
                yield from self._stream(inp, params, [first], steps, prompt_tokens=len(ids))
            finally:
                self._close(inp.request_id, steps)

    def _process_paged(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        """On vLLM: admit (:func:`~omni_ar.multimodal.handoff.admit_paged`), then continue
        from prefill's first token; the engine checks the block names, and ends a
        request whose KV stops short of a placeholder (omni's vLLM plugin)."""
        from omni_ar.engines.vllm_mm import MMContinuation

        for inp in batch:
            messages = self._messages(inp)
            w = inp.window
            sent = MMHandoff.as_sent(w)
            pixels = None
            try:
                if self.options.media == "reprocess":
                    sent, pixels = self._rerender(messages, sent)
                elif messages is not None and has_media(messages):
                    raise AdmissionError(
                        "media payload: the request still carries image data; a requires_kv "
                        "request carries only item hashes"
                    )
                adm = admit_paged(
                    sent, w.arrays, self.engine.block_size, self.placeholder_id, self.engine.merge
                )
                if not w.tokens:
                    raise AdmissionError("prefill sent no first token")
                handoff = Handoff.read(w)
            except (AdmissionError, HandoffError) as e:
                yield inp.fail(f"requires_kv admission: {e}")
                continue
            params = handoff.params
            ids = adm.handoff.prompt_token_ids
            mm = MMContinuation(adm.handoff.mm_items, adm.block_hashes, pixels, adm.handoff.mrope)
            first = Sampled((w.tokens[0], w.logprobs[0] if w.logprobs else 0.0), handoff.first_top)
            try:
                steps = self.engine.decode(first[0], *adm.kv, params, ids, inp.priority, mm=mm)
            except RequestError as e:  # vLLM refused it as it entered
                yield inp.fail(e)
                continue
            self.streams[inp.request_id] = steps
            try:  # a request vLLM ends (its KV short of a placeholder) fails alone
                yield from self._stream(inp, params, [first], steps, prompt_tokens=len(ids))
            finally:
                self._close(inp.request_id, steps)

    def _rerender(
        self, messages: list[dict[str, Any]] | None, sent: dict[str, Any] | None
    ) -> tuple[dict[str, Any] | None, list[Any] | None]:
        """The full-media baseline: decode the request's images, hash them, run the image
        processor and re-tokenize, as a decode that receives media does to build its
        input (the pixel values would ride with it, unused where the KV covers), and on an
        M-RoPE model place the prompt's positions from the images' grids; returns the
        contract so rendered and the decoded images (vLLM processes them itself)."""
        if messages is None or sent is None:
            return sent, None
        try:
            o = self.options
            pixels = load_images(
                messages, o.max_image_pixels, o.max_total_pixels, o.allow_local_images
            )
        except RequestError as e:
            raise AdmissionError(f"media payload: {e}") from None
        if pixels and not self.vllm:
            self.engine.pixel_values(pixels)
        ids, spans = self.render.encode_mm(messages, [p.shape[:2] for p in pixels])
        mrope = None
        if self.render.merge is not None:
            grids = [self.render.grid(p.shape[:2]) for p in pixels]
            mrope = MRope(
                position_delta=position_delta(spans, grids, self.render.merge), grids=grids
            )
        return MMHandoff.rerendered(sent, ids, _items(pixels, spans), mrope), pixels


def _items(pixels: list[Any], spans: list[tuple[int, int]]) -> list[MMItem]:
    """Each image's hash and the span of its placeholders."""
    return [
        MMItem(hash=image_hash(px), offset=off, length=n)
        for px, (off, n) in zip(pixels, spans, strict=True)
    ]


class MMPostprocess(Postprocess):
    """ar.postprocess for requests whose messages carry image parts."""

    images = True
