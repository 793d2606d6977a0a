"""The base of the AR stages that hold an engine: their options, how they load the
engine where their placement puts it, and how they read a request."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from omni_core.plugin import Stage, StageInput

from omni_ar.engines import TRANSFORMERS_PRELOAD, load_engine
from omni_ar.engines.dtype import auto_dtype
from omni_ar.engines.protocol import Engine, require_engine
from omni_ar.engines.threads import Threads, thread_count
from omni_ar.models import resolve_model
from omni_ar.params import (
    RAW_PROMPT_KEY,
    RequestError,
    SamplingParams,
    carried_params,
    parse_request,
)
from omni_ar.structured import check_constraint


class ChatExample(msgspec.Struct, forbid_unknown_fields=True):
    """One worked example: a user turn and the answer the model should have given."""

    user: str
    assistant: str


class ModelOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The options every AR stage takes (``options:`` of a stage in the YAML)."""

    model: str  # a Hugging Face model directory, or a named model ("smollm2")
    engine: Literal["transformers", "vllm"] = "transformers"  # what runs the model
    kv_connector: Literal["shm", "file"] = "shm"  # vLLM: how prefill's KV reaches decode
    engine_args: dict[str, Any] = msgspec.field(default_factory=dict)  # vLLM: extra args
    # the model's dtype; auto: bfloat16 on a CPU that computes it natively, else float32
    # (omni_ar.engines.dtype); bfloat16 (else float16) on a GPU, and vLLM's own choice there
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # vLLM on a GPU: the share of its memory the engine may take (weights + KV cache)
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    threads: Threads = None  # torch threads in this worker; all: every core (at run time)
    # on the CPU: engines naming the same turn compute one forward at a time, each on all
    # of its threads (a split pipeline's prefill and decode on one machine's cores)
    cpu_turns: str | None = None
    # the request's limits and defaults: they apply where it enters the family (ar.intake,
    # ar.mm_intake), which parses it once; the later stages take its params as parsed there
    max_prompt_tokens: int = 2048  # intake refuses longer prompts
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 16  # for requests that do not say
    chat: bool = False  # a plain "prompt" goes through the chat template as a user turn
    system_prompt: str | None = None  # with chat: a system turn before a plain prompt
    # with chat: worked examples, as user / assistant turns between the system prompt and
    # a plain prompt (few-shot prompting: a small model copies an answer's form from them)
    examples: list[ChatExample] = msgspec.field(default_factory=list)
    # the constraint of every request that brings none (no structured_outputs, no
    # response_format), as a request spells it: {"regex": ...}, {"json": ...}, ...
    # (omni_ar.structured); it applies where the request enters the family (intake)
    structured_outputs: dict[str, Any] | None = None
    # how omni serve reads the tool calls a model writes in chat (tool_choice "auto"),
    # and writes the tools into its prompt (omni_serve.tools; vLLM's name and parsers')
    tool_call_parser: Literal["hermes", "llama3_json"] = "hermes"

    def __post_init__(self) -> None:
        if self.examples and not self.chat:
            raise ValueError("examples are chat turns: they need chat: true")
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = check_constraint(self.structured_outputs)
            except RequestError as e:  # a config error: the options' own kind
                raise ValueError(str(e).replace("field ", "option ", 1)) from None
        # else every request that does not say max_tokens would be refused
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens {self.default_max_tokens} is not in "
                f"1..max_tokens_limit ({self.max_tokens_limit})"
            )


