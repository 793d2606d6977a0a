"""A chat or completion request, normalized and validated at intake.

Every error names the field, so a bad request ends with a message the caller can act on.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import msgspec
from omni_core.plugin import PRIORITY_KEY

from omni_ar.errors import RequestError
from omni_ar.structured import check_constraint, check_schema, from_response_format

log = logging.getLogger("omni.ar")

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
MAX_SCHEMA_CHARS = 65536  # a json_schema's schema as JSON, at most
MAX_STOP_STRINGS = 16  # a request's stop strings, at most
MAX_STOP_CHARS = 1024  # characters in one stop string, at most
MAX_TOP_LOGPROBS = 20  # alternatives per token, at most (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # logit_bias entries, at most (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids, at most
MAX_BAD_WORDS = 128  # bad_words, at most (vLLM's VLLM_MAX_NUM_BAD_WORDS, before tokenizing)


def template_error(e: Exception) -> RequestError:
    """A chat template's failure on a request's messages as the client's error: the
    template's own words where it refused them (``raise_exception``, as in "roles must
    alternate": jinja2's plain ``TemplateError``), else only that it failed (the text of
    an error inside the template or the tokenizer is not the client's to see: logged)."""
    if type(e).__name__ == "TemplateError" and type(e).__module__.startswith("jinja2"):
        return RequestError(f"field 'messages': the chat template refused them: {e}")
    log.warning("the chat template failed: %s: %s", type(e).__name__, e)
    return RequestError("field 'messages': the chat template cannot be applied to them")


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How a request samples: its fields as OpenAI's completions name them, checked by
    :func:`parse_request`."""

    max_tokens: int = 16  # tokens to generate at most (the first one included)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this mass
    seed: int | None = None  # with temperature > 0: the same seed, the same tokens
    stop: list[str] = msgspec.field(default_factory=list)  # the text ends before any of these
    logprobs: bool = False  # each token's logprob with its text
    top_logprobs: int = 0  # with logprobs: the k most likely alternatives of each token
    ignore_eos: bool = False  # generate max_tokens even past the end-of-sequence token
    # OpenAI's penalties, as vLLM applies them: minus frequency x (times the token was
    # generated) and presence x (generated at all), over the generated tokens only
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # vLLM's extras (see omni_ar.logits, where the transformers engine applies them):
    repetition_penalty: float = 1.0  # > 1: a logit of a token in the prompt or output shrinks
    logit_bias: dict[str, float] | None = None  # token id (a string) -> added to its logit
    top_k: int = 0  # the k likeliest tokens only (0 or -1: all)
    min_p: float = 0.0  # tokens at least this fraction of the likeliest's probability only
    min_tokens: int = 0  # no EOS nor stop token (nor stop string) before this many tokens
    stop_token_ids: list[int] = msgspec.field(default_factory=list)  # these end it too
    bad_words: list[str] = msgspec.field(default_factory=list)  # never generated
    include_stop_str_in_output: bool = False  # the stop string (or token) stays in the text
    skip_special_tokens: bool = True  # special tokens leave no text
    # each prompt token's logprob (the first has none) and its k likeliest alternatives,
    # from the model's raw logits as vLLM's prompt_logprobs (the server's echo asks)
    prompt_logprobs: int | None = None
    # OpenAI's: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema":
    # {"name", "schema", "strict", "description"}}; checked by parse_request
    response_format: dict[str, Any] | None = None
    # vLLM's: one of {"json": schema, "json_object": true, "regex": str, "choice": [str],
    # "grammar": str} (see omni_ar.structured); checked and normalized by parse_request
    structured_outputs: dict[str, Any] | None = None

    def structured(self) -> dict[str, Any] | None:
        """The constraint the sampler holds to, ``{kind: value}`` as vLLM's
        ``StructuredOutputsParams`` takes it (from ``structured_outputs`` or
        ``response_format``), or None for free text."""
        return self.structured_outputs or from_response_format(self.response_format)

    def constraint_field(self) -> str:
        """The request field its constraint came from, for errors that name it."""
        return "structured_outputs" if self.structured_outputs else "response_format"


PARAMS = "params"  # a segment payload's entry: the request's params, parsed at intake


def params_payload(params: SamplingParams) -> dict[str, Any]:
    """The payload entry that carries a request's params on to the next stage (with the
    request's first segment): the AR stages parse a request once, where it enters them."""
    return {PARAMS: msgspec.to_builtins(params)}


