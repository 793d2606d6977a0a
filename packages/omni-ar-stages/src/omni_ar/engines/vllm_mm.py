"""The vLLM engine's multimodal half (the ``ar.mm_*`` stages on ``engine: vllm``): its
prompts and continuations (:class:`MMPrompt`, :class:`MMPrefilled`,
:class:`MMContinuation`), vLLM's inputs for them, multimodal prefill through the
``shm`` connector, the media-free continuation's items, and vLLM's own M-RoPE
positions (:class:`VllmMultimodal`, a base of
:class:`~omni_ar.engines.vllm_engine.VllmEngine`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from omni_ar.errors import EngineRequestError
from omni_ar.handoff import MMItem, MRope
from omni_ar.multimodal.mrope import grid_tokens
from omni_ar.params import RequestError, Sampled, SamplingParams


@dataclass(frozen=True)
class MMContinuation:
    """What a multimodal decode gets beside the KV: each image's hash and placeholder
    span and prefill's block names; ``images`` only in the full-media baseline (a
    decode without the contract, which processes the media again)."""

    items: list[MMItem]  # each image's content hash and placeholder span
    block_hashes: list[str]  # prefill's names of the prompt's blocks (MMPrefilled's)
    images: list[np.ndarray] | None = None  # decoded RGB, (H, W, 3), in items' order
    mrope: MRope | None = None  # an M-RoPE model's position delta and grids (MMPrefilled's)


class MMPrompt(NamedTuple):
    """A multimodal prompt as ``ar.mm_intake`` made it."""

    ids: list[int]  # each image's placeholders expanded
    items: list[MMItem]  # each image's content hash and placeholder span
    images: list[np.ndarray]  # decoded RGB, (H, W, 3), in items' order


@dataclass(frozen=True)
class MMPrefilled:
    """A multimodal prompt's prefill on vLLM: the first token, the KV of the prompt in
    vLLM's blocks, the name vLLM gives each block of the prompt, and on an M-RoPE model
    the position delta and each item's grid, as vLLM computed them."""

    first: Sampled
    keys: Any
    values: Any
    block_hashes: list[str]  # one per block of the prompt, the last one possibly partial
    mrope: MRope | None = None  # M-RoPE models only


