"""omni's vLLM plugin: the ``requires_kv`` contract on a KV consumer (media-free decode).

vLLM loads it through its own ``vllm.general_plugins`` entry point (``omni_requires_kv``)
in every engine it starts in an environment where ``omni-ar-stages`` is installed; omni
itself never patches vLLM on import. It changes one thing, and only for requests that ask
for it:

A request whose ``kv_transfer_params`` carry :data:`FLAG` (the ``ar.mm_decode`` stage's, on
``engine: vllm``) has media items without data: only each item's hash (its identifier)
and placeholder span, the prompt's KV coming from the prefill engine through the KV
connector. vLLM 0.32 takes such an item as far as the scheduler already (an engine
input built with ``mm_input`` skips the renderer; ``mm_processor_cache_gb=0`` removes the
receiver cache; a ``kv_consumer`` admits items under ``limit_mm_per_prompt`` 0 and then
builds no vision tower). Its scheduler, though, would schedule the vision encoder for any
placeholder the KV does not cover, and the model runner then stops the whole engine step
on "Encoder cache miss". The plugin wraps
``Scheduler._try_schedule_encoder_inputs``: a flagged request whose computed tokens (its
local prefix-cache hits plus the connector's load) stop short of its last placeholder is
ended with ``FINISHED_ERROR`` before anything runs, and the reason is kept in
:data:`FAILURES` under its handoff key for the engine to raise. That covers a KV that never
arrived, a short one, blocks whose hashes do not match (the connector loads only the
matching prefix, see :mod:`omni_ar.engines.kv_connector`) and a preemption (vLLM frees
the KV and would recompute it from the media the request does not have). A request
without the flag goes through vLLM's own code unchanged.

The wrapped method is private to vLLM, so the plugin supports exactly the version it
was written against (:data:`SUPPORTED_VLLM`): on any other it installs nothing and logs
why, and the ``ar.mm_*`` stages refuse ``engine: vllm`` with that reason
(:func:`require`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import OrderedDict
from typing import Any

SUPPORTED_VLLM = "0.32.0"
FLAG = "omni_requires_kv"  # kv_transfer_params entry: the media items are covered by KV
KEY = "omni_kv"  # kv_transfer_params entry: the request's handoff key (kv_connector.PARAM)
FAILURES_MAX = 4096  # reasons kept for the engine to collect, oldest dropped first

log = logging.getLogger(__name__)

# handoff key -> why the request was ended (popped by the engine that sees the error)
FAILURES: OrderedDict[str, str] = OrderedDict()
# handoff key -> what the KV connector found wrong with the KV it was handed
CONNECTOR_NOTES: OrderedDict[str, str] = OrderedDict()

_refusal: str | None = None  # why the plugin is not installed, once register() ran
_WRAPPED = "_omni_requires_kv"
_PARAMETERS = (
    "self",
    "request",
    "num_computed_tokens",
    "num_new_tokens",
    "encoder_compute_budget",
    "shift_computed_tokens",
)


def register() -> None:
    """vLLM's entry point: install the scheduler check on the supported version; on any
    other, log why not (an exception here would stop every vLLM engine in this
    environment, text-only ones included). Safe to call more than once."""
    global _refusal
    import vllm

    version = vllm.__version__
    if version.split("+")[0] != SUPPORTED_VLLM:
        _refusal = (
            f"omni's requires_kv vLLM plugin supports vLLM {SUPPORTED_VLLM} only, and this "
            f"is vLLM {version}: it is not installed"
        )
        log.error("%s", _refusal)
        return
    _refusal = _install()
    if _refusal is not None:
        log.error("%s", _refusal)


def installed() -> bool:
    """Whether the scheduler check is in place in this process."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return getattr(Scheduler._try_schedule_encoder_inputs, _WRAPPED, False)


def require() -> None:
    """:class:`RuntimeError` naming why a media-free decode cannot run on this vLLM."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what an engine does first; once per process
    if installed():
        return
    reason = _refusal or (
        "omni's requires_kv vLLM plugin was not loaded (is omni-ar-stages installed in "
        "this environment, and VLLM_PLUGINS, if set, naming omni_requires_kv?)"
    )
    raise RuntimeError(f"engine 'vllm' cannot serve a media-free decode: {reason}")


def _install() -> str | None:
    """Wrap the scheduler's encoder-input scheduling; the reason when it cannot."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._try_schedule_encoder_inputs
    if getattr(original, _WRAPPED, False):
        return None
    names = tuple(inspect.signature(original).parameters)
    if names != _PARAMETERS:
        return (
            "omni's requires_kv vLLM plugin: Scheduler._try_schedule_encoder_inputs takes "
            f"{names}, not the {_PARAMETERS} it was written for: it is not installed"
        )

    @functools.wraps(original)
    def try_schedule_encoder_inputs(
        self: Any,
        request: Any,
        num_computed_tokens: int,
        num_new_tokens: int,
        encoder_compute_budget: int,
        shift_computed_tokens: int = 0,
    ) -> tuple[list[int], int, int, list[int], list[int]]:
        need = required_tokens(request)
        covered = num_computed_tokens + shift_computed_tokens
        if need and num_new_tokens > 0 and covered < need:
            _fail(request, covered, need)
            # ended as FINISHED_ERROR by update_from_output, with nothing scheduled
            self.encoder_cache_mismatch_reqs.add(request.request_id)
            return [], 0, encoder_compute_budget, [], []
        return original(
            self,
            request,
            num_computed_tokens,
            num_new_tokens,
            encoder_compute_budget,
            shift_computed_tokens,
        )

    setattr(try_schedule_encoder_inputs, _WRAPPED, True)
    Scheduler._try_schedule_encoder_inputs = try_schedule_encoder_inputs
    return None


def required_tokens(request: Any) -> int:
    """The prompt positions a flagged request's KV must cover (up to the end of its last
    placeholder); 0 for any other request."""
    params = request.kv_transfer_params or {}
    if not params.get(FLAG) or not request.mm_features:
        return 0
    return max(f.mm_position.offset + f.mm_position.length for f in request.mm_features)


def _fail(request: Any, covered: int, need: int) -> None:
    key = str((request.kv_transfer_params or {}).get(KEY))
    if request.num_preemptions:
        why = (
            "it was preempted, which freed its KV, and it has no media to recompute the "
            "placeholders from"
        )
    else:
        why = CONNECTOR_NOTES.pop(key, None) or "the KV it was handed stops short"
    remember(
        FAILURES,
        key,
        f"requires_kv: KV covers {covered} prompt positions, its media placeholders end at "
        f"{need} ({why}); ended without running a vision encoder",
    )


def remember(table: OrderedDict[str, str], key: str, reason: str) -> None:
    """``table[key] = reason``, keeping at most :data:`FAILURES_MAX` (oldest dropped)."""
    table[key] = reason
    table.move_to_end(key)
    while len(table) > FAILURES_MAX:
        table.popitem(last=False)


def failure(key: str | None) -> str | None:
    """Why the plugin ended the request with handoff key ``key`` (taken), if it did."""
    return FAILURES.pop(key, None) if key else None


def forget_failure(key: str | None) -> None:
    """Drop what the plugin and the connector noted about ``key`` (the request ended)."""
    FAILURES.pop(key or "", None)
    CONNECTOR_NOTES.pop(key or "", None)
