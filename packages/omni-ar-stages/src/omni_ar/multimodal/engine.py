"""A vision-language model on the transformers engine, split for the handoff: Llava-style
models, and Qwen2-VL / Qwen2.5-VL (M-RoPE, dynamic resolution).

Prefill loads the whole model (vision tower, projector, language model). Decode loads
only the language model and its head, read tensor by tensor from the checkpoint, so it
never holds (or even reads) the vision tower's weights. Both load onto the engine's
device (see :class:`~omni_ar.engines.transformers_engine.TransformersEngine`); the KV they
hand out, and the prefix cache, stay on the CPU.

On an M-RoPE model prefill gives every prompt position explicitly (the model's own
``get_rope_index`` over the whole prompt, so a prefix-cache hit starts mid-prompt at the
right positions) and returns the position delta and the grids
(:class:`~omni_ar.handoff.MRope`); decode places the tokens after the KV at their
index plus the delta (:mod:`omni_ar.multimodal.mrope`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from omni_ar.engines.transformers_engine import TransformersEngine
from omni_ar.engines.transformers_kv import cache_of, kv_arrays
from omni_ar.engines.transformers_sampling import pick
from omni_ar.handoff import MRope
from omni_ar.multimodal.handoff import (
    AdmissionError,
    PrefixCache,
    block_hashes,
    check_handoff_model,
)
from omni_ar.multimodal.media import flatten
from omni_ar.multimodal.mrope import grid_tokens, uses_mrope
from omni_ar.params import Sampled, SamplingParams

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
        """The processor (tokenizer + image processor; no model weights). An M-RoPE
        model's tokenizer and image processor load apart: its processor holds a video
        processor, which needs torchvision."""
        from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

        config = AutoConfig.from_pretrained(self.model_dir)
        self.merge = _merge_size(config)
        if self.merge is None:
            self.processor = AutoProcessor.from_pretrained(self.model_dir)
            self.tokenizer = self.processor.tokenizer
            self.image_processor = self.processor.image_processor
            self.marker = self.processor.image_token
            self.marker_id = self.processor.image_token_id
            return self.tokenizer
        self.processor = None
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.image_processor = AutoImageProcessor.from_pretrained(self.model_dir)
        self.marker_id = int(config.image_token_id)
        # the chat template's image: <|vision_start|><|image_pad|><|vision_end|>
        self.marker = "".join(
            self.tokenizer.convert_ids_to_tokens(
                [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
            )
        )
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
        self.merge = _merge_size(config)

    # -- M-RoPE ---------------------------------------------------------------------------
    def grid(self, size: tuple[int, int]) -> list[int]:
        """The (t, h, w) patch grid an image of ``size`` (H, W) becomes: the image
        processor's own resize rule (``smart_resize``) over its patch size."""
        ip = self.image_processor
        patch, merge = ip.patch_size, ip.merge_size
        h, w = _smart_resize(ip)(
            size[0],
            size[1],
            patch * merge,
            min_pixels=ip.size["shortest_edge"],
            max_pixels=ip.size["longest_edge"],
        )
        return [1, h // patch, w // patch]

    def rope_positions(self, ids: list[int], grids: list[list[int]]) -> tuple[Any, int]:
        """(3, 1, len(ids)) position ids of a prompt and its position delta, by the
        model's own ``get_rope_index``."""
        import torch

        ii = self.tensor([ids])
        kinds = (ii == self.placeholder_id).int()
        thw = torch.tensor(grids, dtype=torch.long, device=self.device) if grids else None
        positions, delta = self.model.model.get_rope_index(ii, kinds, image_grid_thw=thw)
        return positions, int(delta.reshape(-1)[0])

    # -- prompt -----------------------------------------------------------------------
    def encode_mm(
        self, messages: list[dict[str, Any]], sizes: list[tuple[int, int]]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Prompt ids with each image marker expanded to its placeholders, and the
        (offset, length) span of each image."""
        ids = self.encode(flatten(messages, self.marker))
        marker_id = self.marker_id
        if self.merge is None:
            counts = self.processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
        else:
            counts = [grid_tokens(self.grid(size), self.merge) for size in sizes]
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
                out.extend([marker_id] * n)  # the marker is the placeholder
            else:
                out.append(t)
        return out, spans

    def pixel_values(self, images: list[np.ndarray]) -> dict[str, Any]:
        """The image processor's output for decoded RGB images (``(H, W, 3)``: said, not
        guessed, as a tiny image such as 1x1 would be guessed channels-first), as the
        model's keyword arguments: ``pixel_values``, and on M-RoPE models
        ``image_grid_thw``."""
        import torch

        out = self.image_processor(
            images=images, return_tensors="pt", input_data_format="channels_last"
        )
        kwargs = {"pixel_values": out["pixel_values"].to(self.device, getattr(torch, self.dtype))}
        if "image_grid_thw" in out:
            kwargs["image_grid_thw"] = out["image_grid_thw"].to(self.device)
        return kwargs

    # -- prefill ----------------------------------------------------------------------
    def prefill_kv(
        self,
        ids: list[int],
        items: list[dict[str, Any]],
        images: list[np.ndarray],
        block_size: int,
        cache: PrefixCache | None = None,
    ) -> tuple[Any, Any, int, MRope | None]:
        """(keys, values, cached positions, M-RoPE fields): the KV of ``ids[:-1]``, the
        positions decode does not recompute, on the CPU (numpy; a CPU torch tensor for
        bfloat16, see :func:`~omni_ar.engines.transformers_kv.to_host`). Blocks found
        in ``cache`` are reused (the vision encoder then skips the images they cover);
        computed full blocks are added to it. The M-RoPE fields are None on a model
        without M-RoPE."""
        import torch

        n = len(ids)
        hashes = block_hashes(ids, items, block_size)
        start = cache.match(hashes[: (n - 1) // block_size]) * block_size if cache else 0
        # never split an image: from the last one back, as moving the start to an image's
        # block may land it inside the image before
        for it in sorted(items, key=lambda it: it["offset"], reverse=True):
            if it["offset"] < start < it["offset"] + it["length"]:
                start = it["offset"] // block_size * block_size
        kwargs: dict[str, Any] = {}
        todo = [img for img, it in zip(images, items, strict=True) if it["offset"] >= start]
        if todo:
            kwargs |= self.pixel_values(todo)
        mrope = None
        if self.merge is not None:
            grids = [self.grid(img.shape[:2]) for img in images]
            positions, delta = self.rope_positions(ids, grids)
            kwargs["position_ids"] = positions[:, :, start:]
            mrope = MRope(position_delta=delta, grids=grids)
        if start:
            assert cache is not None
            kwargs[self.cache_kw] = self.cache_from(*cache.get(hashes[: start // block_size]))
        with torch.inference_mode():
            out = self.model(
                input_ids=self.tensor([ids[start:]]), use_cache=True, logits_to_keep=1, **kwargs
            )
        keys, values = kv_arrays(cache_of(out))
        if cache is not None:
            cache.put(hashes[: n // block_size], keys, values, block_size)
        return keys[:, :, : n - 1], values[:, :, : n - 1], start, mrope

    # -- decode -----------------------------------------------------------------------
    def resume(
        self,
        ids: list[int],
        keys: Any,
        values: Any,
        kv_tokens: int,
        params: SamplingParams,
        mrope: MRope | None = None,
    ) -> Iterator[Sampled]:
        """Continue a prompt from the KV of its first ``kv_tokens`` positions: recompute
        the rest of the prompt (text only; placeholders are never recomputed), pick the
        first generated token, and join the decode batch (at this call: its errors are
        raised here) for the ones after it; where only the prompt's last token is left
        (prefill hands over all the others), it joins the batch at once and the batch's
        next step picks the first token. The iterator gives the first token, then the
        rest; close it to leave the batch. ``mrope`` (an M-RoPE model's, admitted): every
        token from here on sits at its index plus the position delta."""
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
        offset = None if self.merge is None else (mrope.position_delta if mrope else 0)
        if len(rest) == 1:  # the prompt's last token: the batch's next step picks the first
            return self.join_before_first(rest[0], cache, params, ids, offset or 0)
        kwargs: dict[str, Any] = {self.cache_kw: cache}
        if offset is not None:
            at = range(kv_tokens + offset, len(ids) + offset)
            kwargs["position_ids"] = self.tensor([list(at)])
        with torch.inference_mode():
            out = self.model(self.tensor([rest]), use_cache=True, logits_to_keep=1, **kwargs)
        state = self.logits(params, ids)
        first = pick(out.logits[0, -1], params, self.generator(params), state=state)
        return self.continue_from(first, cache_of(out), params, ids, offset or 0)


def _merge_size(config: Any) -> int | None:
    """An M-RoPE model's spatial merge (image patches per placeholder along a side);
    None for a model without M-RoPE."""
    return int(config.vision_config.spatial_merge_size) if uses_mrope(config) else None


def _smart_resize(image_processor: Any) -> Any:
    """The resize rule (``smart_resize``) of an image processor's own module."""
    import sys

    return sys.modules[type(image_processor).__module__].smart_resize


def _language_model(path: Path, config: Any, dtype: Any, device: str = "cpu") -> Any:
    """The language model and head of a vision-language checkpoint on ``device``,
    reading only their tensors (straight onto the device): a Llava-style model's as a
    causal LM; an M-RoPE model's as the model itself without its vision tower (its
    language model places tokens by M-RoPE, which no causal LM class does)."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig

    if uses_mrope(config):
        return _without_vision(path, config, dtype, device)

    state = {}
    for name in _checkpoint_files(path):
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


def _checkpoint_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def _without_vision(path: Path, config: Any, dtype: Any, device: str) -> Any:
    """An M-RoPE model (Qwen2-VL's layout) with its language model and head read from
    the checkpoint and no vision tower: the tower's tensors are never read, and its
    module is an empty one (a request that reaches it has media, which decode refuses)."""
    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText, GenerationConfig

    with init_empty_weights(include_buffers=False):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    state = {}
    for name in _checkpoint_files(path):
        with safe_open(str(path / name), framework="pt", device=device) as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if key.startswith(("visual.", "model.visual.")):
                    continue
                # the hub's layout (model.layers...) -> transformers 5's (model.language_model...)
                own = key
                if key.startswith("model.") and not key.startswith("model.language_model."):
                    own = "model.language_model." + key[len("model.") :]
                state[own] = f.get_tensor(key).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    left = [k for k in missing if not k.startswith("model.visual.")]
    if left or unexpected:
        raise ValueError(
            f"{path}: the language model's tensors do not match its config: missing "
            f"{left[:3]}, unexpected {list(unexpected)[:3]}"
        )
    model.model.visual = torch.nn.Module()  # no tower: never built, never read
    if device != "cpu":
        model.to(device)
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()