class ModelStage(Stage):
    Options = ModelOptions
    preload = TRANSFORMERS_PRELOAD
    images: ClassVar[bool] = False  # requests may carry image parts (the ar.mm_* stages)
    token_prompts: ClassVar[bool] = False  # a prompt may be token ids (ar.intake)
    kv_role: ClassVar[str | None] = None  # the vLLM engine's KV connector role
    # why this stage cannot sample under a constraint ("": it can, on either engine)
    unstructured: ClassVar[str] = ""
    engine: Engine  # set by load (:meth:`_engine`)

    @classmethod
    def preload_modules(cls, options: dict[str, Any]) -> tuple[str, ...]:
        """vLLM reads its environment (set per stage, before its import) when it loads:
        it is imported in the worker, the tokenizer's modules in the zygote."""
        if options.get("engine") == "vllm":
            return ("torch", "transformers.models.auto.tokenization_auto")
        return cls.preload

    def _engine(self, model: bool = True, **vllm_options: Any) -> Engine:
        """The stage's engine; ``model``: it will load the model, on the device and in
        the dtype of the stage's placement (else only a tokenizer, on the CPU);
        ``vllm_options``: more options of the vLLM engine
        (:class:`~omni_ar.engines.vllm_engine.VllmEngine`). An object that is not an
        :class:`~omni_ar.engines.protocol.Engine` is refused (a TypeError naming what
        it lacks)."""
        o = self.options
        device, dtype = self._placement() if model else ("cpu", "float32")
        engine = load_engine(
            o.engine,
            resolve_model(o.model),
            dtype,
            thread_count(o.threads),
            device,
            kv_role=self.kv_role,
            kv_connector=o.kv_connector,
            engine_args=o.engine_args,
            gpu_memory_utilization=o.gpu_memory_utilization,
            cpu_turns=o.cpu_turns,
            scheduling_policy=self.ctx.scheduler_policy,
            **vllm_options,
        )
        return require_engine(engine)

    def _placement(self) -> tuple[str, str]:
        """(device, dtype) of the stage's model: :meth:`omni_core.plugin.StageContext.place` of its
        ``devices`` and ``dtype`` (a :class:`omni_core.plugin.DeviceError` where it asks
        for a GPU torch does not see). ``auto``: :func:`~omni_ar.engines.dtype.auto_dtype`;
        vLLM on a GPU keeps it: it picks the dtype."""
        o = self.options
        p = self.ctx.place(o.dtype)
        if o.dtype != "auto":
            return p.device, p.dtype
        if o.engine == "vllm" and p.is_gpu:
            return p.device, "auto"
        return p.device, auto_dtype(p.device)

    def read(self, request: dict[str, Any]) -> tuple[Any, SamplingParams]:
        """(prompt text or token ids, or messages; sampling params) of a request entering
        the family: parsed and checked here, once, by the options of this (intake) stage;
        the params travel on with the request's events
        (:func:`omni_ar.params.params_payload`). Public: the server's ``/tokenize`` reads a
        request the way the intake does."""
        o = self.options
        if "max_tokens" not in request:
            request = {**request, "max_tokens": o.default_max_tokens}
        own = request.get("structured_outputs") or request.get("response_format")
        if o.structured_outputs is not None and not own:
            request = {**request, "structured_outputs": o.structured_outputs}
        source, params = parse_request(
            request, o.max_tokens_limit, images=self.images, ids=self.token_prompts
        )
        return self._chat(source, request.get(RAW_PROMPT_KEY, False)), params

    def _chat(self, source: Any, raw: bool = False) -> Any:
        """A plain prompt as a user turn, after the system prompt and the worked
        examples, with ``chat`` (unless the request asked for its prompt ``raw``)."""
        o = self.options
        if o.chat and isinstance(source, str) and not raw:
            turns = [{"role": "system", "content": o.system_prompt}] if o.system_prompt else []
            for example in o.examples:
                turns.append({"role": "user", "content": example.user})
                turns.append({"role": "assistant", "content": example.assistant})
            source = [*turns, {"role": "user", "content": source}]
        return source

    def _sampling_params(self, inp: StageInput) -> SamplingParams:
        """The params that came with the request (:func:`omni_ar.params.carried_params`),
        checked by :meth:`_check_sampling`."""
        return self._check_sampling(carried_params(inp.window))

    def _check_sampling(self, params: SamplingParams) -> SamplingParams:
        """``params`` in a stage that samples: a RequestError naming the constraint's
        field where the request asks for structured output this stage or its engine
        cannot hold to (its grammar compiled for the engine's tokenizer, cached, so
        that a request fails here, alone, never inside a batch's engine call); and where
        it names a token outside the model's vocabulary (``logit_bias``, ``stop_token_ids``,
        ``bad_words``: the engine's ``check_tokens``, once its model is loaded)."""
        self.engine.check_tokens(params)
        constraint = params.structured()
        if constraint is None:
            return params
        if self.unstructured:
            field = params.constraint_field()
            raise RequestError(f"field {field!r}: structured output: {self.unstructured}")
        self.engine.check_constraint(constraint, params.constraint_field())
        return params
