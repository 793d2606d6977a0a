"""A vLLM KV connector that hands a prompt's KV to the stage itself, as tensors.

vLLM runs in-process in the stage worker (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its
scheduler-side and worker-side connector objects share the process with the stage. The
connector moves KV between vLLM's paged cache and two process-wide mailboxes keyed by a
handoff key (the request's ``kv_transfer_params["omni_kv"]``):

* producer (prefill): in the step that computes a request's last prompt token,
  ``save_kv_layer`` gathers each layer's blocks holding the prompt straight into one
  ``keys`` and one ``values`` buffer per request, ``(layers, blocks, ...)``, in
  ``OUTBOX[key]`` (one copy; no per-layer tensors to stack afterwards); the engine hands
  them to the Prefill stage as numpy arrays (torch tensors for dtypes numpy lacks), which
  cross to decode through the runtime's shared-memory data plane: one copy into the slot.
* consumer (decode): the engine puts the received arrays into ``INBOX[key]`` and adds the
  request (prompt + first token); the scheduler asks how many of its tokens are cached
  externally (the whole prompt, partial last block included), and ``start_load_kv``
  writes the blocks into the request's own before the forward pass that computes the
  first token. A numpy array is the data plane's read-only view of the slot (a torch
  tensor would be copied out of it first), so the blocks go from the slot into the paged
  cache in one copy; the slot is held until the request ends. Nothing touches a file or
  a socket, and decode computes only the first token's position.

Blocks move whole, in vLLM's own layout: the CPU attention kernels pack a block's keys in
an ISA-specific order, so single tokens cannot be picked out, but a copied block is
valid, and the slots past the prompt in its last block are overwritten by the decode
engine's own tokens before anything reads them. Both engines need the same block size.
Everything is synchronous: KV is copied inside the step that computes or needs it, so
blocks are freed as usual when a request finishes.

Devices: saved blocks are copied to the CPU (the data plane carries host memory); loaded
blocks are copied to the paged cache's device and dtype (a GPU's, or the CPU's).

Multimodal prompts (``ar.mm_*`` on ``engine: vllm``): the producer also records what vLLM
rendered of a prompt flagged :data:`RECORD` (:data:`RENDERED`: prompt ids, each item's identifier,
placeholder span and, on M-RoPE models, patch grid, and the name of every block of the
prompt, :func:`prompt_block_hashes`), and a consumer handed those names loads only the leading
blocks whose names its own request gives too: KV computed for other tokens or other
media is never loaded, and the ``requires_kv`` plugin
(:mod:`omni_ar.engines.vllm_requires_kv`) ends the request when what loads stops short
of its placeholders.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

from omni_ar.engines.vllm_requires_kv import CONNECTOR_NOTES, remember

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

PARAM = "omni_kv"  # the kv_transfer_params entry naming a request's handoff key
RECORD = "omni_record"  # ... asking a producer to record the prompt as rendered (RENDERED)


class Received(NamedTuple):
    """KV handed to a consumer: ``keys``/``values`` (layers, blocks, ...) of the first
    ``tokens`` prompt positions; ``block_hashes``: the producer's names of those blocks
    (:func:`prompt_block_hashes`), checked before loading, or None (text: not checked)."""

    keys: Any
    values: Any
    tokens: int
    block_hashes: list[str] | None = None


class Rendered(NamedTuple):
    """A multimodal prompt as the producer's vLLM rendered it."""

    prompt_token_ids: list[int]
    items: list[tuple[str, int, int]]  # per media item: identifier, offset, length
    block_hashes: list[str]  # every block of the prompt, the last one possibly partial
    grids: list[list[int] | None]  # per media item: its (t, h, w) patch grid (M-RoPE), or None


# handoff key -> (keys, values), each (layers, blocks, ...) in vLLM's layout, host memory
OUTBOX: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
# handoff key -> a flagged (multimodal) request's prompt, recorded by the producer
RENDERED: dict[str, Rendered] = {}
# handoff key -> the KV a consumer's request starts from
INBOX: dict[str, Received] = {}


@dataclass
class _Transfer:
    key: str
    block_ids: list[int]
    start: int  # first token to move
    stop: int  # one past the last


@dataclass
class _Meta(KVConnectorMetadata):
    saves: list[_Transfer] = field(default_factory=list)
    loads: list[_Transfer] = field(default_factory=list)


def _key(request: Request) -> str | None:
    params = request.kv_transfer_params or {}
    return params.get(PARAM)


