"""A Llava-style vision-language model on the transformers engine, split for the handoff.

Prefill loads the whole model (vision tower, projector, language model). Decode loads
only the language model and its head, read tensor by tensor from the checkpoint, so it
never holds (or even reads) the vision tower's weights. Both load onto the engine's
device (see :class:`~omni_ar.engines.transformers_engine.TransformersEngine`); the KV they
hand out, and the prefix cache, stay on the CPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from omni_ar.engines.transformers_engine import TransformersEngine, _cache_of, kv_arrays
from omni_ar.multimodal.handoff import (
    AdmissionError,
    PrefixCache,
    block_hashes,
    check_handoff_model,
)
from omni_ar.multimodal.media import flatten
from omni_ar.params import SamplingParams

# checkpoint prefixes of a Llava-style model's language part (the saved layout, and the
# in-memory one of transformers 5) -> the prefix in a plain causal LM
LANGUAGE_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
    "lm_head.": "lm_head.",
}


def check_model_dir(model_dir: str) -> None:
    """:class:`ValueError` when the handoff cannot serve the model in ``model_dir``, read
    from its config alone (:func:`~omni_ar.multimodal.handoff.check_handoff_model`), on
    either engine."""
    from transformers import AutoConfig

    check_handoff_model(AutoConfig.from_pretrained(model_dir))


class VLMEngine(TransformersEngine):
    def check_model(self) -> None:
        """:func:`check_model_dir` of this engine's model."""
        check_model_dir(self.model_dir)

    def load_tokenizer(self) -> Any:
        """The processor (tokenizer + image processor; no model weights)."""
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(self.model_dir)
        self.tokenizer = self.processor.tokenizer
        return self.tokenizer

    def load_model(self, vision: bool = True) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForImageTextToText

        if self.threads:
            torch.set_num_threads(self.threads)
        dtype = getattr(torch, self.dtype)
        config = AutoConfig.from_pretrained(self.model_dir)
        if vision:
            self.adopt(
                AutoModelForImageTextToText.from_pretrained(
                    self.model_dir, dtype=dtype, **self._device_map()
                )
            )
        else:
            self.adopt(_language_model(Path(self.model_dir), config, dtype, self.device))
        text = config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.kv_shape = (text.num_hidden_layers, text.num_key_value_heads, head_dim)
        self.placeholder_id = int(
            getattr(config, "image_token_id", None) or config.image_token_index
        )

    # -- prompt -----------------------------------------------------------------------
    def encode_mm(
        self, messages: list[dict[str, Any]], sizes: list[tuple[int, int]]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Prompt ids with each image marker expanded to its placeholders, and the
        (offset, length) span of each image."""
        marker = self.processor.image_token
        ids = self.encode(flatten(messages, marker))
        marker_id = self.processor.image_token_id
        counts = self.processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
        if ids.count(marker_id) != len(sizes):
            raise ValueError(
                f"the chat template kept {ids.count(marker_id)} of {len(sizes)} image markers"
            )
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        for t in ids:
            if t == marker_id:
                n = counts[len(spans)]
                spans.append((len(out), n))
                out.extend([marker_id] * n)  # Llava: the marker is the placeholder
            else:
                out.append(t)
        return out, spans

    def pixel_values(self, images: list[np.ndarray]) -> Any:
        """The image processor's output for decoded RGB images (``(H, W, 3)``: said, not
        guessed, as a tiny image such as 1x1 would be guessed channels-first)."""
        import torch

        pv = self.processor.image_processor(
            images=images, return_tensors="pt", input_data_format="channels_last"
        )["pixel_values"]
        return pv.to(device=self.device, dtype=getattr(torch, self.dtype))

    # -- prefill ----------------------------------------------------------------------
    def prefill_kv(
        self,
        ids: list[int],
        items: list[dict[str, Any]],
        images: list[np.ndarray],
        block_size: int,
        cache: PrefixCache | None = None,
    ) -> tuple[Any, Any, int]:
        """(keys, values, cached positions): the KV of ``ids[:-1]``, the positions decode
        does not recompute, on the CPU (numpy; a CPU torch tensor for bfloat16, see
        :func:`~omni_ar.engines.transformers_engine.to_host`). Blocks found in ``cache``
        are reused (the vision encoder then skips the images they cover); computed full
        blocks are added to it."""
        import torch

        n = len(ids)
        hashes = block_hashes(ids, items, block_size)
        start = cache.match(hashes[: (n - 1) // block_size]) * block_size if cache else 0
        for it in sorted(items, key=lambda it: it["offset"]):  # never split an image
            if it["offset"] < start < it["offset"] + it["length"]:
                start = it["offset"] // block_size * block_size
        kwargs: dict[str, Any] = {}
        todo = [img for img, it in zip(images, items, strict=True) if it["offset"] >= start]
        if todo:
            kwargs["pixel_values"] = self.pixel_values(todo)
        if start:
            assert cache is not None
            kwargs[self.cache_kw] = self.cache_from(*cache.get(hashes[: start // block_size]))
        with torch.inference_mode():
            out = self.model(
                input_ids=self.tensor([ids[start:]]), use_cache=True, logits_to_keep=1, **kwargs
            )
        keys, values = kv_arrays(_cache_of(out))
        if cache is not None:
            cache.put(hashes[: n // block_size], keys, values, block_size)
        return keys[:, :, : n - 1], values[:, :, : n - 1], start

    # -- decode -----------------------------------------------------------------------
    def resume(
        self,
        ids: list[int],
        keys: Any,
        values: Any,
        kv_tokens: int,
        params: SamplingParams,
    ) -> Iterator[tuple[int, float]]:
        """Continue a prompt from the KV of its first ``kv_tokens`` positions: recompute
        the rest of the prompt (text only; placeholders are never recomputed), then
        yield the first generated token and the ones after it."""
        import torch

        rest = ids[kv_tokens:]
        if self.placeholder_id in rest:
            raise AdmissionError(
                f"kv coverage: position {kv_tokens + rest.index(self.placeholder_id)} is a "
                "placeholder the KV does not cover; it is never recomputed"
            )
        cache = self.cache_from(keys[:, :, :kv_tokens], values[:, :, :kv_tokens])
        if cache.get_seq_length() != kv_tokens:
            raise AdmissionError(
                f"kv coverage: the cache holds {cache.get_seq_length()} positions after "
                f"admission, {kv_tokens} were admitted"
            )
        with torch.inference_mode():
            out = self.model(
                self.tensor([rest]), use_cache=True, logits_to_keep=1, **{self.cache_kw: cache}
            )
        first = self._pick(out.logits[0, -1], params, self.generator(params))
        yield first  # as picked: with its top_logprobs alternatives
        yield from self.steps(first[0], _cache_of(out), params)


def _language_model(path: Path, config: Any, dtype: Any, device: str = "cpu") -> Any:
    """The language model and head of a Llava-style checkpoint as a causal LM on
    ``device``, reading only their tensors (straight onto the device)."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig

    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    state = {}
    for name in files:
        with safe_open(str(path / name), framework="pt", device=device) as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                for src, dst in LANGUAGE_PREFIXES.items():
                    if key.startswith(src):
                        state[dst + key[len(src) :]] = f.get_tensor(key).to(dtype)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config.get_text_config(), dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    if device != "cpu":
        model.to(device)  # the buffers (rotary frequencies) were made on the CPU
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model
