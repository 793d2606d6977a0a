"""ar.text_encode: a language model used as a text encoder, to condition diffusion stages.

Input is the text of its upstream stage (the expanded prompt that ar.postprocess streams,
stitched from one window), or, as a source stage, the request's ``prompt``. The text is
tokenized, padded or cut to ``max_tokens`` (so every request has the same length and the
sampler can batch them, as SD3 pads its T5 prompt), and run through the model once; the
output is one segment with ``prompt_embeds`` ``(max_tokens, hidden)`` (the hidden states
of ``layer``) and ``pooled`` ``(hidden,)`` (their mean over the real tokens). With
``image.guidance > 1`` and an ``image.negative_prompt``, the negative prompt is encoded
alike (``negative_prompt_embeds``, ``negative_pooled``).

The model loads where the stage's ``devices`` and ``dtype`` place it
(:meth:`omni_core.plugin.StageContext.place`; ``dtype: auto`` is float32 on a CPU, bfloat16 or
float16 on a GPU); the embeddings it emits are float32 numpy arrays on the CPU whatever
the model's device and dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import msgspec
import numpy as np
from omni_core.plugin import Stage, StageEvent, StageInput

from omni_ar.engines import TRANSFORMERS_PRELOAD, load_engine
from omni_ar.engines.threads import Threads, thread_count
from omni_ar.models import resolve_model
from omni_ar.params import RequestError


class TextEncodeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``ar.text_encode``'s options."""

    model: str  # a Hugging Face model directory, or a named model ("smollm2")
    # auto: float32 on a CPU, bfloat16 (else float16) on a GPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: Threads = None  # torch threads in this worker; all: every core (at run time)
    max_tokens: int = 64  # every prompt is padded or cut to this many tokens
    layer: int = -1  # which hidden layer conditions the image (-1: the last)
    # a special token put before every text (its text, e.g. "<|endoftext|>"; None: none).
    # A causal LM's hidden state at position 0 hardly depends on the token there (it is
    # the attention sink: SmolLM2's last layer there is 0.994 alike for "red" and "blue"),
    # so a text's first word is lost unless something comes before it.
    lead_token: str | None = None


class TextEncode(Stage):
    """Text -> ``prompt_embeds`` and ``pooled`` (and their negative-prompt twins), one
    segment per request (see the module's description)."""

    Options = TextEncodeOptions
    preload = TRANSFORMERS_PRELOAD

    def load(self) -> None:
        o = self.options
        p = self.ctx.place(o.dtype)
        self.encoder = TextEncoder(
            o.model, p.dtype, thread_count(o.threads), p.device, o.max_tokens, o.layer, o.lead_token
        )
        self.engine = self.encoder.engine  # as every model stage has one

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            if inp.windows:
                text = "".join(
                    str(p.payload.get("text", "")) for p in inp.window.pieces if p.payload
                ).strip()
            else:
                text = ""
            if not text:  # a source stage, or an upstream that wrote nothing
                prompt = inp.request.get("prompt")
                if not isinstance(prompt, str) or not prompt:
                    yield inp.fail(
                        RequestError("field 'prompt': expected a non-empty string to encode")
                    )
                    continue
                text = prompt
            texts = [text]
            image = inp.request.get("image")
            if isinstance(image, dict) and float(image.get("guidance", 1.0) or 0) > 1.0:
                negative = image.get("negative_prompt")
                if isinstance(negative, str) and negative:
                    texts.append(negative)
            arrays = {}
            encoded = self.encoder.encode(texts)
            for prefix, (embeds, pooled, _) in zip(("", "negative_"), encoded, strict=False):
                arrays[f"{prefix}prompt_embeds"], arrays[f"{prefix}pooled"] = embeds, pooled
            yield inp.segment(
                arrays=arrays,
                payload={"encoded_text": text, "prompt_tokens": encoded[0][2]},
                is_last=True,
            )


class TextEncoder:
    """A language model as a text encoder: what ``ar.text_encode`` emits for a text, also
    for tools that need the same conditioning outside a pipeline (training a model on it)."""

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        threads: int | None = None,
        device: str = "cpu",
        max_tokens: int = 64,
        layer: int = -1,
        lead_token: str | None = None,
    ) -> None:
        self.engine = load_engine("transformers", resolve_model(model), dtype, threads, device)
        tok = self.engine.load_tokenizer()
        self.engine.load_model()
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self.max_tokens, self.layer = max_tokens, layer
        self.lead: list[int] = []
        if lead_token is not None:
            lead = tok.convert_tokens_to_ids(lead_token)
            if not isinstance(lead, int) or tok.convert_ids_to_tokens(lead) != lead_token:
                raise ValueError(f"option 'lead_token': {lead_token!r} is not one token of {model}")
            if max_tokens < 2:
                raise ValueError("option 'max_tokens': at least 2 with a lead_token")
            self.lead = [lead]

    def encode(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Per text: ``prompt_embeds`` ``(max_tokens, hidden)``, ``pooled`` ``(hidden,)``
        and how many of the tokens are the text's own (the rest are padding)."""
        ids, lengths = zip(*(self._ids(t) for t in texts), strict=True)
        hidden = self.engine.hidden_states(list(ids), self.layer)
        k = len(self.lead)  # the lead token is in the embeds, not in the pooled mean
        return [
            (np.ascontiguousarray(h), h[k : k + n].mean(axis=0), n)
            for h, n in zip(hidden, lengths, strict=True)
        ]

    def _ids(self, text: str) -> tuple[list[int], int]:
        """Token ids (the lead token first) padded or cut to ``max_tokens``, and how many
        are the text's own."""
        ids = (self.lead + self.engine.encode(text))[: self.max_tokens]
        n = max(1, len(ids) - len(self.lead))
        return ids + [self.pad_id] * (self.max_tokens - len(ids)), n
