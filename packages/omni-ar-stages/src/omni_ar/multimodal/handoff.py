"""The ``requires_kv`` handoff: what prefill hands decode instead of media, and the
checks decode runs before it continues from the KV.

Prefill's segment payload carries ``handoff`` (:class:`omni_ar.handoff.MMHandoff`)::

    {"requires_kv": true, "prompt_token_ids": [...], "block_size": 16,
     "mm_items": [{"hash": "...", "offset": 12, "length": 16}, ...],
     "kv_block_hashes": ["...", ...]}

and its arrays ``keys``/``values`` (``(layers, kv_heads, T, head_dim)``) hold the KV of
the first ``T`` prompt positions. Each KV block is named by a chained hash of its token
ids and the hashes of the items whose placeholders it overlaps, so the same tokens with
another image name other blocks; both sides compute the names with
:func:`block_hashes`. Decode recomputes the final prompt token (and any text after the
KV), never a placeholder: a request whose KV does not cover every placeholder fails.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from omni_ar.handoff import MMHandoff, MMItem, kv_of_arrays, media_arrays
from omni_ar.multimodal.mrope import MROPE_MODEL_TYPES, grid_tokens, position_delta, uses_mrope


class AdmissionError(Exception):
    """A ``requires_kv`` request decode must not continue; the message names the check."""


# architecture-name endings of models that pool instead of generating
POOLING_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForImageClassification",
    "ForRewardModeling",
    "ForEmbedding",
    "EmbeddingModel",
)


def check_handoff_model(config: Any) -> None:
    """:class:`ValueError` naming why a model cannot hand a multimodal prompt's KV on
    without its media, from its ``transformers`` config (``AutoConfig``):

    * M-RoPE of a model type other than Qwen2-VL's and Qwen2.5-VL's
      (:data:`~omni_ar.multimodal.mrope.MROPE_MODEL_TYPES`): decode places the tokens
      after the media from prefill's position fields, by a rule it must know;
    * encoder-decoder models, and decoders that cross-attend to the image (Mllama):
      decode would need the encoder's states, not only the decoder's KV;
    * a model that pools (a classification, reward or embedding head) instead of generating.
    """
    text = config.get_text_config()
    name = getattr(config, "model_type", "?")
    if uses_mrope(config) and name not in MROPE_MODEL_TYPES:
        raise ValueError(
            f"model type {name!r} uses M-RoPE with a position rule the handoff does not "
            f"know (it knows {', '.join(MROPE_MODEL_TYPES)}'s): a requires_kv decode, "
            "which never sees the media, could not place the tokens after them"
        )
    for c in (config,) if text is config else (config, text):
        if getattr(c, "is_encoder_decoder", False):
            raise ValueError(
                f"model type {name!r} is an encoder-decoder model: its decode needs the "
                "encoder's states, not only the decoder's KV"
            )
        if getattr(c, "cross_attention_layers", None):
            raise ValueError(
                f"model type {name!r} cross-attends to the image in its decoder layers: its "
                "decode needs the image's states, not only the KV of the prompt"
            )
    for arch in getattr(config, "architectures", None) or []:
        if isinstance(arch, str) and arch.endswith(POOLING_HEADS):
            raise ValueError(
                f"model architecture {arch!r} pools (it has no language-model head): the "
                "multimodal stages continue a prompt by generating from its KV"
            )


def block_hashes(
    ids: list[int], items: list[MMItem], block_size: int, n: int | None = None
) -> list[str]:
    """Chained hashes of the blocks of ``ids[:n]`` (the last one may be partial), each
    over its token ids and the hashes of the items whose spans overlap it."""
    n = len(ids) if n is None else n
    out: list[str] = []
    parent = b""
    for start in range(0, n, block_size):
        end = min(start + block_size, n)
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(np.asarray(ids[start:end], dtype="<i8").tobytes())
        for it in items:
            if it["offset"] < end and it["offset"] + it["length"] > start:
                h.update(b"|" + it["hash"].encode())
        parent = h.digest()
        out.append(h.hexdigest())
    return out


@dataclass(frozen=True)
class Admission:
    handoff: MMHandoff  # the contract, checked
    kv: tuple[Any, Any]  # the KV it came with: (keys, values)
    kv_tokens: int  # KV positions decode uses (the rest of the prompt it recomputes)
    block_hashes: list[str]  # decode's names for the blocks of the KV it received


def admit(
    sent: dict[str, Any] | None,
    arrays: dict[str, Any],
    block_size: int,
    kv_shape: tuple[int, int, int],
    placeholder_id: int,
    mrope_merge: int | None = None,
) -> Admission:
    """Every check of the contract ``sent`` (as it arrived), in order;
    :class:`AdmissionError` names the first that fails. ``kv_shape`` is the model's
    (layers, kv heads, head dim); ``mrope_merge``, an M-RoPE model's spatial merge
    (None: the model has no M-RoPE)."""
    h = read_contract(sent)
    check_requires_kv(h)
    check_block_size(h, block_size)
    check_no_media_arrays(arrays)
    required = check_spans(h, placeholder_id)
    check_mrope(h, mrope_merge)
    kv = check_kv_coverage(h, arrays, kv_shape, required)
    t = kv[0].shape[2]
    names = check_block_hashes(h, t)
    return Admission(h, kv, min(t, len(h.prompt_token_ids) - 1), names)


def read_contract(sent: dict[str, Any] | None) -> MMHandoff:
    """The contract, typed: present, well formed, with a prompt, and items that carry no
    media (only a hash and a placeholder span)."""
    if sent is None:
        raise AdmissionError("handoff: prefill sent no handoff (payload 'handoff' missing)")
    extras = MMHandoff.item_extras(sent)
    if extras:
        i, extra = extras[0]
        raise AdmissionError(
            f"mm item {i}: carries a media payload ({', '.join(extra)}); a requires_kv "
            "item carries only its hash and placeholder span"
        )
    try:
        h = msgspec.convert(sent, MMHandoff)
    except msgspec.ValidationError as e:
        raise AdmissionError(f"handoff: {e}") from None
    if not h.prompt_token_ids:
        raise AdmissionError("handoff: 'prompt_token_ids' is missing or empty")
    return h


def check_requires_kv(h: MMHandoff) -> None:
    """Media items need ``requires_kv``: this decode stage has no vision encoder."""
    if h.mm_items and not h.requires_kv:
        raise AdmissionError(
            f"requires_kv: the request has {len(h.mm_items)} media item(s) but requires_kv is "
            "not set, and this decode stage has no vision encoder"
        )


def check_block_size(h: MMHandoff, block_size: int) -> None:
    """Both sides name blocks of the same size."""
    if h.block_size != block_size:
        raise AdmissionError(
            f"block size: prefill named blocks of {h.block_size} tokens, this "
            f"decode stage uses {block_size}"
        )


def check_no_media_arrays(arrays: dict[str, Any]) -> None:
    """Only the KV arrives: no media arrays beside it."""
    media = media_arrays(arrays)
    if media:
        raise AdmissionError(
            f"media payload: arrays {media} arrived with a requires_kv request; it carries "
            "only item hashes and placeholder spans"
        )


def check_spans(h: MMHandoff, placeholder_id: int) -> int:
    """Each item's hash and placeholder span (inside the prompt, before its final token,
    which decode recomputes), and no placeholder token outside every span; returns the
    prompt positions the KV must cover (up to the end of the last span)."""
    ids = h.prompt_token_ids
    n = len(ids)
    required = 0
    claimed = np.zeros(n, dtype=bool)
    for i, it in enumerate(h.mm_items):
        if not it["hash"]:
            raise AdmissionError(f"mm item {i}: empty hash")
        off, length = it["offset"], it["length"]
        if off < 0 or length < 1:
            raise AdmissionError(f"mm item {i}: invalid placeholder span {off!r}+{length!r}")
        end = off + length
        if end > n:
            raise AdmissionError(
                f"mm item {i}: placeholder span [{off}, {end}) lies outside the prompt of "
                f"{n} tokens"
            )
        if end > n - 1:
            raise AdmissionError(
                f"mm item {i}: placeholder span [{off}, {end}) reaches the final prompt "
                f"token (position {n - 1}), which decode recomputes"
            )
        claimed[off:end] = True
        required = max(required, end)
    stray = np.flatnonzero((np.asarray(ids) == placeholder_id) & ~claimed)
    if stray.size:
        raise AdmissionError(
            f"placeholders: prompt position {int(stray[0])} holds a placeholder token "
            "outside every item's span"
        )
    return required


def check_mrope(h: MMHandoff, merge: int | None) -> None:
    """An M-RoPE model's position fields (``merge``: its spatial merge; None, a model
    without M-RoPE, which must get none): one grid per item, each an image's
    ``(1, h, w)`` that makes exactly its span's placeholders, and the position delta
    those grids give (:mod:`omni_ar.multimodal.mrope`)."""
    m = h.mrope
    if merge is None:
        if m is not None:
            raise AdmissionError(
                "mrope: prefill sent M-RoPE position fields, and this decode's model has no M-RoPE"
            )
        return
    if m is None:
        raise AdmissionError(
            "mrope: missing; this model's positions (M-RoPE) after the media need the "
            "position delta and each item's grid from prefill"
        )
    items = h.mm_items
    if len(m.grids) != len(items):
        raise AdmissionError(f"mrope.grids: {len(m.grids)} grids for {len(items)} mm items")
    for i, (grid, it) in enumerate(zip(m.grids, items, strict=True)):
        if len(grid) != 3 or grid[0] != 1 or min(grid) < 1 or grid[1] % merge or grid[2] % merge:
            raise AdmissionError(
                f"mrope.grids[{i}]: {grid!r} is not an image's (1, h, w) patch grid "
                f"(h and w multiples of the spatial merge {merge})"
            )
        if grid_tokens(grid, merge) != it["length"]:
            raise AdmissionError(
                f"mrope.grids[{i}]: grid {tuple(grid)} makes {grid_tokens(grid, merge)} "
                f"placeholders; mm item {i}'s span has {it['length']}"
            )
    spans = [(it["offset"], it["length"]) for it in items]
    want = position_delta(spans, m.grids, merge)
    if m.position_delta != want:
        raise AdmissionError(
            f"mrope.position_delta: prefill sent {m.position_delta}; mrope.grids "
            f"{m.grids} give {want}"
        )


def check_kv_coverage(
    h: MMHandoff, arrays: dict[str, Any], kv_shape: tuple[int, int, int], required: int
) -> tuple[Any, Any]:
    """The KV arrived, fits the model, covers every placeholder (the first ``required``
    positions, never recomputed) and no more than the prompt; returns (keys, values)."""
    keys, values = kv = arrived_kv(arrays, required)
    want = (kv_shape[0], kv_shape[1], kv_shape[2])
    if (
        keys.ndim != 4
        or keys.shape != values.shape
        or (keys.shape[0], keys.shape[1], keys.shape[3]) != want
    ):
        raise AdmissionError(
            f"kv coverage: KV of shapes {tuple(keys.shape)} / {tuple(values.shape)} does not "
            f"fit this model's (layers, kv heads, head dim) = {want}"
        )
    check_covers(h, keys.shape[2], required)
    return kv


def arrived_kv(arrays: dict[str, Any], required: int) -> tuple[Any, Any]:
    """The (keys, values) that arrived; positions ``[0, required)`` need them."""
    kv = kv_of_arrays(arrays)
    if kv is None:
        raise AdmissionError(
            f"kv coverage: no KV arrived ('keys'/'values' missing); positions [0, {required}) "
            "hold placeholders and are never recomputed"
        )
    return kv


def check_covers(h: MMHandoff, t: int, required: int) -> None:
    """KV of ``t`` prompt positions covers every placeholder and no more than the prompt."""
    items = h.mm_items
    if t < required:
        worst = max(range(len(items)), key=lambda i: items[i]["offset"] + items[i]["length"])
        it = items[worst]
        raise AdmissionError(
            f"kv coverage: the KV covers {t} prompt positions; mm item {worst}'s "
            f"placeholders [{it['offset']}, {it['offset'] + it['length']}) need {required}"
        )
    n = len(h.prompt_token_ids)
    if t > n:
        raise AdmissionError(f"kv coverage: KV of {t} positions for a prompt of {n} tokens")


def admit_paged(
    sent: dict[str, Any] | None,
    arrays: dict[str, Any],
    block_size: int,
    placeholder_id: int,
    mrope_merge: int | None = None,
) -> Admission:
    """:func:`admit` for KV in a paged engine's blocks (vLLM: ``(layers, blocks, ...)``,
    each block named by the engine's own hashing): every check but the names' values,
    which the decode engine's KV connector compares with its own block by block before
    it loads any (:mod:`omni_ar.engines.kv_connector`)."""
    h = read_contract(sent)
    check_requires_kv(h)
    check_block_size(h, block_size)
    check_no_media_arrays(arrays)
    required = check_spans(h, placeholder_id)
    check_mrope(h, mrope_merge)
    keys, values = kv = arrived_kv(arrays, required)
    if keys.ndim < 3 or keys.shape != values.shape:
        raise AdmissionError(
            f"kv coverage: KV of shapes {tuple(keys.shape)} / {tuple(values.shape)} is not "
            "(layers, blocks, ...) blocks"
        )
    n = len(h.prompt_token_ids)
    blocks = keys.shape[1]
    check_covers(h, min(blocks * block_size, n), required)
    if blocks > -(-n // block_size):
        raise AdmissionError(
            f"kv coverage: {blocks} KV blocks for a prompt of {n} tokens "
            f"({-(-n // block_size)} blocks of {block_size})"
        )
    if len(h.kv_block_hashes) != blocks:
        raise AdmissionError(
            f"block hashes: the KV is named by {len(h.kv_block_hashes)} block hashes but "
            f"holds {blocks} blocks"
        )
    return Admission(h, kv, min(blocks * block_size, n), h.kv_block_hashes)


def check_block_hashes(h: MMHandoff, t: int) -> list[str]:
    """Prefill's names of the ``t`` positions' KV blocks are decode's own: the KV was
    computed for these tokens and media; returns the names."""
    names = h.kv_block_hashes
    mine = block_hashes(h.prompt_token_ids, h.mm_items, h.block_size, t)
    if len(names) != len(mine):
        raise AdmissionError(
            f"block hashes: the KV is named by {len(names)} block hashes but covers "
            f"{len(mine)} blocks"
        )
    for b, (theirs, ours) in enumerate(zip(names, mine, strict=True)):
        if theirs != ours:
            size = h.block_size
            raise AdmissionError(
                f"block hashes: KV block {b} (positions [{b * size}, "
                f"{min((b + 1) * size, t)})) was computed for other tokens or media "
                f"({theirs} != {ours})"
            )
    return mine


class PrefixCache:
    """KV of full prompt blocks, keyed by their chained block hashes (LRU), in host
    memory: numpy arrays, or CPU torch tensors (bfloat16 KV, which numpy has no type for)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[str, tuple[Any, Any]] = OrderedDict()
        self.hits = 0  # blocks served

    def match(self, hashes: list[str]) -> int:
        """How many leading blocks of ``hashes`` are cached."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def get(self, hashes: list[str]) -> tuple[Any, Any]:
        """The KV of the cached blocks ``hashes``, concatenated along positions."""
        for h in hashes:
            self.blocks.move_to_end(h)
        self.hits += len(hashes)
        ks, vs = zip(*(self.blocks[h] for h in hashes), strict=True)
        return _concat(ks), _concat(vs)

    def put(self, hashes: list[str], keys: Any, values: Any, size: int) -> None:
        """Store each full block of ``keys``/``values`` under its hash."""
        if self.capacity <= 0:
            return
        for b, h in enumerate(hashes):
            if h in self.blocks:
                self.blocks.move_to_end(h)
                continue
            sl = slice(b * size, (b + 1) * size)
            self.blocks[h] = (_copy(keys[:, :, sl]), _copy(values[:, :, sl]))
            while len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)


def _copy(a: Any) -> Any:
    return a.copy() if isinstance(a, np.ndarray) else a.clone()


def _concat(parts: tuple[Any, ...]) -> Any:
    """Blocks joined along positions (axis 2), numpy or torch alike."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=2)
    import torch

    return torch.cat(parts, dim=2)
