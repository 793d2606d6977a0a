"""The ``requires_kv`` handoff's pure checks (:mod:`omni_ar.multimodal.handoff`), each at
its limit and one past it, on hand-made contracts and numpy KV: no model, no pipeline
(well under a second: the fast test set of ``hatch run mutate ar.mm_handoff``)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
from omni_ar.handoff import MMHandoff, MMItem, MRope
from omni_ar.multimodal.handoff import (
    Admission,
    AdmissionError,
    PrefixCache,
    admit,
    admit_paged,
    block_hashes,
    check_block_hashes,
    check_block_size,
    check_covers,
    check_handoff_model,
    check_kv_coverage,
    check_mrope,
    check_no_media_arrays,
    check_requires_kv,
    check_spans,
    read_contract,
)

P = 9  # the placeholder token id
BS = 4  # tokens per KV block
SHAPE = (2, 1, 3)  # the model's (layers, kv heads, head dim)


def item(offset: int, length: int, hash: str = "img") -> MMItem:
    return {"hash": hash, "offset": offset, "length": length}


def prompt(n: int, *items: MMItem) -> list[int]:
    """``n`` text ids (100, 101, ...) with the items' spans made placeholders."""
    ids = [100 + i for i in range(n)]
    for it in items:
        ids[it["offset"] : it["offset"] + it["length"]] = [P] * it["length"]
    return ids


def contract(
    ids: list[int], items: list[MMItem], t: int | None = None, **fields: Any
) -> dict[str, Any]:
    """A contract as prefill sends it, its block names those of the first ``t`` positions."""
    sent = {
        "requires_kv": True,
        "prompt_token_ids": ids,
        "block_size": BS,
        "mm_items": items,
        "kv_block_hashes": block_hashes(ids, items, BS, len(ids) if t is None else t),
    }
    return sent | fields


def handoff(ids: list[int], items: list[MMItem], **fields: Any) -> MMHandoff:
    return msgspec.convert(contract(ids, items, **fields), MMHandoff)


def kv(t: int, shape: tuple[int, int, int] = SHAPE) -> dict[str, np.ndarray]:
    """KV arrays of ``t`` positions, ``(layers, kv heads, t, head dim)``, distinct values."""
    layers, heads, dim = shape
    keys = np.arange(layers * heads * t * dim, dtype=np.float32).reshape(layers, heads, t, dim)
    return {"keys": keys, "values": -keys}


def rejects(match: str) -> Any:
    return pytest.raises(AdmissionError, match=match)


# -- block names ---------------------------------------------------------------------


def chain(blocks: list[tuple[list[int], list[str]]]) -> list[str]:
    """The names the module's rule gives: each block's ids (int64, little-endian) and
    ``|hash`` of each item it overlaps, chained through the previous block's digest."""
    out, parent = [], b""
    for ids, hashes in blocks:
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(np.asarray(ids, dtype="<i8").tobytes())
        for name in hashes:
            h.update(b"|" + name.encode())
        parent = h.digest()
        out.append(h.hexdigest())
    return out


def test_block_names_cover_exactly_the_blocks_each_item_overlaps() -> None:
    """An item of [4, 8) with blocks of 4 names block 1 only: not block 0, which ends at
    its offset, nor block 2, which starts at its end; the last block is partial."""
    ids = list(range(10))
    a, b = item(4, 4, "a"), item(3, 1, "b")
    got = block_hashes(ids, [a, b], BS)
    assert got == chain([([0, 1, 2, 3], ["b"]), ([4, 5, 6, 7], ["a"]), ([8, 9], [])])
    assert all(len(name) == 32 for name in got)


def test_block_names_of_a_prefix_and_their_chaining() -> None:
    ids = list(range(10))
    full = block_hashes(ids, [], BS)
    assert block_hashes(ids, [], BS, None) == full
    assert len(full) == 3
    assert block_hashes(ids, [], BS, 8) == full[:2]  # a prefix of whole blocks
    five = block_hashes(ids, [], BS, 5)  # block 1 partial: ids[4:5] only
    assert five == chain([([0, 1, 2, 3], []), ([4], [])])
    assert block_hashes(ids, [], BS, 0) == []
    # a change in block 0 renames every block after it; one in block 1 leaves block 0
    assert block_hashes([99, *ids[1:]], [], BS)[2] != full[2]
    other = block_hashes([*ids[:5], 99, *ids[6:]], [], BS)
    assert other[0] == full[0] and other[1] != full[1]


