"""OpenAI request bodies, checked, and mapped onto pipeline requests.

Text: ``{"messages" | "prompt", "max_tokens", "temperature", "top_p", "seed", "stop",
"logprobs", "top_logprobs"}`` and :data:`SAMPLING_FIELDS` (the penalties, ``logit_bias``
and vLLM's extras, as vLLM means them) (the AR intake's fields; ``logprobs``: decode's per-token
logprobs, which postprocess passes on with each token's text, and with ``top_logprobs: k``
the k most likely alternatives of each). Chat image parts (``image_url``) go to an
``ar.mm_intake`` as ``{"type": "image_url", "image_url": {"url": data URL}}``: data URLs
always, http(s) URLs only when the operator allows them (the server fetches them and
passes them on as data URLs: no stage ever touches the network), file paths never. Images:
``{"prompt", "image": {"width", "height", "steps", "seed", "guidance", "true_cfg_scale",
"format", "quality", "preview_every", "negative_prompt"}}`` (the DiT plan's fields).
Chat may bring ``tools``, ``tool_choice`` and ``parallel_tool_calls``, and ``tool``
messages and assistant ``tool_calls`` (see :mod:`omni_serve.tools`). On a pipeline whose
source is a speech thinker, chat also takes ``input_audio`` parts (base64 ``data``, a
``format``) and ``modalities`` / ``audio: {voice, format}`` (:func:`speech_fields`; where
the pipeline does not speak they are refused, naming the field), and text to speech
(``/v1/audio/speech``: ``input``, ``voice``, ``response_format``) is ``{"input", "voice",
"audio": {"format"}, "modalities": ["text", "audio"]}`` (:func:`speech_request`).
Every body may carry ``priority`` (vLLM's extra field: an int64, default 0, lower runs
first), passed on as the request's :data:`omni_core.scheduling.PRIORITY_KEY` when not 0.
Unknown fields are refused, naming the field; fields the OpenAI API has that change the
answer in ways a pipeline cannot (the legacy ``functions``, n > 1 for text, URLs for
images) are refused too rather than ignored, naming the field and saying it is not
supported.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from omni_core.scheduling import PRIORITY_KEY
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from omni_serve.body import INT_MAX, INT_MIN
from omni_serve.errors import APIError, bad_field
from omni_serve.limits import NO_PROMPT_LIMITS, PromptLimits, TokenLimit, check_max_tokens
from omni_serve.settings import MAX_TIMEOUT_S
from omni_serve.tools import DEFAULT_PARSER, ToolPlan, render_messages

# every integer a stage gets fits in 64 bits (a float such as 1e30 is refused too)
Int64 = Annotated[int, Field(ge=INT_MIN, le=INT_MAX)]
Count = Annotated[int, Field(ge=0, le=INT_MAX)]
Positive = Annotated[int, Field(ge=1, le=INT_MAX)]
Penalty = Annotated[float, Field(ge=-2, le=2)]  # frequency and presence (OpenAI's range)
Bias = Annotated[float, Field(ge=-100, le=100)]
# a list stops at its first bad item: 100,000 bad items cost one error, not 100,000
# (which pydantic collects with the GIL held, stalling the server)
Strings = Annotated[list[str], Field(fail_fast=True)]


def _at_most(n: int) -> BeforeValidator:
    """A mapping of at most ``n`` entries, counted before its values are checked."""

    def check(value: Any) -> Any:
        if isinstance(value, dict) and len(value) > n:
            raise ValueError(f"at most {n} entries, got {len(value)}")
        return value

    return BeforeValidator(check)


_SIZE = re.compile(r"([0-9]{1,6})x([0-9]{1,6})")  # ASCII digits only: not "²x16"


class _Model(BaseModel):
    # strict, as OpenAI's API is: "10" is not a number nor 1 a boolean (an int is a
    # float, though)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    # OpenAI fields this endpoint does not support -> why (a 400 naming the field, not
    # "unknown field"); sent as null, [] or {} they are taken as absent
    unsupported: ClassVar[dict[str, str]] = {}


class _Body(_Model):
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
    "best_of": "not supported by this server (only one completion per request)",
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


class _TextBody(_Body):
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


class ChatRequest(_TextBody):
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


class CompletionRequest(_TextBody):
    prompt: str | Strings
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None


MAX_SPEECH_INPUT = 4096  # OpenAI's limit on the text to speak
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")  # OpenAI's response_format


class SpeechRequest(_Body):
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


class ImageRequest(_Body):
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


# pipeline field names (as stages report them) -> the request's
IMAGE_PARAMS = {
    "image.width": "size",
    "image.height": "size",
    "image.format": "output_format",
    "image.quality": "output_compression",
    **{f"image.{k}": k for k in ("steps", "seed", "guidance", "true_cfg_scale", "negative_prompt")},
    "image.preview_every": "preview_every",
}


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


def scheduling(req: _Body) -> dict[str, Any]:
    """The pipeline request's scheduling fields: its priority, when not the default."""
    return {PRIORITY_KEY: req.priority} if req.priority else {}


