"""The OpenAI request bodies as strict pydantic models, and :func:`parse`: a body as its
model, or a 400 naming the first bad field.

Strict as OpenAI's API is (``"10"`` is not a number nor 1 a boolean); every integer a
stage gets fits in 64 bits; a list stops at its first bad item. Unknown fields are refused,
naming the field; fields the OpenAI API has that an endpoint does not support (each
model's ``unsupported``) are refused naming the field and saying why, unless sent as
null, ``[]`` or ``{}``. What each field means to the pipeline is
:mod:`omni_serve.openai_api`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from omni_serve.body import INT_MAX, INT_MIN
from omni_serve.errors import APIError, bad_field
from omni_serve.settings import MAX_TIMEOUT_S

# every integer a stage gets fits in 64 bits (a float such as 1e30 is refused too)
Int64 = Annotated[int, Field(ge=INT_MIN, le=INT_MAX)]
Count = Annotated[int, Field(ge=0, le=INT_MAX)]
Positive = Annotated[int, Field(ge=1, le=INT_MAX)]
Penalty = Annotated[float, Field(ge=-2, le=2)]  # frequency and presence (OpenAI's range)
Bias = Annotated[float, Field(ge=-100, le=100)]
# a list stops at its first bad item: 100,000 bad items cost one error, not 100,000
# (which pydantic collects with the GIL held, stalling the server)
Strings = Annotated[list[str], Field(fail_fast=True)]
# a prompt given as token ids (vLLM's): the pipeline's intake checks them against its
# vocabulary
TokenIds = Annotated[list[Count], Field(min_length=1, fail_fast=True)]


def _at_most(n: int) -> BeforeValidator:
    """A mapping of at most ``n`` entries, counted before its values are checked."""

    def check(value: Any) -> Any:
        if isinstance(value, dict) and len(value) > n:
            raise ValueError(f"at most {n} entries, got {len(value)}")
        return value

    return BeforeValidator(check)


class _Model(BaseModel):
    # strict, as OpenAI's API is: "10" is not a number nor 1 a boolean (an int is a
    # float, though)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    # OpenAI fields this endpoint does not support -> why (a 400 naming the field, not
    # "unknown field"); sent as null, [] or {} they are taken as absent
    unsupported: ClassVar[dict[str, str]] = {}


class Body(_Model):
    model: str | None = None
    user: str | None = None
    # omni: this request's timeout; it may lower the server's cap, never raise it
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    # vLLM's extra field: lower runs first; not 0 only where some stage schedules by
    # priority (Server.check_priority)
    priority: Int64 = 0


class StreamOptions(_Model):
    include_usage: bool = False


_TOOLS = "tool and function calling is not supported by this server"
_TEXT_UNSUPPORTED = {
    "tools": _TOOLS,
    "tool_choice": _TOOLS,
    "functions": _TOOLS,
    "function_call": _TOOLS,
    "parallel_tool_calls": _TOOLS,
    "audio": "audio output is not supported by this server",
    "modalities": "only text output is supported by this server",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "reasoning_effort": "not supported by this server",
    "best_of": "not supported by this server (all n choices are returned: use n)",
}


# chat takes tools (omni_serve.tools) and, where the pipeline speaks, audio output
# (chat_request); the legacy functions API stays refused
_CHAT_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "audio", "modalities")
_LEGACY = "the legacy functions API is not supported by this server; use 'tools'"
_CHAT_UNSUPPORTED = {
    **{k: v for k, v in _TEXT_UNSUPPORTED.items() if k not in _CHAT_FIELDS},
    "functions": _LEGACY,
    "function_call": _LEGACY,
}
# a function's name, as OpenAI allows it
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDef(_Model):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema (omni_serve.tools.check_schema)
    strict: bool | None = None  # accepted: required and named calls are held to the schema


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class FunctionRef(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionRef


class CallFunction(_Model):
    name: FunctionName
    arguments: str


class ToolCall(_Model):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: CallFunction


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # json_schema: {"json_schema": {...}}
    type: str


class TextBody(Body):
    unsupported: ClassVar[dict[str, str]] = _TEXT_UNSUPPORTED
    max_tokens: Positive | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: Int64 | None = None
    stop: str | Strings | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    # token id (a decimal string) -> -100..100, added to its logit (OpenAI's limit: 300)
    logit_bias: Annotated[dict[str, Bias], _at_most(300)] | None = None
    ignore_eos: bool | None = None  # omni (as vLLM): decode to max_tokens
    # vLLM's extras (sent with the openai client's extra_body); the pipeline checks
    # what needs the model (token ids in its vocabulary, min_tokens <= max_tokens)
    repetition_penalty: float | None = Field(default=None, gt=0)
    top_k: Int64 | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    min_tokens: Count | None = None
    stop_token_ids: Annotated[list[Count], Field(fail_fast=True, max_length=64)] | None = None
    bad_words: Annotated[list[str], Field(fail_fast=True, max_length=128)] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's: {"json" | "json_object" | "regex" | "choice" | "grammar": ...}, checked by
    # the pipeline's intake (omni_ar.structured), a 400 naming the field where it is bad
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: each prompt token's logprob, rank and its k likeliest alternatives, answered
    # as vLLM does (a completion choice's, a chat's top-level ``prompt_logprobs``)
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    store: bool | None = None  # accepted (OpenAI's stored completions): nothing is stored
    # with store: accepted, unused (OpenAI's limit: 16 pairs)
    metadata: Annotated[dict[str, str], _at_most(16)] | None = None
    service_tier: str | None = None  # accepted, unused: one tier here


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    url: str = Field(min_length=1)
    # accepted, unused: the vision tower's processor has one resolution
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Model):
    data: str = Field(min_length=1)  # base64; its bytes and budgets are the stage's to check
    format: str = Field(min_length=1, max_length=16)  # "wav", "mp3", ...


class InputAudioPart(_Model):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | InputAudioPart, Field(discriminator="type")]


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None: only an assistant message with tool_calls (checked by chat_request)
    content: str | Annotated[list[ContentPart], Field(fail_fast=True)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(fail_fast=True, max_length=128)] | None = None
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)
    refusal: str | None = None  # accepted (an assistant's earlier answer), unused
    # an earlier audio answer by id: refused (chat_request), nothing is kept to refer to
    audio: dict[str, Any] | None = None


# chat's audio formats (OpenAI's names) -> the pipeline's (omni_speech's OUTPUT_FORMATS)
CHAT_AUDIO_FORMATS = {f: f for f in ("wav", "mp3", "flac", "opus", "aac")} | {"pcm16": "pcm"}
Voice = Annotated[str, Field(min_length=1, max_length=256)]


class ChatAudio(_Model):
    """``audio`` of a chat that asks for speech: the voice (default: the pipeline's) and
    the format (default: wav)."""

    voice: Voice | None = None
    format: Literal["wav", "mp3", "flac", "opus", "aac", "pcm16"] | None = None


class ChatRequest(TextBody):
    unsupported: ClassVar[dict[str, str]] = _CHAT_UNSUPPORTED
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    tools: Annotated[list[Tool], Field(fail_fast=True)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    modalities: (
        Annotated[list[Literal["text", "audio"]], Field(min_length=1, max_length=2)] | None
    ) = None
    audio: ChatAudio | None = None

    @property
    def speak(self) -> bool:
        """The answer is to be spoken too (``modalities`` has ``audio``)."""
        return "audio" in (self.modalities or ())


class CompletionRequest(TextBody):
    # one prompt, or a batch of them (vLLM's: each a string or token ids)
    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1, fail_fast=True)]
        | Annotated[list[TokenIds], Field(min_length=1, fail_fast=True)]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None


MAX_SPEECH_INPUT = 4096  # OpenAI's limit on the text to speak
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")  # OpenAI's response_format


class SpeechRequest(Body):
    """OpenAI's text to speech (``/v1/audio/speech``)."""

    unsupported: ClassVar[dict[str, str]] = {
        "instructions": "voice instructions are not supported by this server",
    }
    input: str = Field(min_length=1, max_length=MAX_SPEECH_INPUT)
    voice: Voice
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float | None = Field(default=None, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    seed: Int64 | None = None  # omni: the same seed, the same audio


class ImageRequest(Body):
    prompt: str = Field(min_length=1)
    n: Int64 = 1
    size: str | None = None  # "WIDTHxHEIGHT" or "auto"
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: Int64 | None = Field(default=None, ge=0, le=100)
    quality: Literal["auto", "low", "medium", "high", "standard", "hd"] | None = None
    background: Literal["auto", "opaque", "transparent"] | None = None
    style: str | None = None
    moderation: str | None = None
    stream: bool = False
    partial_images: Count | None = None
    # omni: the DiT's own fields
    steps: Int64 | None = None
    seed: Int64 | None = None
    guidance: float | None = None
    true_cfg_scale: float | None = None  # Flux: classifier-free guidance
    negative_prompt: str | None = None
    preview_every: Int64 | None = None
    max_tokens: Positive | None = None  # the AR stages of a mixed pipeline


T = TypeVar("T", bound=BaseModel)


def parse(model: type[T], body: Any) -> T:
    """``body`` as ``model``, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, why in model.unsupported.items():  # type: ignore[attr-defined]
        if name in body:
            if body[name] is None or body[name] == [] or body[name] == {}:
                body = {k: v for k, v in body.items() if k != name}
            else:
                raise bad_field(name, why)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        # a union (``content: str | list[part]``) fails once per member: the deepest
        # error of the first bad field says what is wrong (the part, not "not a string")
        top = errors[0]["loc"][:1]
        err = max((x for x in errors if x["loc"][:1] == top), key=lambda x: len(x["loc"]))
        param = _param(err["loc"])
        what = (
            "not supported by this server (unknown field)"
            if err["type"] == "extra_forbidden"
            else err["msg"]
        )
        raise bad_field(param, what) from None


def _param(loc: tuple[Any, ...]) -> str:
    """``("messages", 0, "content", "list[tagged-union[...]]", 1, "image_url", "image_url",
    "url")`` -> ``messages[0].content[1].image_url.url``: pydantic's names of union
    members, and the tag of a tagged union's member, are not fields."""
    out = ""
    tagged = tag_next = False
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            tag_next, tagged = tagged, False
        elif part == "str" or "[" in str(part):
            tagged = "tagged-union" in str(part)
        elif tag_next:
            tag_next = False
        else:
            out += f".{part}" if out else str(part)
    return out or "body"