def carried_params(window: Any) -> SamplingParams:
    """The params that came with the request's first segment in ``window`` (the first
    window of the request: it holds that segment)."""
    for payload in window.payloads:
        if PARAMS in payload:
            return msgspec.convert(payload[PARAMS], SamplingParams)
    raise RuntimeError(
        "no request params from upstream: an AR stage follows ar.intake or ar.mm_intake "
        "(or a stage of theirs that passes the params on)"
    )


# A prompt's logprobs: for each prompt token after the first, its logprob, its rank in
# the vocabulary (1: the likeliest) and its ``prompt_logprobs`` likeliest alternatives as
# [id, logprob], likeliest first.
PromptLogprobs = list[tuple[float, int, list[tuple[int, float]]]]


class Sampled(tuple):  # type: ignore[type-arg]
    """A token an engine produced: a plain tuple, ``(token, logprob)`` (or prefill's
    ``(token, logprob, keys, values)``), so it unpacks as the pairs it replaced, and
    ``top``: the ``top_logprobs`` most likely ``(token, logprob)`` at that step, most
    likely first (empty unless the request asked for them); a request's first token also
    carries ``prompt`` (:data:`PromptLogprobs`) where it asked for ``prompt_logprobs``."""

    top: list[tuple[int, float]]
    prompt: PromptLogprobs | None

    def __new__(
        cls,
        items: tuple[Any, ...],
        top: list[tuple[int, float]] | None = None,
        prompt: PromptLogprobs | None = None,
    ) -> Sampled:
        self = super().__new__(cls, items)
        self.top = top or []
        self.prompt = prompt
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Sampled, (tuple(self), self.top, self.prompt))


# A plain prompt fed as it is, never through the chat template of an intake with ``chat``
# (the server's /v1/completions sets it: a completion continues its prompt's text, as in
# vLLM); only with "prompt".
RAW_PROMPT_KEY = "raw_prompt"

# "image": the parameters of diffusion stages in the same pipeline (they validate it);
# "priority": the runtime's (checked where the request is submitted, read by the stages
# from StageInput.priority)
_REQUEST_KEYS = {
    "prompt",
    "messages",
    "image",
    PRIORITY_KEY,
    RAW_PROMPT_KEY,
    *SamplingParams.__struct_fields__,
}


MAX_PROMPT_IDS = 1 << 20  # token ids in a prompt given as ids, at most (before the stage's own)