def prompt_block_hashes(request: Request, n: int, block_size: int, hash_fn: Any) -> list[str]:
    """vLLM's names (hex) of the blocks holding the request's first ``n`` tokens, the
    last one possibly partial: each chained over its token ids and the identifier and
    offset of every media item it overlaps (vLLM's own prefix-cache hashing, which
    names only full blocks)."""
    out: list[str] = []
    parent = None
    mm_index = 0
    tokens = request.all_token_ids
    for start in range(0, n, block_size):
        end = min(start + block_size, n)
        extra, mm_index = generate_block_hash_extra_keys(request, start, end, mm_index)
        parent = hash_block_tokens(hash_fn, parent, tokens[start:end], extra)
        out.append(parent.hex())
    return out


def kv_views(kv_layer: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) views of one layer's paged cache, blocks first.

    The CPU attention backend keeps a layer as ``(blocks, kv_heads, block_size,
    2 * head_dim)`` memory holding, per block and head, the block's keys and then its
    values; GPU backends use ``(2, blocks, block_size, kv_heads, head_dim)``.
    """
    if kv_layer.dim() == 4 and kv_layer.shape[2] == block_size:
        b, h, n, c = kv_layer.shape
        kv = kv_layer.view(b, h, 2, n, c // 2)
        return kv[:, :, 0], kv[:, :, 1]
    if kv_layer.dim() == 5 and kv_layer.shape[0] == 2 and kv_layer.shape[2] == block_size:
        return kv_layer[0], kv_layer[1]
    raise RuntimeError(
        f"data-plane KV connector: unknown paged KV layout {tuple(kv_layer.shape)} "
        f"(block size {block_size}); use kv_connector: file"
    )


def _grid(feature: Any) -> list[int] | None:
    """A media item's patch grid as vLLM's processor made it (``image_grid_thw``, which
    M-RoPE models place the item by), or None."""
    elem = (feature.data or {}).get(f"{feature.modality}_grid_thw")
    return None if elem is None else [int(x) for x in elem.data.tolist()]


class DataPlaneConnector(KVConnectorBase_V1):
    """Prompt KV in and out of vLLM's paged cache through :data:`OUTBOX` / :data:`INBOX`."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self._hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        # scheduler side: loads to plan, and producer requests until their prompt is done
        self._loads: dict[str, tuple[str, int]] = {}  # id -> (key, external tokens)
        self._saving: dict[str, tuple[str, list[int], int]] = {}  # id -> (key, blocks, n)

    # -- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        key = _key(request)
        if key is None or key not in INBOX:
            return 0, False
        received = INBOX[key]
        # the last token is always computed here: its logits give the next token; no
        # more positions than the blocks received hold
        blocks = received.keys.shape[1] if getattr(received.keys, "ndim", 0) > 1 else 0
        usable = min(received.tokens, blocks * self.block_size, request.num_tokens - 1)
        if received.block_hashes is not None:
            usable = min(usable, self._matching(key, request, usable, received.block_hashes))
        return max(0, usable - num_computed_tokens), False

    def _matching(self, key: str, request: Request, n: int, theirs: list[str]) -> int:
        """How many of the first ``n`` positions lie in leading blocks whose producer's
        names are this request's own; a mismatch is noted for the plugin's error."""
        mine = prompt_block_hashes(request, n, self.block_size, self._hash_fn)
        for b, ours in enumerate(mine):
            if b >= len(theirs) or theirs[b] != ours:
                start, stop = b * self.block_size, min((b + 1) * self.block_size, n)
                remember(
                    CONNECTOR_NOTES,
                    key,
                    f"KV block {b} (positions [{start}, {stop})) was computed for other "
                    "tokens or media: its block hash differs, so only the blocks before it "
                    "were loaded",
                )
                return start
        return n

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        key = _key(request)
        if num_external_tokens > 0 and key is not None:
            self._loads[request.request_id] = (key, num_external_tokens)
        if (
            key is not None
            and self._kv_transfer_config.is_kv_producer
            and (request.kv_transfer_params or {}).get(RECORD)
            and key not in RENDERED
        ):
            ids = list(request.prompt_token_ids or [])
            RENDERED[key] = Rendered(
                ids,
                [
                    (f.identifier, f.mm_position.offset, f.mm_position.length)
                    for f in request.mm_features
                ],
                prompt_block_hashes(request, len(ids), self.block_size, self._hash_fn),
                [_grid(f) for f in request.mm_features],
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = _Meta()
        for req in scheduler_output.scheduled_new_reqs:
            block_ids = list(req.block_ids[0])
            load = self._loads.pop(req.req_id, None)
            if load is not None:  # the external tokens end where the computed ones do
                key, n = load
                stop = req.num_computed_tokens
                start = stop - n  # block-aligned: a local prefix-cache hit is whole blocks
                meta.loads.append(
                    _Transfer(key, block_ids[start // self.block_size :], start, stop)
                )
            params = req.sampling_params.extra_args if req.sampling_params else None
            key = ((params or {}).get("kv_transfer_params") or {}).get(PARAM)
            if key is not None and self._kv_transfer_config.is_kv_producer:
                n = len(req.prompt_token_ids or [])
                self._saving[req.req_id] = (key, block_ids, n)
                self._maybe_save(meta, req.req_id, req.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._saving:
                continue
            new = cached.new_block_ids[i]
            if new is not None:
                key, blocks, n = self._saving[rid]
                self._saving[rid] = (key, blocks + list(new[0]), n)
            self._maybe_save(meta, rid, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _maybe_save(self, meta: _Meta, rid: str, computed: int, out: SchedulerOutput) -> None:
        """Save the prompt's KV in the step that computes its last token."""
        key, blocks, n = self._saving[rid]
        if computed + out.num_scheduled_tokens.get(rid, 0) >= n:
            del self._saving[rid]
            meta.saves.append(_Transfer(key, blocks[: -(-n // self.block_size)], 0, n))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._loads.pop(request.request_id, None)
        self._saving.pop(request.request_id, None)
        return False, None

    # -- worker side --------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        for t in meta.loads:
            keys, values = INBOX.pop(t.key)[:2]
            first = t.start // self.block_size
            count = -(-t.stop // self.block_size) - first
            dst = torch.tensor(t.block_ids[:count])
            for name, layer in forward_context.no_compile_layers.items():
                cache = getattr(layer, "kv_cache", None)
                if not isinstance(cache, torch.Tensor) or cache.numel() == 0:
                    continue
                i = extract_layer_index(name)
                k_dst, v_dst = kv_views(cache, self.block_size)
                k_src, v_src = keys[i][first : first + count], values[i][first : first + count]
                if tuple(k_src.shape[1:]) != tuple(k_dst.shape[1:]):
                    raise RuntimeError(
                        f"data-plane KV connector: received blocks {tuple(k_src.shape[1:])}, "
                        f"this engine's are {tuple(k_dst.shape[1:])} (same block size and "
                        "model on both sides?)"
                    )
                idx = dst.to(cache.device)
                # one copy, from the slot into the paged blocks (a device/dtype change first)
                k_dst[idx] = _as(k_src, cache)
                v_dst[idx] = _as(v_src, cache)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        if not meta.saves:
            return
        k_src, v_src = kv_views(kv_layer, self.block_size)
        i = extract_layer_index(layer_name)
        for t in meta.saves:
            bufs = OUTBOX.get(t.key)
            if bufs is None:  # the step's first layer: room for every layer's blocks
                shape = (_num_layers(), len(t.block_ids), *k_src.shape[1:])
                bufs = OUTBOX[t.key] = (
                    torch.empty(shape, dtype=k_src.dtype),
                    torch.empty(shape, dtype=v_src.dtype),
                )
            blocks = torch.tensor(t.block_ids, device=kv_layer.device)
            _gather(k_src, blocks, bufs[0][i])
            _gather(v_src, blocks, bufs[1][i])

    def wait_for_save(self) -> None:
        return


def _num_layers() -> int:
    """Layers with a KV cache in the model being run (the step's forward context): the
    producer's buffers hold one slice per layer."""
    from vllm.forward_context import get_forward_context

    layers = get_forward_context().no_compile_layers
    return 1 + max(
        extract_layer_index(name)
        for name, layer in layers.items()
        if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)
    )


def _gather(src: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:] = src[blocks]`` (``out`` on the host): one copy on the CPU, where
    ``index_select`` writes into ``out``; through the device's own gather elsewhere."""
    if src.device.type == "cpu":
        torch.index_select(src, 0, blocks, out=out)
    else:
        out.copy_(src.index_select(0, blocks))


def host_array(t: torch.Tensor) -> Any:
    """What the Prefill stage emits for a saved buffer: a numpy view of it (the data plane
    then hands decode a view of its slot, not a copy), or the tensor itself for a dtype
    numpy lacks (bfloat16)."""
    try:
        return t.numpy()
    except TypeError:
        return t


def _as(src: Any, like: torch.Tensor) -> torch.Tensor:
    """Received KV (a CPU tensor, or a numpy array: often a read-only view of the data
    plane's slot) on the device and in the dtype of ``like``, a paged cache; no copy when
    they already match. torch cannot mark a tensor read-only: this module only reads it."""
    if not isinstance(src, torch.Tensor):
        with warnings.catch_warnings():  # "The given NumPy array is not writable"
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(src)
    return src.to(device=like.device, dtype=like.dtype)