# the text fields passed on to the pipeline as they are (the AR intake's names)
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "seed",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "repetition_penalty",
    "top_k",
    "min_p",
    "min_tokens",
    "stop_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "skip_special_tokens",
)


def _sampling(req: _TextBody, max_tokens: int | None, limit: TokenLimit | None) -> dict[str, Any]:
    if req.n != 1:
        raise bad_field("n", "only n=1 is supported for text")
    out: dict[str, Any] = {}
    if max_tokens is not None:
        check_max_tokens(max_tokens, limit)
        out["max_tokens"] = max_tokens
    for name in SAMPLING_FIELDS:
        value = getattr(req, name)
        if value is not None:
            out[name] = value
    if req.stop is not None:
        out["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    fmt = req.response_format
    if fmt is not None and fmt.type in ("text", "json_object", "json_schema"):
        # the pipeline checks the rest, and fails it (400) where no stage can honour it;
        # "text" too: it opts out of a stage's default constraint
        out["response_format"] = fmt.model_dump()
    elif fmt is not None:
        raise bad_field(
            "response_format",
            f"type {fmt.type[:40]!r}: expected 'text', 'json_object' or 'json_schema'",
        )
    if req.structured_outputs is not None:
        out["structured_outputs"] = req.structured_outputs
    return out


REMOTE = ("http://", "https://")


def _input_audio(where: str, part: InputAudioPart, role: str, audio_in: bool) -> dict[str, Any]:
    """An audio part as a speech source reads it, or a 400 naming the part."""
    if not audio_in:
        raise bad_field(
            where, "audio parts need a pipeline whose source reads audio (speech.thinker)"
        )
    if role != "user":
        raise bad_field(where, f"audio parts are allowed in user messages only, not {role!r}")
    return part.model_dump()


def _image(where: str, part: ImagePart, role: str, images: bool, remote: bool) -> dict[str, Any]:
    """An image part as the multimodal intake reads it, or a 400 naming the part."""
    if not images:
        raise bad_field(
            where,
            "image parts need a multimodal pipeline (ar.mm_intake -> ar.mm_prefill -> "
            "ar.mm_decode); this one serves text only",
        )
    if role != "user":
        raise bad_field(where, f"image parts are allowed in user messages only, not {role!r}")
    url = part.image_url.url
    param = f"{where}.image_url"
    if url.startswith(REMOTE):
        if not remote:
            raise bad_field(
                param,
                "remote image URLs are not fetched by this server (the operator can allow "
                "them with --allow-remote-images); send a base64 data URL",
            )
    elif not url.startswith("data:"):
        raise bad_field(param, "expected a base64 data URL (data:image/png;base64,...)")
    return {"type": "image_url", "image_url": {"url": url}}


def check_chat_chars(req: ChatRequest, chars: PromptLimits) -> None:
    """A 400 naming ``messages[i].content`` (its text, all text parts together) or
    ``messages`` (the whole chat's text) where it is over the prompt's character limit."""
    total = 0
    for i, m in enumerate(req.messages):
        if m.content is None:
            n = 0
        elif isinstance(m.content, str):
            n = len(m.content)
        else:
            n = sum(len(p.text) for p in m.content if isinstance(p, TextPart))
        chars.check(f"messages[{i}].content", n)
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in m.tool_calls or ())
        chars.check(f"messages[{i}].tool_calls", calls)
        total += n + calls
    tools = sum(len(t.model_dump_json()) for t in req.tools or ())
    chars.check("tools", tools)
    chars.check("messages", total + tools)