class VllmMultimodal:
    """The multimodal methods of :class:`~omni_ar.engines.vllm_engine.VllmEngine`: they
    read its loaded ``llm``/``engine``, its KV role and connector, and run prompts
    through its ``_prefill``."""

    llm: Any
    engine: Any
    kv_role: str | None
    kv_connector: str
    multimodal: bool
    media_free: bool
    merge: int | None

    def _prefill(
        self,
        prompts: list[list[int]] | list[dict[str, Any]],
        params: list[SamplingParams],
        priorities: list[int] | None = None,
        record: bool = False,
    ) -> Iterator[tuple[Sampled, tuple[Any, Any], str | None]]:
        raise NotImplementedError  # the engine's

    def _mrope_merge(self) -> int:
        """The loaded M-RoPE model's spatial merge; a media-free engine first checks that
        vLLM's model places a prompt's tokens from its items' grids alone (the data a
        media-free item carries, :func:`grid_item`)."""
        config = self.engine.model_config.hf_config
        merge = int(getattr(getattr(config, "vision_config", None), "spatial_merge_size", 0))
        try:
            if not merge:
                raise ValueError("its config has no vision_config.spatial_merge_size")
            if self.media_free:  # one image of one placeholder between two text tokens
                self._mrope_positions([0, 0, 0], [(1, 1)], [[1, merge, merge]])
        except Exception as e:  # whatever vLLM's model code raises on it
            arch = ", ".join(config.architectures or [config.model_type])
            raise RuntimeError(
                f"engine 'vllm' cannot serve a media-free decode of {arch}: its M-RoPE "
                f"positions do not follow from each image's grid alone ({e!r})"
            ) from None
        return merge

    def _mrope_positions(
        self, ids: list[int], spans: list[tuple[int, int]], grids: list[list[int]]
    ) -> tuple[int, int]:
        """(positions, position delta) of ``ids`` whose images lie at ``spans`` ((offset,
        length), by offset) with patch ``grids`` ``(t, h, w)``, by vLLM's own M-RoPE code
        (the model's ``get_mrope_input_positions``, as its model runner calls it for
        every request it adds)."""
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        features = [
            MultiModalFeatureSpec(
                data=grid_item(grid),
                modality="image",
                identifier=str(k),
                mm_position=PlaceholderRange(offset=off, length=n),
            )
            for k, ((off, n), grid) in enumerate(zip(spans, grids, strict=True))
        ]
        ((positions, delta),) = self.llm.apply_model(
            lambda model: model.get_mrope_input_positions(ids, features)
        )
        return int(positions.shape[-1]), int(delta)

    @property
    def placeholder_id(self) -> int:
        """The image placeholder token of the loaded multimodal model."""
        config = self.engine.model_config.hf_config
        return int(getattr(config, "image_token_id", None) or config.image_token_index)

    def prefill_mm(
        self,
        ids: list[int],
        items: list[MMItem],
        images: list[np.ndarray],
        params: SamplingParams,
        priority: int = 0,
    ) -> MMPrefilled:
        """:meth:`prefill_mm_many` of one prompt; a prompt vLLM renders otherwise raises
        :class:`EngineRequestError`."""
        (done,) = self.prefill_mm_many([MMPrompt(ids, items, images)], [params], [priority])
        if isinstance(done, str):
            raise EngineRequestError(done)
        return done

    def prefill_mm_many(
        self,
        prompts: list[MMPrompt],
        params: list[SamplingParams],
        priorities: list[int] | None = None,
    ) -> Iterator[MMPrefilled | str]:
        """Prefill multimodal prompts in the same engine steps (``ids`` with each image's
        placeholders expanded, as ``ar.mm_intake`` tokenized it; ``images`` decoded RGB,
        ``(H, W, 3)``): vLLM runs the image processor, the vision encoder and the prompt
        forward, and its connector hands out each prompt's KV. Each image goes in under
        its content hash (``items[i]["hash"]``), the identifier vLLM names the blocks of
        its placeholders with, so a repeated image + prefix hits vLLM's prefix cache here
        and the decode engine names the same blocks the same way. vLLM renders each
        prompt itself (each span collapsed to its one image marker, then expanded by
        vLLM's processor); the result of one it renders otherwise than ``ids`` is why
        (a ``str``), in its place."""
        from omni_ar.engines.kv_connector import RENDERED

        if not (self.kv_role == "kv_producer" and self.kv_connector == "shm"):
            raise RuntimeError(
                "vLLM multimodal prefill hands its KV on through the 'shm' connector as the "
                f"kv_producer (this engine: {self.kv_role}, {self.kv_connector!r})"
            )
        inputs = [media_prompt(p.ids, p.items, p.images) for p in prompts]
        steps = self._prefill(inputs, params, priorities, record=True)
        for p, (first, (keys, values), key) in zip(prompts, steps, strict=True):
            rendered = RENDERED.get(key or "")
            if rendered is None:
                raise RuntimeError("vLLM multimodal prefill: the KV connector recorded no prompt")
            want = [
                (it["hash"], it["offset"], it["length"])
                for it in sorted(p.items, key=lambda it: it["offset"])
            ]
            if rendered.prompt_token_ids != list(p.ids) or rendered.items != want:
                yield (
                    "vLLM rendered the prompt otherwise than ar.mm_intake: "
                    f"{len(rendered.prompt_token_ids)} tokens and items {rendered.items}, "
                    f"intake {len(p.ids)} tokens and items {want}"
                )
                continue
            mrope = None if self.merge is None else self._rendered_mrope(p.items, rendered)
            if isinstance(mrope, str):
                yield mrope
                continue
            yield MMPrefilled(first, keys, values, rendered.block_hashes, mrope)

    def _rendered_mrope(self, items: list[MMItem], rendered: Any) -> MRope | str:
        """An M-RoPE prompt's position fields as vLLM computed them: each item's grid
        (``items``' order) from vLLM's processor, and the delta from its M-RoPE code; or
        why there are none (a ``str``)."""
        grids = rendered.grids  # by offset, as rendered.items
        if any(g is None for g in grids):
            return f"vLLM's processor gave no image grid for items {rendered.items}"
        spans = [(off, n) for _, off, n in rendered.items]
        _, delta = self._mrope_positions(rendered.prompt_token_ids, spans, grids)
        by_offset = sorted(range(len(items)), key=lambda i: items[i]["offset"])
        ordered: list[list[int]] = [[] for _ in items]
        for k, i in enumerate(by_offset):
            ordered[i] = grids[k]
        return MRope(position_delta=delta, grids=ordered)

    def _requires_kv_input(
        self, ids: list[int], mm: MMContinuation, key: str | None, has_kv: bool
    ) -> dict[str, Any]:
        """The engine input of a media-free multimodal continuation: each item by its
        hash and placeholder span, with no data (the receiver cache is off on a
        multimodal consumer, so vLLM looks nothing up)."""
        from vllm.inputs.engine import mm_input
        from vllm.multimodal.inputs import PlaceholderRange

        from omni_ar.engines.vllm_requires_kv import CONNECTOR_NOTES, remember, require

        require()
        if not self.media_free:
            raise RuntimeError(
                "a media-free multimodal decode runs on a media-free multimodal kv_consumer "
                f"engine (this one: {self.kv_role}, multimodal={self.multimodal})"
            )
        order = sorted(mm.items, key=lambda it: it["offset"])
        data: list[Any] = [None] * len(order)
        if self.merge is not None:  # M-RoPE: each item's grid, from which vLLM places it
            data = [grid_item(grid) for grid in self._checked_grids(ids, mm)]
        elif mm.mrope is not None:
            raise RequestError("mrope: position fields for a model without M-RoPE")
        if not has_kv:
            remember(CONNECTOR_NOTES, str(key), "no KV arrived with it")
        return mm_input(
            ids,
            {"image": data},
            {"image": [it["hash"] for it in order]},
            {"image": [PlaceholderRange(offset=it["offset"], length=it["length"]) for it in order]},
        )

    def _checked_grids(self, ids: list[int], mm: MMContinuation) -> list[list[int]]:
        """The items' grids by offset, once vLLM's M-RoPE code, given them, places exactly
        ``ids`` and at prefill's position delta; else :class:`RequestError` (that request
        fails, before it enters the engine)."""
        m = mm.mrope
        if m is None:
            raise RequestError(
                "mrope: missing; an M-RoPE model's media-free decode places its tokens from "
                "prefill's position delta and each item's grid"
            )
        if len(m.grids) != len(mm.items):
            raise RequestError(f"mrope.grids: {len(m.grids)} grids for {len(mm.items)} mm items")
        for i, (it, grid) in enumerate(zip(mm.items, m.grids, strict=True)):
            n = grid_tokens(grid, self.merge or 1) if len(grid) == 3 else None
            if n != it["length"]:
                raise RequestError(
                    f"mrope.grids[{i}]: grid {grid} makes {n} placeholders; mm item {i}'s "
                    f"span has {it['length']}"
                )
        pairs = sorted(zip(mm.items, m.grids, strict=True), key=lambda p: p[0]["offset"])
        spans = [(it["offset"], it["length"]) for it, _ in pairs]
        grids = [list(grid) for _, grid in pairs]
        try:
            n, delta = self._mrope_positions(ids, spans, grids)
        except Exception as e:  # vLLM's model code refusing a grid (e.g. t != 1)
            raise RequestError(f"mrope.grids: vLLM cannot place {grids}: {e!r}") from None
        if n != len(ids):
            raise RequestError(
                f"mrope.grids: {grids} place {n} positions for a prompt of {len(ids)} tokens "
                "(a grid does not make its item's placeholders)"
            )
        if delta != m.position_delta:
            raise RequestError(
                f"mrope.position_delta: prefill sent {m.position_delta}; vLLM's M-RoPE gives "
                f"{delta} for the items' grids"
            )
        return grids