# -- the contract --------------------------------------------------------------------


def test_read_contract() -> None:
    ids = prompt(6, item(1, 2))
    sent = contract(ids, [item(1, 2)])
    assert read_contract(sent) == msgspec.convert(sent, MMHandoff)
    with rejects("prefill sent no handoff"):
        read_contract(None)
    with rejects(r"^mm item 1: carries a media payload \(data, pixels\)"):
        read_contract(contract(ids, [item(1, 2), {**item(1, 2), "pixels": 1, "data": 2}]))
    with rejects(r"^mm item 0: carries a media payload \(url\)"):  # the first named
        read_contract(contract(ids, [{**item(1, 2), "url": 1}, {**item(1, 2), "data": 2}]))
    with rejects(r"^handoff: .*block_size"):
        read_contract(contract(ids, [], block_size="4"))
    with rejects("'prompt_token_ids' is missing or empty"):
        read_contract(contract([], []))


def test_media_items_need_requires_kv() -> None:
    ids = prompt(6, item(1, 2))
    with rejects(r"the request has 1 media item\(s\) but requires_kv is not set"):
        check_requires_kv(handoff(ids, [item(1, 2)], requires_kv=False))
    check_requires_kv(handoff(ids, [item(1, 2)]))
    check_requires_kv(handoff([1, 2], [], requires_kv=False))  # text only: nothing to encode


@pytest.mark.parametrize("size", [BS - 1, BS + 1])
def test_block_size_must_match(size: int) -> None:
    h = handoff([1, 2, 3], [])
    check_block_size(h, BS)
    with rejects(f"prefill named blocks of {BS} tokens, this decode stage uses {size}"):
        check_block_size(h, size)


def test_only_the_kv_arrives() -> None:
    check_no_media_arrays(kv(2))
    with rejects(r"arrays \['pixel_values'\] arrived"):
        check_no_media_arrays({**kv(2), "pixel_values": np.zeros(1)})


# -- placeholder spans ---------------------------------------------------------------


def test_spans_return_the_end_of_the_furthest_item() -> None:
    a, b = item(5, 3, "a"), item(1, 2, "b")  # the furthest first
    assert check_spans(handoff(prompt(10, a, b), [a, b]), P) == 8
    assert check_spans(handoff([1, 2, 3], []), P) == 0


@pytest.mark.parametrize(
    ("span", "error"),
    [
        ((0, 1), None),  # the first position, one token: the smallest span
        ((-1, 2), r"mm item 0: invalid placeholder span -1\+2"),
        ((2, 0), r"invalid placeholder span 2\+0"),
        ((3, 6), None),  # ends at 9: the final token (position 9) is text
        ((3, 7), r"span \[3, 10\) reaches the final prompt token \(position 9\)"),
        ((3, 8), r"span \[3, 11\) lies outside the prompt of 10 tokens"),
    ],
)
def test_span_limits(span: tuple[int, int], error: str | None) -> None:
    it = item(*span)
    ids = prompt(10, it) if error is None else list(range(10, 20))
    h = handoff(ids, [it])
    if error is None:
        assert check_spans(h, P) == span[0] + span[1]
    else:
        with rejects(error):
            check_spans(h, P)


def test_spans_need_a_hash() -> None:
    a, b = item(1, 1), item(3, 1, "")
    with rejects("^mm item 1: empty hash"):
        check_spans(handoff(prompt(6, a, b), [a, b]), P)


@pytest.mark.parametrize("stray", [0, 4])
def test_a_placeholder_outside_every_span_is_refused(stray: int) -> None:
    """Just before the span and just past its end; the first stray one is named."""
    it = item(1, 3)
    ids = prompt(8, it)
    ids[stray] = ids[6] = P
    with rejects(f"prompt position {stray} holds a placeholder token outside"):
        check_spans(handoff(ids, [it]), P)


# -- M-RoPE position fields ----------------------------------------------------------


def mrope(delta: int, *grids: list[int]) -> dict[str, Any]:
    return {"position_delta": delta, "grids": list(grids)}