def parse_request(
    request: dict[str, Any], max_tokens_limit: int, images: bool = False, ids: bool = False
) -> tuple[Any, SamplingParams]:
    """(prompt text, token ids or chat messages, sampling params) of a request, or
    RequestError.

    With ``images`` a message's content may also be a list of parts (see
    :func:`check_content_parts`); the media themselves are checked where they are decoded.
    With ``ids`` the prompt may be token ids (a non-empty list of ints >= 0, as vLLM's
    ``prompt`` takes them: fed as they are); the stage checks them against its vocabulary.
    """
    unknown = sorted(set(request) - _REQUEST_KEYS)
    if unknown:
        raise RequestError(f"field {unknown[0]!r}: unknown request field")
    has_prompt, has_messages = "prompt" in request, "messages" in request
    if has_prompt == has_messages:
        raise RequestError("field 'prompt': give exactly one of 'prompt' or 'messages'")
    raw = request.get(RAW_PROMPT_KEY, False)
    if not isinstance(raw, bool):
        raise RequestError(
            f"field {RAW_PROMPT_KEY!r}: expected a boolean, got {type(raw).__name__}"
        )
    if raw and has_messages:
        raise RequestError(f"field {RAW_PROMPT_KEY!r}: only with a plain 'prompt', not 'messages'")
    if has_prompt:
        prompt = request["prompt"]
        if isinstance(prompt, list) and ids:
            check_prompt_ids(prompt)
        elif not isinstance(prompt, str):
            what = "a string or token ids" if ids else "a string"
            raise RequestError(f"field 'prompt': expected {what}, got {type(prompt).__name__}")
        if not prompt:
            raise RequestError("field 'prompt': must not be empty")
        source: Any = prompt
    else:
        msgs = request["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("field 'messages': expected a non-empty list of messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"field 'messages[{i}].role': expected a string")
            content = m.get("content")
            if isinstance(content, list):
                if not images:
                    raise RequestError(
                        f"field 'messages[{i}].content': content parts (images) need the "
                        "multimodal stages (ar.mm_intake, ar.mm_prefill, ar.mm_decode)"
                    )
                check_content_parts(content, f"messages[{i}].content")
            elif not isinstance(content, str):
                raise RequestError(f"field 'messages[{i}].content': expected a string")
        source = msgs
    fields = {k: v for k, v in request.items() if k in SamplingParams.__struct_fields__}
    try:
        params = msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as e:
        text = str(e)
        where = text.split("`$.", 1)[1].rstrip("`") if "`$." in text else "?"
        raise RequestError(f"field {where!r}: {text.split(' - at ')[0]}") from None
    if not 1 <= params.max_tokens <= max_tokens_limit:
        raise RequestError(
            f"field 'max_tokens': expected 1..{max_tokens_limit}, got {params.max_tokens}"
        )
    if not 0.0 <= params.temperature <= 2.0:
        raise RequestError(f"field 'temperature': expected 0..2, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise RequestError(f"field 'top_p': expected a value in (0, 1], got {params.top_p}")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"field 'top_logprobs': expected 0..{MAX_TOP_LOGPROBS}, got {params.top_logprobs}"
        )
    if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"field 'prompt_logprobs': expected 0..{MAX_TOP_LOGPROBS}, got {params.prompt_logprobs}"
        )
    if params.top_logprobs and not params.logprobs:
        raise RequestError("field 'top_logprobs': needs 'logprobs': true")
    if any(not s for s in params.stop):
        raise RequestError("field 'stop': stop strings must not be empty")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise RequestError(
            f"field 'stop': at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}"
        )
    longest = max((len(s) for s in params.stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise RequestError(
            f"field 'stop': a stop string has at most {MAX_STOP_CHARS} characters, got {longest}"
        )
    check_extras(params)
    if params.response_format is not None:
        check_response_format(params.response_format)
    if params.structured_outputs is not None:
        if from_response_format(params.response_format) is not None:
            raise RequestError(
                "field 'structured_outputs': give it or a JSON 'response_format', not both"
            )
        params.structured_outputs = check_constraint(params.structured_outputs)
    elif params.response_format and params.response_format.get("type") == "json_schema":
        schema = params.response_format["json_schema"]["schema"]
        check_schema(schema, "response_format.json_schema.schema")  # as a grammar
    return source, params


def check_prompt_ids(prompt: list[Any]) -> None:
    """A prompt given as token ids: ints >= 0 (not booleans), at most
    :data:`MAX_PROMPT_IDS`; a RequestError naming the first that is not."""
    if len(prompt) > MAX_PROMPT_IDS:
        raise RequestError(f"field 'prompt': at most {MAX_PROMPT_IDS} token ids, got {len(prompt)}")
    for i, t in enumerate(prompt):
        if type(t) is not int or t < 0:
            raise RequestError(
                f"field 'prompt[{i}]': expected a token id (an int >= 0), got {t!r:.40}"
            )


def check_extras(params: SamplingParams) -> None:
    """The penalties and vLLM's extra sampling fields, in vLLM's ranges. What needs the
    model (token ids in its vocabulary, bad words that tokenize) is checked by the engine
    (:func:`omni_ar.logits.check_tokens`)."""
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        if not -2.0 <= value <= 2.0:
            raise RequestError(f"field {name!r}: expected -2..2, got {value}")
    if not (params.repetition_penalty > 0.0 and math.isfinite(params.repetition_penalty)):
        raise RequestError(
            f"field 'repetition_penalty': expected a value > 0, got {params.repetition_penalty}"
        )
    if params.top_k < -1:
        raise RequestError(f"field 'top_k': expected -1, 0 (off) or >= 1, got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise RequestError(f"field 'min_p': expected 0..1, got {params.min_p}")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise RequestError(
            f"field 'min_tokens': expected 0..max_tokens ({params.max_tokens}), "
            f"got {params.min_tokens}"
        )
    bias = params.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"field 'logit_bias': at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise RequestError(
                f"field 'logit_bias': keys are token ids (decimal strings), got {key[:40]!r}"
            )
        if not -100.0 <= value <= 100.0:
            raise RequestError(f"field 'logit_bias.{key}': expected -100..100, got {value}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(
            f"field 'stop_token_ids': at most {MAX_STOP_TOKEN_IDS}, "
            f"got {len(params.stop_token_ids)}"
        )
    if any(t < 0 for t in params.stop_token_ids):
        raise RequestError("field 'stop_token_ids': token ids are >= 0")
    if len(params.bad_words) > MAX_BAD_WORDS:
        raise RequestError(
            f"field 'bad_words': at most {MAX_BAD_WORDS}, got {len(params.bad_words)}"
        )
    if any(not w.strip() or len(w) > MAX_STOP_CHARS for w in params.bad_words):
        raise RequestError(
            f"field 'bad_words': each is a non-blank string of at most {MAX_STOP_CHARS} characters"
        )


def check_response_format(fmt: dict[str, Any]) -> None:
    """OpenAI's ``response_format``, checked here so that a malformed one fails at intake,
    naming the field, before any stage compiles a grammar from it."""
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise RequestError(
            f"field 'response_format.type': expected one of {list(RESPONSE_FORMATS)}, "
            f"got {str(kind)[:40]!r}"
        )
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(set(fmt) - allowed)
    if extra:
        raise RequestError(f"field 'response_format.{extra[0]}': unknown for type {kind!r}")
    if kind != "json_schema":
        return
    spec = fmt.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise RequestError(f"field {where!r}: expected an object with 'name' and 'schema'")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise RequestError(f"field '{where}.{extra[0]}': unknown field")
    for key, types, name in (
        ("name", str, "a string"),
        ("description", str, "a string"),
        ("strict", bool, "a boolean"),
    ):
        if key in spec and spec[key] is not None and not isinstance(spec[key], types):
            raise RequestError(f"field '{where}.{key}': expected {name}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        got = "nothing" if schema is None else type(schema).__name__
        raise RequestError(f"field '{where}.schema': expected a JSON Schema object, got {got}")
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_CHARS:
        raise RequestError(
            f"field '{where}.schema': {size} characters of JSON, over {MAX_SCHEMA_CHARS}"
        )


VIDEO_PARTS = ("video", "video_url")  # vLLM's and Qwen's names of a video part
_PART_FORMS = (
    "expected {'type': 'text', 'text': str}, {'type': 'image', 'image': path | bytes | "
    "data URL} or {'type': 'image_url', 'image_url': {'url': str}}"
)


def check_content_parts(parts: list[Any], where: str) -> None:
    """A message's parts: ``{"type": "text", "text": str}``, ``{"type": "image", "image":
    path | bytes | data URL}``, ``{"type": "image_url", "image_url": {"url": ...}}``, or
    ``{"type": "image", "hash": str}`` (an image that an upstream stage replaced by its
    content hash)."""
    if not parts:
        raise RequestError(f"field {where!r}: expected a non-empty list of parts")
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        keys = set(part) - {"type"} if isinstance(part, dict) else set()
        if kind == "text" and keys == {"text"} and isinstance(part["text"], str):
            continue
        if kind == "image" and keys == {"image"} and isinstance(part["image"], (str, bytes)):
            continue
        if kind == "image" and keys == {"hash"} and isinstance(part["hash"], str):
            continue
        url = part.get("image_url") if kind == "image_url" and keys == {"image_url"} else None
        if isinstance(url, dict) and isinstance(url.get("url"), str):
            continue
        if kind in VIDEO_PARTS:
            raise RequestError(
                f"field {at!r}: video parts are not supported (images only): the media-free "
                "handoff carries each image's (1, h, w) grid, not a video's frames and "
                "their timing"
            )
        raise RequestError(f"field {at!r}: {_PART_FORMS}")
