"""``dit.text_encode``: the checkpoint's own text encoders and tokenizers, called through
the diffusers pipeline's ``encode_prompt`` (SD3: CLIP-L + CLIP-G + T5; Flux: CLIP-L
pooled + T5), so a prompt is encoded exactly as the pipeline encodes it.

The text is the upstream stage's text (an expanded prompt streamed by ``ar.postprocess``,
stitched from one window) or, as a source stage, the request's ``prompt``. When the
request is guided (SD3: ``image.guidance > 1``; Flux: ``image.true_cfg_scale > 1``) the
negative prompt is encoded too (the empty prompt when there is none, as SD3 does).
Alike requests are encoded as one batch (the stage's ``max_batch_size``): every prompt is
padded to the same length (CLIP's 77 tokens, T5's ``max_sequence_length``).

Output: one segment with ``prompt_embeds`` ``(tokens, width)``, ``pooled`` ``(width,)``
and, when guided, ``negative_prompt_embeds`` and ``negative_pooled`` (float32, on the
host). The encoders run on the stage's device in its ``dtype`` (``omni_dit.stages.placement``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from omni_core.plugin import Stage, StageEvent, StageInput

from omni_dit.architectures import TextOptions, architecture
from omni_dit.models import PRELOAD, ModelError, resolve_model
from omni_dit.params import ImageRequestError, image_fields
from omni_dit.stages import check_image_defaults, placement


class TextEncodeOptions(TextOptions, forbid_unknown_fields=True, kw_only=True):
    """The options of ``dit.text_encode``: the checkpoint, and how prompts are encoded
    (:class:`~omni_dit.architectures.base.TextOptions`)."""

    model: str  # a diffusers pipeline directory, a Hugging Face id, or an embedded model
    variant: str | None = None  # weights variant, as diffusers takes it ("fp16")
    dtype: str = "auto"  # auto: float32 on a CPU, bfloat16 or float16 on a GPU
    threads: int | None = None  # torch threads in this worker
    # the plan stage's image_defaults: whether a request is guided decides whether its
    # negative prompt is encoded
    image_defaults: dict[str, Any] = {}


class TextEncode(Stage):
    """``dit.text_encode``: a request's prompt (or the upstream stage's text) -> its
    conditioning arrays, through the checkpoint's own text encoders (see the module
    docstring above)."""

    Options = TextEncodeOptions
    preload = PRELOAD

    def load(self) -> None:
        import torch

        o = self.options
        self.placement = placement(self)
        check_image_defaults(o.image_defaults)
        if o.max_sequence_length is not None and not 1 <= o.max_sequence_length <= 512:
            raise ModelError(
                f"option 'max_sequence_length': expected 1..512 (the pipelines' limit), "
                f"got {o.max_sequence_length}"
            )
        if o.threads:
            torch.set_num_threads(o.threads)
        self.arch = architecture(resolve_model(o.model, variant=o.variant))
        where = self.placement
        self.pipeline = self.arch.load_text_pipeline(where.dtype, o.variant, o, where.device)
        self.arch.encode(self.pipeline, ["warm up"], None)

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        o = self.options
        # guided and unguided requests: one encode_prompt call each, as the pipeline
        # encodes a batch with or without its negative prompts
        groups: dict[bool, list[tuple[StageInput, str, str]]] = {True: [], False: []}
        for inp in batch:
            text = _upstream_text(inp) or inp.request.get("prompt")
            if not isinstance(text, str) or not text:
                yield inp.fail(
                    ImageRequestError("field 'prompt': expected a non-empty string to encode")
                )
                continue
            params = self.arch.with_defaults(image_fields(inp.request, o.image_defaults))
            groups[self.arch.guided(params)].append((inp, text, params.negative_prompt))
        for guided, jobs in groups.items():
            if not jobs:
                continue
            negatives = [neg for _, _, neg in jobs] if guided else None
            out = self.arch.encode(self.pipeline, [text for _, text, _ in jobs], negatives)
            embeds, pooled, neg, neg_pooled = (  # to the host once per tensor
                None if x is None else x.float().cpu().numpy() for x in out
            )
            for i, (inp, text, _) in enumerate(jobs):
                arrays = {"prompt_embeds": embeds[i], "pooled": pooled[i]}
                if guided:
                    arrays["negative_prompt_embeds"] = neg[i]
                    arrays["negative_pooled"] = neg_pooled[i]
                yield inp.segment(
                    arrays={k: np.ascontiguousarray(v) for k, v in arrays.items()},
                    payload={"encoded_text": text, "negatives": guided},
                    is_last=True,
                )


def _upstream_text(inp: StageInput) -> str:
    """The text the upstream stage wrote into this request's window, if any."""
    if not inp.windows:
        return ""
    return "".join(str(p.get("text", "")) for p in inp.window.payloads if p).strip()