def test_mrope_fields_present_exactly_on_mrope_models() -> None:
    it = item(1, 4)
    ids = prompt(8, it)
    check_mrope(handoff(ids, [it]), None)
    with rejects("this decode's model has no M-RoPE"):
        check_mrope(handoff(ids, [it], mrope=mrope(-2, [1, 4, 4])), None)
    with rejects("^mrope: missing"):
        check_mrope(handoff(ids, [it]), 2)


def test_mrope_fields_that_fit_the_spans() -> None:
    """One (1, 4, 4) grid at merge 2 makes 4 placeholders and moves positions on by 2,
    not 4; two items' deltas add up; a (1, 2, 2) grid is the smallest image."""
    a, b = item(1, 4), item(6, 1, "b")
    ids = prompt(9, a, b)
    check_mrope(handoff(ids, [a, b], mrope=mrope(-2 + 0, [1, 4, 4], [1, 2, 2])), 2)
    check_mrope(handoff(prompt(6, item(2, 1)), [item(2, 1)], mrope=mrope(0, [1, 1, 1])), 1)


@pytest.mark.parametrize(
    ("grid", "error"),
    [
        ([1, 4], "is not an image's"),
        ([1, 4, 4, 1], "is not an image's"),
        ([2, 4, 2], "is not an image's"),  # two frames: a video
        ([0, 4, 4], "is not an image's"),
        ([1, 0, 4], "is not an image's"),
        ([1, 4, 0], "is not an image's"),
        ([1, 3, 4], "is not an image's"),  # h not a multiple of the merge
        ([1, 4, 3], "is not an image's"),
        ([1, 2, 4], r"grid \(1, 2, 4\) makes 2 placeholders; mm item 0's span has 4"),
        ([1, 4, 6], r"grid \(1, 4, 6\) makes 6 placeholders"),
    ],
)
def test_mrope_grid_limits(grid: list[int], error: str) -> None:
    it = item(1, 4)
    h = handoff(prompt(8, it), [it], mrope=mrope(-2, grid))
    with rejects(rf"^mrope.grids\[0\]: .*{error}"):
        check_mrope(h, 2)


def test_mrope_one_grid_per_item_and_the_delta_they_give() -> None:
    it = item(1, 4)
    ids = prompt(8, it)
    with rejects(r"mrope.grids: 2 grids for 1 mm items"):
        check_mrope(handoff(ids, [it], mrope=mrope(-2, [1, 4, 4], [1, 4, 4])), 2)
    with rejects(r"mrope.grids: 0 grids for 1 mm items"):
        check_mrope(handoff(ids, [it], mrope=mrope(-2)), 2)
    for delta in (-3, -1):
        with rejects(rf"prefill sent {delta}; mrope.grids \[\[1, 4, 4\]\] give -2"):
            check_mrope(handoff(ids, [it], mrope=mrope(delta, [1, 4, 4])), 2)


# -- KV coverage ---------------------------------------------------------------------


def test_kv_must_arrive() -> None:
    h = handoff(prompt(8, item(1, 4)), [item(1, 4)])
    for arrays in ({}, {"keys": kv(5)["keys"]}, {"values": kv(5)["values"]}):
        with rejects(r"no KV arrived .* positions \[0, 5\) hold placeholders"):
            check_kv_coverage(h, arrays, SHAPE, 5)


@pytest.mark.parametrize(
    "arrays",
    [
        {"keys": np.zeros((2, 1, 5)), "values": np.zeros((2, 1, 5))},  # three axes
        {"keys": np.zeros((2, 1, 5, 3, 1)), "values": np.zeros((2, 1, 5, 3, 1))},
        {"keys": np.zeros((2, 1, 5, 3)), "values": np.zeros((2, 1, 6, 3))},
        kv(5, (1, 1, 3)),  # layers
        kv(5, (2, 2, 3)),  # kv heads
        kv(5, (2, 1, 4)),  # head dim
    ],
)
def test_kv_must_fit_the_model(arrays: dict[str, np.ndarray]) -> None:
    h = handoff(prompt(8, item(1, 4)), [item(1, 4)])
    with rejects(r"does not fit this model's \(layers, kv heads, head dim\) = \(2, 1, 3\)"):
        check_kv_coverage(h, arrays, SHAPE, 5)


