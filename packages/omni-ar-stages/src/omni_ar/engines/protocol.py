"""The AR engines' contract: :class:`Engine`, what every AR stage calls on any engine,
and the optional abilities some engines add, each a small protocol of its own.

A stage holds an :class:`Engine` (:func:`omni_ar.engines.load_engine` returns one, and
:meth:`omni_ar.stages.base.ModelStage._engine` refuses an object that is not one, naming
what it lacks); an ability is asked for with ``isinstance`` on its protocol, never by
probing for a method. ``hatch run lint`` runs mypy (strict) over this module and
:mod:`omni_ar.engines.conformance`, which proves that each engine class conforms.

* :class:`StreamingEngine`: one call runs a whole request (prefill and decode) in the
  engine's own scheduler (vLLM); ``ar.generate`` uses it where the engine has it, else
  ``prefill`` then ``decode``.
* :class:`HiddenStatesEngine`: per-token hidden states of a layer (a text encoder's
  output; the transformers engine).
* :class:`Preemptible`: what ``decode`` returned can be taken out of the engine's steps
  and put back (the transformers engine's batch); :class:`Closable`: it can be ended
  early, which frees the request's KV.
* :class:`MultimodalEngine` (transformers, :class:`~omni_ar.multimodal.engine.VLMEngine`)
  and :class:`PagedMultimodalEngine` (vLLM): the ``ar.mm_*`` stages' engines, which they
  pick by their ``engine`` option.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from omni_ar.params import Sampled, SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from omni_ar.engines.vllm_mm import MMContinuation, MMPrefilled, MMPrompt
    from omni_ar.handoff import MRope
    from omni_ar.multimodal.handoff import PrefixCache

# A prompt as a request gives it: plain text, or chat messages (the chat template's input)
Source: TypeAlias = "str | list[dict[str, Any]]"
# One side of a prompt's KV as the data plane carries it: a numpy array, or a CPU torch
# tensor for bfloat16 (transformers: ``(layers, kv_heads, tokens, head_dim)``; vLLM:
# its paged blocks, ``(layers, blocks, ...)``, empty where the KV stays with vLLM)
KVArray: TypeAlias = Any


@runtime_checkable
class Engine(Protocol):
    """What every AR stage calls on any engine: the tokenizer, the request checks, and
    prefill -> decode. A ``Sampled`` is a token with its logprob (``(token, logprob)``;
    prefill's ``(token, logprob, keys, values)``) and its ``top`` alternatives."""

    tokenizer: Any  # the model's Hugging Face tokenizer once loaded (None before)
    eos_ids: set[int]  # the model's end-of-sequence ids (empty before its model loads)

    def load_tokenizer(self) -> Any:
        """Load the model's tokenizer (kept as ``tokenizer``) and return it."""
        ...

    def load_model(self) -> None:
        """Load the model's weights where the engine was placed."""
        ...

    def encode(self, source: Source) -> list[int]:
        """A prompt's token ids; chat messages go through the chat template first."""
        ...

    def check_tokens(self, params: SamplingParams) -> None:
        """A RequestError naming the field where ``params`` name a token outside the
        model's vocabulary (nothing before the model is loaded)."""
        ...

    def check_constraint(
        self, constraint: dict[str, Any], field: str = "structured_outputs"
    ) -> None:
        """A ConstraintError naming ``field`` where this engine cannot hold a request
        to ``constraint``."""
        ...

    def prefill(self, ids: list[int], params: SamplingParams) -> Sampled:
        """``(first token, its logprob, keys, values)`` of a prompt."""
        ...

    def prefill_many(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        priorities: list[int] | None = None,
    ) -> Iterator[Sampled]:
        """:meth:`prefill` of each prompt, in order, those that arrived together in the
        same forwards or engine steps where the engine can."""
        ...

    def decode(
        self,
        first: int,
        keys: KVArray,
        values: KVArray,
        params: SamplingParams,
        prompt: list[int] | None = None,
        priority: int = 0,
    ) -> Iterator[Sampled | None]:
        """The tokens after ``first`` until EOS or ``max_tokens`` in all (``None``: the
        request waits inside the engine, and the stage gives its other requests a turn).
        The request enters the engine at this call; closing the iterator (where it is
        :class:`Closable`) takes it out and frees its KV."""
        ...


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine that runs a whole request, prefill and decode, in its own steps."""

    def stream(
        self, ids: list[int], params: SamplingParams, priority: int = 0
    ) -> Iterator[Sampled | None]:
        """Every token of the request (``None`` while it waits), batched with the
        others open; it enters the engine at this call."""
        ...


@runtime_checkable
class HiddenStatesEngine(Protocol):
    """An engine that gives a layer's hidden states (a text encoder's output)."""

    def hidden_states(self, ids: list[list[int]], layer: int = -1) -> np.ndarray:
        """``(batch, tokens, hidden)`` float32 on the CPU, for equal-length prompts."""
        ...


@runtime_checkable
class Closable(Protocol):
    """A decode's steps that can be ended early (the request leaves the engine)."""

    def close(self) -> None: ...