def grid_item(grid: list[int]) -> Any:
    """vLLM's data of an image item that carries only its patch grid ``(t, h, w)``
    (``image_grid_thw``, batched as Qwen2-VL's processor gives it): what vLLM's M-RoPE
    reads, and nothing a vision encoder could run on."""
    import torch
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItem

    field = MultiModalFieldConfig.batched("image", keep_on_cpu=True)
    (elem,) = field.build_elems("image_grid_thw", torch.tensor([grid], dtype=torch.int64))
    return MultiModalKwargsItem({"image_grid_thw": elem})


def media_prompt(ids: list[int], items: list[MMItem], images: list[np.ndarray]) -> dict[str, Any]:
    """vLLM's input for ``ids`` (placeholders expanded) and its images, each under its
    content hash: the ids with each span collapsed (:func:`collapse_placeholders`), for
    vLLM's processor to expand again."""
    from PIL import Image

    pairs = sorted(zip(items, images, strict=True), key=lambda p: p[0]["offset"])
    order = [it for it, _ in pairs]
    prompt: dict[str, Any] = {"prompt_token_ids": collapse_placeholders(ids, order)}
    if order:
        prompt["multi_modal_data"] = {"image": [Image.fromarray(np.asarray(px)) for _, px in pairs]}
        prompt["multi_modal_uuids"] = {"image": [it["hash"] for it in order]}
    return prompt


def collapse_placeholders(ids: list[int], items: list[MMItem]) -> list[int]:
    """``ids`` with each item's placeholder span (sorted by offset, Llava's layout: the
    image marker is the placeholder) collapsed to its first token, the one marker a
    processor expands again."""
    out: list[int] = []
    at = 0
    for it in items:
        off, n = it["offset"], it["length"]
        if off < at or n < 1 or off + n > len(ids):
            raise ValueError(f"mm item at {off}+{n}: not a span of a {len(ids)}-token prompt")
        out += ids[at : off + 1]
        at = off + n
    return out + ids[at:]