def test_kv_coverage_limits() -> None:
    """KV of exactly the placeholders' end and of exactly the prompt pass; one less or
    one more fails, the message naming the item that ends last."""
    a, b = item(4, 2, "a"), item(1, 2, "b")
    h = handoff(prompt(8, a, b), [b, a])
    arrays = kv(6)
    assert check_kv_coverage(h, arrays, SHAPE, 6) == (arrays["keys"], arrays["values"])
    check_covers(h, 8, 6)
    with rejects(r"covers 5 prompt positions; mm item 1's placeholders \[4, 6\) need 6"):
        check_covers(h, 5, 6)
    with rejects("KV of 9 positions for a prompt of 8 tokens"):
        check_covers(h, 9, 6)
    with rejects("covers 5 prompt positions"):
        check_kv_coverage(h, kv(5), SHAPE, 6)
    # the item named is the one that ends last, not the one that starts last
    a, b = item(1, 1, "a"), item(3, 4, "b")
    with rejects(r"mm item 1's placeholders \[3, 7\) need 7"):
        check_covers(handoff(prompt(9, a, b), [a, b]), 4, 7)


def test_block_names_must_be_decodes_own() -> None:
    it = item(1, 4)
    ids = prompt(10, it)
    h = handoff(ids, [it], t=6)
    assert check_block_hashes(h, 6) == block_hashes(ids, [it], BS, 6)
    with rejects("named by 2 block hashes but covers 3 blocks"):
        check_block_hashes(h, 9)
    for b in (0, 1):
        names = list(h.kv_block_hashes)
        names[b] = "0" * 32
        bad = msgspec.structs.replace(h, kv_block_hashes=names)
        where = ["[0, 4)", "[4, 6)"][b]  # the last block is partial: it ends at t
        with rejects(re.escape(f"KV block {b} (positions {where}) was computed for other")):
            check_block_hashes(bad, 6)


def test_block_names_of_another_image_are_refused() -> None:
    it = item(1, 4)
    ids = prompt(10, it)
    sent = contract(ids, [item(1, 4, "other")]) | {"mm_items": [it]}
    with rejects("KV block 0 .* was computed for other tokens or media"):
        admit(sent, kv(10), BS, SHAPE, P)


# -- admission, whole ----------------------------------------------------------------


@pytest.mark.parametrize(("t", "used"), [(5, 5), (8, 8), (9, 9), (10, 9)])
def test_admit_uses_the_kv_up_to_the_final_token(t: int, used: int) -> None:
    """Decode recomputes the final prompt token, so KV of the whole prompt is used but
    for its last position."""
    it = item(1, 4)
    ids = prompt(10, it)
    arrays = kv(t)
    adm = admit(contract(ids, [it], t=t), arrays, BS, SHAPE, P)
    with pytest.raises(dataclasses.FrozenInstanceError):
        adm.kv_tokens = 0  # type: ignore[misc]
    assert adm == Admission(
        read_contract(contract(ids, [it], t=t)),
        (arrays["keys"], arrays["values"]),
        used,
        block_hashes(ids, [it], BS, t),
    )


def test_admit_runs_every_check_in_order() -> None:
    it = item(1, 4)
    ids = prompt(8, it)
    good = contract(ids, [it])
    with rejects("^handoff: prefill sent no handoff"):
        admit(None, kv(8), BS, SHAPE, P)
    with rejects("^requires_kv:"):
        admit(good | {"requires_kv": False}, kv(8), BS, SHAPE, P)
    with rejects("^block size:"):
        admit(good, kv(8), BS + 1, SHAPE, P)
    with rejects("^media payload:"):
        admit(good, {**kv(8), "image": np.zeros(1)}, BS, SHAPE, P)
    with rejects("^placeholders:"):
        admit(good, kv(8), BS, SHAPE, ids[0])
    with rejects("^mrope: missing"):
        admit(good, kv(8), BS, SHAPE, P, mrope_merge=2)
    with rejects("^kv coverage:"):
        admit(good, kv(8, (1, 1, 3)), BS, SHAPE, P)
    with rejects("^block hashes:"):
        admit(good, kv(7), BS, SHAPE, P)
    adm = admit(good | {"mrope": mrope(-2, [1, 4, 4])}, kv(8), BS, SHAPE, P, mrope_merge=2)
    assert adm.handoff.mrope == MRope(position_delta=-2, grids=[[1, 4, 4]])


