"""The ``requires_kv`` handoff: what prefill hands decode instead of media, and the
checks decode runs before it continues from the KV.

Prefill's segment payload carries ``handoff``::

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

import numpy as np

ITEM_KEYS = {"hash", "offset", "length"}


class AdmissionError(Exception):
    """A ``requires_kv`` request decode must not continue; the message names the check."""


def block_hashes(
    ids: list[int], items: list[dict[str, Any]], block_size: int, n: int | None = None
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
    kv_tokens: int  # KV positions decode uses (the rest of the prompt it recomputes)
    block_hashes: list[str]  # decode's names for the blocks of the KV it received


def admit(
    handoff: dict[str, Any] | None,
    arrays: dict[str, Any],
    block_size: int,
    kv_shape: tuple[int, int, int],
    placeholder_id: int,
) -> Admission:
    """Every check of the contract, in order; :class:`AdmissionError` names the first
    that fails. ``kv_shape`` is the model's (layers, kv heads, head dim)."""
    if handoff is None:
        raise AdmissionError("handoff: prefill sent no handoff (payload 'handoff' missing)")
    ids = handoff.get("prompt_token_ids")
    if not isinstance(ids, list) or not ids:
        raise AdmissionError("handoff: 'prompt_token_ids' is missing or empty")
    n = len(ids)
    items = handoff.get("mm_items") or []
    if items and handoff.get("requires_kv") is not True:
        raise AdmissionError(
            f"requires_kv: the request has {len(items)} media item(s) but requires_kv is "
            "not set, and this decode stage has no vision encoder"
        )
    if handoff.get("block_size") != block_size:
        raise AdmissionError(
            f"block size: prefill named blocks of {handoff.get('block_size')} tokens, this "
            f"decode stage uses {block_size}"
        )
    media = sorted(set(arrays) - {"keys", "values"})
    if media:
        raise AdmissionError(
            f"media payload: arrays {media} arrived with a requires_kv request; it carries "
            "only item hashes and placeholder spans"
        )
    required = 0
    claimed = np.zeros(n, dtype=bool)
    for i, it in enumerate(items):
        extra = sorted(set(it) - ITEM_KEYS)
        if extra:
            raise AdmissionError(
                f"mm item {i}: carries a media payload ({', '.join(extra)}); a requires_kv "
                "item carries only its hash and placeholder span"
            )
        if not isinstance(it.get("hash"), str) or not it["hash"]:
            raise AdmissionError(f"mm item {i}: empty hash")
        off, length = it.get("offset"), it.get("length")
        if not isinstance(off, int) or not isinstance(length, int) or off < 0 or length < 1:
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
    keys, values = arrays.get("keys"), arrays.get("values")
    if keys is None or values is None:
        raise AdmissionError(
            f"kv coverage: no KV arrived ('keys'/'values' missing); positions [0, {required}) "
            "hold placeholders and are never recomputed"
        )
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
    t = keys.shape[2]
    if t < required:
        worst = max(range(len(items)), key=lambda i: items[i]["offset"] + items[i]["length"])
        it = items[worst]
        raise AdmissionError(
            f"kv coverage: the KV covers {t} prompt positions; mm item {worst}'s "
            f"placeholders [{it['offset']}, {it['offset'] + it['length']}) need {required}"
        )
    if t > n:
        raise AdmissionError(f"kv coverage: KV of {t} positions for a prompt of {n} tokens")
    names = handoff.get("kv_block_hashes") or []
    mine = block_hashes(ids, items, block_size, t)
    if len(names) != len(mine):
        raise AdmissionError(
            f"block hashes: the KV is named by {len(names)} block hashes but covers "
            f"{len(mine)} blocks"
        )
    for b, (theirs, ours) in enumerate(zip(names, mine, strict=True)):
        if theirs != ours:
            raise AdmissionError(
                f"block hashes: KV block {b} (positions [{b * block_size}, "
                f"{min((b + 1) * block_size, t)})) was computed for other tokens or media "
                f"({theirs} != {ours})"
            )
    return Admission(min(t, n - 1), mine)


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
