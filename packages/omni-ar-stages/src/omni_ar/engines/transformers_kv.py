"""The transformers engine's KV as the data plane carries it: one request's cache as
stacked arrays on the CPU, and several requests' KV as one left-padded cache (a batched
decode's rows)."""

from __future__ import annotations

from typing import Any


def left_padded(kv: list[list[tuple[Any, Any]]], device: str) -> tuple[Any, Any, list[int]]:
    """One cache of several requests' KV (each a list per layer of ``(kv_heads, tokens,
    head_dim)`` keys and values), each row left-padded to the longest: the cache, the
    mask of each row's real positions, and each row's length (a batched decode's rows)."""
    import torch
    from transformers import DynamicCache

    lengths = [layers[0][0].shape[1] for layers in kv]
    width = max(lengths, default=0)
    cache = DynamicCache()
    for i in range(len(kv[0]) if kv else 0):
        k0 = kv[0][i][0]
        shape = (len(kv), k0.shape[0], width, k0.shape[2])
        keys, values = k0.new_zeros(shape), k0.new_zeros(shape)
        for row, (layers, n) in enumerate(zip(kv, lengths, strict=True)):
            keys[row, :, width - n :] = layers[i][0]
            values[row, :, width - n :] = layers[i][1]
        cache.update(keys, values, i)
    mask = torch.zeros((len(kv), width), dtype=torch.long, device=device)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return cache, mask, lengths


def kv_arrays(cache: Any, row: int = 0, start: int = 0) -> tuple[Any, Any]:
    """One row of a cache as stacked ``(layers, kv_heads, tokens, head_dim)`` arrays on
    the CPU (see :func:`to_host`), its positions from ``start`` on (past a left padding)."""
    import torch

    keys = torch.stack([layer.keys[row, :, start:] for layer in cache.layers])
    values = torch.stack([layer.values[row, :, start:] for layer in cache.layers])
    return to_host(keys), to_host(values)


def to_host(t: Any) -> Any:
    """A tensor as an array for the data plane: copied to the CPU once (no copy there
    already), a numpy array where numpy has its dtype (float32, float16), else a CPU
    torch tensor (bfloat16, which the data plane carries as it is)."""
    import torch

    t = t.detach().to("cpu")
    return t if t.dtype == torch.bfloat16 else t.numpy()


def cache_of(out: Any) -> Any:
    """The cache a forward returned (transformers 5.x renamed `past_key_values`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