# -- paged admission (vLLM) ----------------------------------------------------------


def paged(blocks: int, extra: tuple[int, ...] = (BS, 1, 3)) -> dict[str, np.ndarray]:
    keys = np.zeros((2, blocks, *extra), dtype=np.float32)
    return {"keys": keys, "values": keys + 1}


def paged_contract(ids: list[int], items: list[MMItem], blocks: int) -> dict[str, Any]:
    return contract(ids, items) | {"kv_block_hashes": [f"h{b}" for b in range(blocks)]}


@pytest.mark.parametrize(("n", "blocks", "used"), [(10, 2, 8), (10, 3, 10), (8, 2, 8), (9, 3, 9)])
def test_admit_paged_at_its_limits(n: int, blocks: int, used: int) -> None:
    it = item(1, 4)
    ids = prompt(n, it)
    arrays = paged(blocks)
    adm = admit_paged(paged_contract(ids, [it], blocks), arrays, BS, P)
    assert adm.kv == (arrays["keys"], arrays["values"])
    assert adm.kv_tokens == used
    assert adm.block_hashes == [f"h{b}" for b in range(blocks)]


def test_admit_paged_refusals() -> None:
    it = item(1, 4)
    ids = prompt(10, it)
    admit_paged(paged_contract(ids, [it], 2), paged(2, (3,)), BS, P)  # three axes: enough
    with rejects("is not \\(layers, blocks, ...\\) blocks"):
        admit_paged(paged_contract(ids, [it], 2), paged(2, ()), BS, P)
    with rejects("is not \\(layers, blocks, ...\\) blocks"):
        admit_paged(paged_contract(ids, [it], 2), paged(2) | {"values": paged(3)["keys"]}, BS, P)
    with rejects(r"covers 4 prompt positions; mm item 0's placeholders \[1, 5\) need 5"):
        admit_paged(paged_contract(ids, [it], 1), paged(1), BS, P)
    with rejects(r"4 KV blocks for a prompt of 10 tokens \(3 blocks of 4\)"):
        admit_paged(paged_contract(ids, [it], 4), paged(4), BS, P)
    whole = prompt(8, it)  # a prompt of whole blocks: one block more is one too many
    with rejects(r"3 KV blocks for a prompt of 8 tokens \(2 blocks of 4\)"):
        admit_paged(paged_contract(whole, [it], 3), paged(3), BS, P)
    with rejects(r"named by 3 block hashes but holds 2 blocks"):
        admit_paged(paged_contract(ids, [it], 3), paged(2), BS, P)
    with rejects(r"named by 1 block hashes but holds 2 blocks"):
        admit_paged(paged_contract(ids, [it], 1), paged(2), BS, P)
    with rejects("no KV arrived"):
        admit_paged(paged_contract(ids, [it], 2), {}, BS, P)
    with rejects("^mrope: missing"):
        admit_paged(paged_contract(ids, [it], 2), paged(2), BS, P, mrope_merge=2)
    with rejects("^placeholders:"):
        admit_paged(paged_contract(ids, [it], 2), paged(2), BS, ids[0])
    with rejects("^media payload:"):
        admit_paged(paged_contract(ids, [it], 2), paged(2) | {"x": np.zeros(1)}, BS, P)
    with rejects("^block size:"):
        admit_paged(paged_contract(ids, [it], 2), paged(2), BS - 1, P)
    with rejects("^requires_kv:"):
        admit_paged(paged_contract(ids, [it], 2) | {"requires_kv": False}, paged(2), BS, P)
    with rejects("^handoff:"):
        admit_paged(None, paged(2), BS, P)


# -- models that cannot hand their KV on ---------------------------------------------


class Config(SimpleNamespace):
    """A stand-in for a ``transformers`` config: attributes, and a text config."""

    def get_text_config(self) -> Any:
        return getattr(self, "text", self)


def test_models_that_can_hand_their_kv_on() -> None:
    check_handoff_model(Config(model_type="llava", architectures=["LlavaForConditionalGeneration"]))
    check_handoff_model(Config(model_type="llava", architectures=None))
    check_handoff_model(Config(model_type="x", architectures=[None, 3]))
    qwen = Config(model_type="qwen2_vl", rope_scaling={"mrope_section": [1, 2, 2]})
    check_handoff_model(qwen)