@runtime_checkable
class Preemptible(Protocol):
    """A decode's steps that can leave the engine's steps and come back (preemption),
    keeping the request's KV and the tokens it already has."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class MultimodalEngine(Engine, Protocol):
    """The transformers engine of the ``ar.mm_*`` stages: prompts with images, a KV
    handed over with its own prefix cache, and decode resumed from admitted KV.
    ``kv_shape``, ``placeholder_id`` and ``merge`` are there once the model is loaded."""

    kv_shape: tuple[int, int, int]  # (layers, kv_heads, head_dim)
    placeholder_id: int  # the image placeholder token
    merge: int | None  # an M-RoPE model's spatial merge; None without M-RoPE

    def load_model(self, vision: bool = True) -> None: ...

    def encode_mm(
        self, messages: list[dict[str, Any]], sizes: list[tuple[int, int]]
    ) -> tuple[list[int], list[tuple[int, int]]]: ...

    def grid(self, size: tuple[int, int]) -> list[int]: ...

    def pixel_values(self, images: list[np.ndarray]) -> dict[str, Any]: ...

    def prefill_kv(
        self,
        ids: list[int],
        items: list[dict[str, Any]],
        images: list[np.ndarray],
        block_size: int,
        cache: PrefixCache | None = None,
    ) -> tuple[KVArray, KVArray, int, MRope | None]: ...

    def resume(
        self,
        ids: list[int],
        keys: KVArray,
        values: KVArray,
        kv_tokens: int,
        params: SamplingParams,
        mrope: MRope | None = None,
    ) -> Iterator[tuple[int, float]]: ...


class PagedMultimodalEngine(Engine, Protocol):
    """The vLLM engine of the ``ar.mm_*`` stages: multimodal prefill in vLLM's paged
    blocks, and decode continuing from them (``mm``) without media."""

    merge: int | None  # an M-RoPE model's spatial merge; None without M-RoPE

    @property
    def block_size(self) -> int: ...

    @property
    def placeholder_id(self) -> int: ...

    def prefill_mm_many(
        self,
        prompts: list[MMPrompt],
        params: list[SamplingParams],
        priorities: list[int] | None = None,
    ) -> Iterator[MMPrefilled | str]: ...

    def decode(
        self,
        first: int,
        keys: KVArray,
        values: KVArray,
        params: SamplingParams,
        prompt: list[int] | None = None,
        priority: int = 0,
        mm: MMContinuation | None = None,
    ) -> Iterator[Sampled | None]: ...


def _members(proto: type) -> list[str]:
    """The attributes and public methods a protocol names (its bases' too)."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if cls in (Protocol, object, Any) or not getattr(cls, "_is_protocol", False):
            continue
        names |= set(getattr(cls, "__annotations__", {}))
        names |= {k for k, v in vars(cls).items() if callable(v) and not k.startswith("_")}
    return sorted(names)


def require_engine(engine: object) -> Engine:
    """``engine`` as an :class:`Engine`, or a TypeError naming what it lacks."""
    if isinstance(engine, Engine):
        return engine
    missing = [n for n in _members(Engine) if not hasattr(engine, n)]
    raise TypeError(
        f"{type(engine).__name__} is not an AR engine: it lacks {', '.join(missing)} "
        "(see omni_ar.engines.protocol.Engine)"
    )
