"""What prefill gives decode: one :class:`Handoff` per request, the payload of prefill's
one segment, and the prompt's KV beside it in that segment's arrays (``keys``/``values``,
which cross through the shared-memory data plane). Every stage that writes or reads a
handoff does it through this module.

The text stages (``ar.prefill`` -> ``ar.decode``) send the request's params, the prompt's
ids, and either the first token with the KV and the first token's alternatives, or, for
a prompt decode prefills itself (``local_prefill``), the prompt alone. The multimodal
stages (``ar.mm_prefill`` -> ``ar.mm_decode``) send the params and the ``requires_kv``
contract (:class:`MMHandoff`, under the payload's ``handoff``), which decode admits
(:func:`omni_ar.multimodal.handoff.admit`) before it continues from the KV.
"""

from __future__ import annotations

from typing import Any, TypedDict

import msgspec
from omni_core.plugin import Segment, StageInput, Window

from omni_ar.errors import HandoffError
from omni_ar.params import SamplingParams

KEYS, VALUES = "keys", "values"  # the segment's arrays: the prompt's KV
MM = "handoff"  # the payload's entry holding the multimodal contract


class MMItem(TypedDict):
    """A media item of a ``requires_kv`` request: its content hash and the span of its
    placeholder tokens in the prompt (nothing of the media itself)."""

    hash: str
    offset: int
    length: int


class MRope(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a decode without the media needs to go on placing tokens on an M-RoPE model
    (Qwen2-VL and its kin), whose positions are (time, height, width) and advance over
    an image by its grid, not its length (see :mod:`omni_ar.multimodal.mrope`)."""

    # the position of the token after the prompt minus the prompt's length (transformers'
    # ``rope_deltas``): every text token after the last image sits at its index + this
    position_delta: int
    # each media item's (t, h, w) patch grid (``image_grid_thw``), in ``mm_items`` order
    grids: list[list[int]]


class MMHandoff(msgspec.Struct, kw_only=True):
    """The ``requires_kv`` contract: the prompt, its media items, and the names of the KV
    blocks prefill computed (see :mod:`omni_ar.multimodal.handoff`)."""

    requires_kv: bool  # decode must continue from the KV: it has no vision encoder
    prompt_token_ids: list[int]
    block_size: int  # tokens per KV block
    mm_items: list[MMItem]
    kv_block_hashes: list[str]  # the chained hash of each KV block, in order
    mrope: MRope | None = None  # M-RoPE models' position fields; None on the others

    @staticmethod
    def as_sent(window: Window) -> dict[str, Any] | None:
        """The contract as it arrived, unchecked (admission checks it), or None."""
        return window.payloads[0].get(MM) if window.payloads else None

    @staticmethod
    def item_extras(sent: dict[str, Any]) -> list[tuple[int, list[str]]]:
        """The items of ``sent`` that carry more than an :class:`MMItem` (media): each
        one's index and its other keys."""
        items = sent.get("mm_items") or []
        extras = [sorted(set(it) - set(MMItem.__annotations__)) for it in items]
        return [(i, extra) for i, extra in enumerate(extras) if extra]

    @staticmethod
    def rerendered(
        sent: dict[str, Any], ids: list[int], items: list[MMItem], mrope: MRope | None = None
    ) -> dict[str, Any]:
        """``sent`` with the prompt, items and (M-RoPE) positions a decode rendered from
        the media itself."""
        out = {**sent, "prompt_token_ids": ids, "mm_items": items}
        if mrope is not None:
            out["mrope"] = msgspec.to_builtins(mrope)
        return out


class Handoff(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Everything prefill gives decode for one request, but the KV arrays."""

    params: SamplingParams  # the request's, parsed at intake
    prompt_ids: list[int] = msgspec.field(default_factory=list)
    prompt_tokens: int = 0  # the prompt's length, for usage counts downstream
    # no first token and no KV: decode prefills the prompt itself
    local_prefill: bool = False
    # the first token's alternatives as [id, logprob] (one list: the one token's)
    top_ids: list[list[list[Any]]] = msgspec.field(default_factory=list)
    # prompt_logprobs asked for: stages.logprobs.prompt_ids_payload of the prompt
    prompt_logprob_ids: dict[str, Any] | None = None
    mm: MMHandoff | None = msgspec.field(default=None, name=MM)  # the multimodal contract
    cached_tokens: int | None = None  # multimodal: prompt tokens from the prefix cache

    def segment(
        self,
        inp: StageInput,
        tokens: list[int] | None = None,
        logprobs: list[float] | None = None,
        kv: tuple[Any, Any] | None = None,
    ) -> Segment:
        """Prefill's one (and last) segment for ``inp``: this handoff as its payload,
        the first token (if any) and the KV (if any) as its arrays."""
        return inp.segment(
            tokens,
            logprobs=logprobs,
            arrays={KEYS: kv[0], VALUES: kv[1]} if kv is not None else None,
            payload=msgspec.to_builtins(self),
            is_last=True,
        )

    @classmethod
    def read(cls, window: Window) -> Handoff:
        """The handoff of prefill's segment in ``window``; :class:`HandoffError` where it
        is malformed."""
        try:
            return msgspec.convert(window.payloads[0], cls)
        except msgspec.ValidationError as e:
            raise HandoffError(f"handoff from {window.edge}: {e}") from None

    @property
    def first_top(self) -> list[tuple[int, float]]:
        """The first token's alternatives, as an engine gives them."""
        return [(t, lp) for t, lp in self.top_ids[0]] if self.top_ids else []


def kv_of_arrays(arrays: dict[str, Any]) -> tuple[Any, Any] | None:
    """The prompt's (keys, values) in a window's arrays, None where either is missing."""
    keys, values = arrays.get(KEYS), arrays.get(VALUES)
    return None if keys is None or values is None else (keys, values)


def media_arrays(arrays: dict[str, Any]) -> list[str]:
    """The names of a window's arrays beside the KV (a ``requires_kv`` handoff has none)."""
    return sorted(set(arrays) - {KEYS, VALUES})