@pytest.mark.parametrize(
    ("config", "error"),
    [
        (Config(model_type="glm4v", rope_scaling={"mrope_section": [1]}), "uses M-RoPE"),
        (Config(model_type="t5", is_encoder_decoder=True), "is an encoder-decoder model"),
        (
            Config(model_type="w", text=Config(is_encoder_decoder=True)),
            "is an encoder-decoder model",
        ),
        (Config(model_type="mllama", cross_attention_layers=[3]), "cross-attends to the image"),
        (
            Config(model_type="mllama", text=Config(cross_attention_layers=[3])),
            "cross-attends to the image",
        ),
        (
            Config(model_type="q", architectures=["Foo", "QwenForRewardModeling"]),
            "'QwenForRewardModeling' pools",
        ),
    ],
)
def test_models_that_cannot(config: Config, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        check_handoff_model(config)


def test_no_cross_attention_layers_is_fine() -> None:
    check_handoff_model(Config(model_type="m", cross_attention_layers=[], is_encoder_decoder=False))


# -- the prefix cache ----------------------------------------------------------------


def blocks_kv(n_blocks: int, size: int = 2) -> tuple[np.ndarray, np.ndarray]:
    arrays = kv(n_blocks * size)
    return arrays["keys"], arrays["values"]


def test_prefix_cache_stores_full_blocks_and_serves_them_joined() -> None:
    keys, values = blocks_kv(3)
    cache = PrefixCache(8)
    cache.put(["a", "b", "c"], keys, values, 2)
    assert cache.match(["a", "b", "c", "d"]) == 3
    assert cache.match(["a", "x", "c"]) == 1  # leading blocks only
    assert cache.match(["x", "a"]) == 0
    k, v = cache.get(["b"])
    assert np.array_equal(k, keys[:, :, 2:4]) and np.array_equal(v, values[:, :, 2:4])
    k, v = cache.get(["a", "b", "c"])
    assert np.array_equal(k, keys) and np.array_equal(v, values)
    assert cache.hits == 4
    keys[:] = 0  # the cache holds copies
    assert cache.get(["c"])[0].any()


def test_prefix_cache_a_known_block_is_not_rewritten() -> None:
    keys, values = blocks_kv(2)
    cache = PrefixCache(8)
    cache.put(["a"], keys, values, 2)
    cache.put(["b", "a"], keys, values, 2)  # "a" is now block 1: kept as first stored
    assert np.array_equal(cache.get(["a"])[0], keys[:, :, 0:2])
    assert np.array_equal(cache.get(["b"])[0], keys[:, :, 0:2])
    cache.put(["a", "c"], keys, values, 2)  # the blocks after a known one are stored
    assert np.array_equal(cache.get(["c"])[0], keys[:, :, 2:4])


def test_prefix_cache_capacity_and_lru() -> None:
    keys, values = blocks_kv(3)
    for capacity in (0, -1):
        empty = PrefixCache(capacity)
        empty.put(["a"], keys, values, 2)
        assert empty.blocks == {}
    one = PrefixCache(1)  # the smallest cache holds one block
    one.put(["a"], keys, values, 2)
    assert list(one.blocks) == ["a"]
    cache = PrefixCache(2)  # at capacity, one past it evicts the least recent
    cache.put(["a", "b"], keys, values, 2)
    assert list(cache.blocks) == ["a", "b"]
    cache.get(["a"])  # "a" is now the most recent
    cache.put(["c"], keys, values, 2)
    assert list(cache.blocks) == ["a", "c"]
    cache.put(["a"], keys, values, 2)  # a hit on put refreshes it too
    cache.put(["d"], keys, values, 2)
    assert list(cache.blocks) == ["a", "d"]


def test_prefix_cache_of_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    keys = torch.arange(12, dtype=torch.bfloat16).reshape(1, 1, 4, 3)
    cache = PrefixCache(4)
    cache.put(["a", "b"], keys, -keys, 2)
    keys.zero_()  # cloned
    k, v = cache.get(["a", "b"])
    want = torch.arange(12, dtype=torch.bfloat16).reshape(1, 1, 4, 3)
    assert torch.equal(k, want) and torch.equal(v, -want)