def chat_request(
    req: ChatRequest,
    limit: TokenLimit | None,
    images: bool = False,
    remote: bool = False,
    chars: PromptLimits = NO_PROMPT_LIMITS,
    tools: ToolPlan | None = None,
    parser: str = DEFAULT_PARSER,
    audio_in: bool = False,
    audio_out: bool = False,
) -> dict[str, Any]:
    """The pipeline request of a chat completion; ``limit``: the pipeline's largest
    ``max_tokens`` (None: unknown, the pipeline checks it); ``images``: the pipeline reads image
    parts; ``remote``: http(s) image URLs are allowed (:func:`omni_serve.media.fetch_remote`
    inlines them before the request is submitted); ``chars``: the texts' character limits
    (:func:`check_chat_chars`); ``tools``: the request's :class:`ToolPlan`
    (``ToolPlan.of(req, parser)``): its tools described in the messages, a forced call's
    JSON constraint; ``parser``: the pipeline's ``tool_call_parser`` (the format of earlier
    calls and results in the messages); ``audio_in``: the source reads audio parts and
    ``modalities``; ``audio_out``: the pipeline speaks (:func:`speech_fields`)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_field("top_logprobs", "requires 'logprobs': true")
    check_chat_chars(req, chars)
    messages = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        if m.audio is not None:
            raise bad_field(
                f"messages[{i}].audio",
                "earlier audio answers are not kept by this server; send their transcript "
                "as the message's content",
            )
        _check_tool_message(i, m)
        content: str | list[dict[str, Any]] | None
        if m.content is None:
            content = None
        elif isinstance(m.content, str):
            content = m.content
        elif all(isinstance(p, TextPart) for p in m.content):
            content = "".join(p.text for p in m.content if isinstance(p, TextPart))
        else:
            content = [
                {"type": "text", "text": p.text}
                if isinstance(p, TextPart)
                else _image(f"messages[{i}].content[{j}]", p, m.role, images, remote)
                if isinstance(p, ImagePart)
                else _input_audio(f"messages[{i}].content[{j}]", p, m.role, audio_in)
                for j, p in enumerate(m.content)
            ]
        message: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        messages.append(message)
    messages = render_messages(messages, tools, parser)
    out: dict[str, Any] = {"messages": messages, **scheduling(req)}
    out.update(_sampling(req, req.max_completion_tokens or req.max_tokens, limit))
    if tools is not None and tools.forced:
        if "response_format" in out or "structured_outputs" in out:
            what = "'required'" if tools.named is None else "a named function"
            raise bad_field(
                "tool_choice",
                f"{what} holds the answer to the tool's JSON: not with 'response_format' "
                "or 'structured_outputs'",
            )
        out["structured_outputs"] = tools.constraint()
    if req.logprobs:
        out["logprobs"] = True
        if req.top_logprobs:
            out["top_logprobs"] = req.top_logprobs
    out.update(speech_fields(req, audio_in, audio_out, tools))
    return out


def speech_fields(
    req: ChatRequest, audio_in: bool, audio_out: bool, tools: ToolPlan | None
) -> dict[str, Any]:
    """A chat's ``modalities`` and ``audio`` as a speech source reads them (``audio_in``;
    none for another source): ``["text"]`` unless the chat asks for audio, which needs a
    pipeline that speaks (``audio_out``), else a 400 naming the field."""
    if not audio_out:
        if req.audio is not None:
            raise bad_field("audio", "audio output is not supported by this server")
        if req.speak:
            raise bad_field("modalities", "only text output is supported by this server")
        return {"modalities": ["text"]} if audio_in else {}
    if not req.speak:
        if req.audio is not None:
            raise bad_field("audio", "asks for audio output: add 'audio' to 'modalities'")
        return {"modalities": ["text"]}
    if tools is not None and tools.mode != "none":
        raise bad_field("modalities", "audio output with tools is not supported by this server")
    audio: dict[str, str] = {}
    if req.audio is not None and req.audio.voice is not None:
        audio["voice"] = req.audio.voice
    if req.audio is not None and req.audio.format is not None:
        audio["format"] = CHAT_AUDIO_FORMATS[req.audio.format]
    return {"modalities": list(req.modalities or ()), "audio": audio}


def speech_request(req: SpeechRequest) -> dict[str, Any]:
    """The pipeline request of a text to speech: ``input`` said as it is, in ``voice``
    (the source's error about it names ``voice``), encoded as ``response_format``."""
    if req.speed is not None and req.speed != 1.0:
        raise bad_field("speed", f"{req.speed}: only 1.0 is supported (the model's own pace)")
    return {
        "input": req.input,
        "voice": req.voice,
        "audio": {"format": req.response_format},
        "modalities": ["text", "audio"],
        **({} if req.seed is None else {"seed": req.seed}),
        **scheduling(req),
    }


def _check_tool_message(i: int, m: ChatMessage) -> None:
    """A 400 naming the field where a message's tool fields do not fit its role: a
    ``tool`` message answers a call (``tool_call_id``, text content), only an
    assistant's has ``tool_calls``, and only such a one may have no content."""
    if m.role == "tool":
        if m.tool_call_id is None:
            raise bad_field(f"messages[{i}].tool_call_id", "required in a 'tool' message")
        if not isinstance(m.content, str) and not (
            m.content and all(isinstance(p, TextPart) for p in m.content)
        ):
            raise bad_field(f"messages[{i}].content", "a 'tool' message's content is text")
    elif m.tool_call_id is not None:
        raise bad_field(f"messages[{i}].tool_call_id", "only in a 'tool' message")
    if m.tool_calls and m.role != "assistant":
        raise bad_field(f"messages[{i}].tool_calls", "only in an 'assistant' message")
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise bad_field(
            f"messages[{i}].content", "required (only an assistant's tool_calls may stand alone)"
        )


def completion_request(
    req: CompletionRequest, limit: TokenLimit | None, chars: PromptLimits = NO_PROMPT_LIMITS
) -> dict[str, Any]:
    """The pipeline request of a (legacy) completion; ``limit`` and ``chars`` as
    :func:`chat_request`'s."""
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad_field("prompt", "only one prompt per request is supported")
        prompt = prompt[0]
    chars.check("prompt", len(prompt))
    if req.echo:
        raise bad_field("echo", "not supported")
    if req.suffix:
        raise bad_field("suffix", "not supported")
    out: dict[str, Any] = {"prompt": prompt, **scheduling(req)}
    out.update(_sampling(req, req.max_tokens, limit))
    if req.logprobs is not None:  # 0: the chosen tokens' logprobs; N: and the top N
        out["logprobs"] = True
        if req.logprobs:
            out["top_logprobs"] = req.logprobs
    return out


def image_requests(
    req: ImageRequest,
    max_pixels: int,
    max_images: int,
    limit: TokenLimit | None,
    chars: PromptLimits = NO_PROMPT_LIMITS,
) -> list[dict[str, Any]]:
    """One pipeline request per image asked for (``n``); with ``n > 1`` image ``i`` gets
    seed ``seed + i`` (``seed`` defaults to 0), so the images differ and are reproducible;
    ``limit``: the largest ``max_tokens`` of a mixed pipeline's AR stages; ``chars``: the
    character limits of ``prompt`` and ``negative_prompt``."""
    chars.check("prompt", len(req.prompt))
    if req.negative_prompt is not None:
        chars.check("negative_prompt", len(req.negative_prompt), negative=True)
    if not 1 <= req.n <= max_images:
        raise bad_field("n", f"expected 1..{max_images}, got {req.n}")
    if req.response_format == "url":
        raise bad_field("response_format", "only b64_json is supported")
    if req.background == "transparent":
        raise bad_field("background", "transparent backgrounds are not supported")
    image: dict[str, Any] = {}
    if req.size not in (None, "auto"):
        m = _SIZE.fullmatch(req.size.lower())
        if not (m and int(m[1]) > 0 and int(m[2]) > 0):
            raise bad_field("size", f"expected 'WIDTHxHEIGHT' or 'auto', got {req.size[:40]!r}")
        w, h = m[1], m[2]
        if int(w) * int(h) > max_pixels:
            raise bad_field(
                "size", f"{req.size} is over this server's limit of {max_pixels} pixels"
            )
        image.update(width=int(w), height=int(h))
    if req.output_format is not None:
        image["format"] = req.output_format
    if req.output_compression is not None:
        image["quality"] = max(1, req.output_compression)
    for name in ("steps", "guidance", "true_cfg_scale", "negative_prompt", "preview_every"):
        value = getattr(req, name)
        if value is not None:
            image[name] = value
    if req.stream and req.partial_images == 0:
        image["preview_every"] = 0
    if req.seed is not None and req.seed + req.n - 1 > INT_MAX:
        raise bad_field("seed", f"seed + n - 1 must fit in 64 bits (at most {INT_MAX})")
    if req.max_tokens is not None:
        check_max_tokens(req.max_tokens, limit)
    out = []
    for i in range(req.n):
        one = dict(image)
        if req.seed is not None or req.n > 1:
            one["seed"] = (req.seed or 0) + i
        request: dict[str, Any] = {"prompt": req.prompt, "image": one, **scheduling(req)}
        if req.max_tokens is not None:
            request["max_tokens"] = req.max_tokens
        out.append(request)
    return out
