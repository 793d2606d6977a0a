"""OpenAI request bodies (their models: :mod:`omni_serve.openai_bodies`), checked, and
mapped onto pipeline requests.

Text: ``{"messages" | "prompt", "max_tokens", "temperature", "top_p", "seed", "stop",
"logprobs", "top_logprobs"}`` and :data:`SAMPLING_FIELDS` (the penalties, ``logit_bias``
and vLLM's extras, as vLLM means them) (the AR intake's fields; ``logprobs``: decode's per-token
logprobs, which postprocess passes on with each token's text, and with ``top_logprobs: k``
the k most likely alternatives of each). ``n`` choices of one prompt are ``n`` pipeline
requests (:func:`text_choices`; choice ``i`` seeded ``seed + i``). Chat image parts
(``image_url``) go to an
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
answer in ways a pipeline cannot (the legacy ``functions``, ``best_of``, URLs for images)
are refused too rather than ignored, naming the field and saying it is not supported.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from omni_core.scheduling import PRIORITY_KEY

from omni_serve.body import INT_MAX
from omni_serve.errors import bad_field
from omni_serve.limits import NO_PROMPT_LIMITS, PromptLimits, TokenLimit, check_max_tokens
from omni_serve.openai_bodies import (
    CHAT_AUDIO_FORMATS,
    Body,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ImagePart,
    ImageRequest,
    InputAudioPart,
    SpeechRequest,
    TextBody,
    TextPart,
    Tool,
    parse,
)
from omni_serve.tools import DEFAULT_PARSER, ToolPlan, render_messages

# what the routes read here: the mapping, and the bodies (defined in openai_bodies)
__all__ = [
    "IMAGE_PARAMS",
    "REMOTE",
    "SAMPLING_FIELDS",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ImageRequest",
    "SpeechRequest",
    "Tool",
    "chat_request",
    "check_chat_chars",
    "check_choices",
    "completion_requests",
    "prompts_of",
    "image_requests",
    "parse",
    "scheduling",
    "speech_fields",
    "speech_request",
    "text_choices",
]

_SIZE = re.compile(r"([0-9]{1,6})x([0-9]{1,6})")  # ASCII digits only: not "²x16"


# pipeline field names (as stages report them) -> the request's
IMAGE_PARAMS = {
    "image.width": "size",
    "image.height": "size",
    "image.format": "output_format",
    "image.quality": "output_compression",
    **{f"image.{k}": k for k in ("steps", "seed", "guidance", "true_cfg_scale", "negative_prompt")},
    "image.preview_every": "preview_every",
}


def scheduling(req: Body) -> dict[str, Any]:
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


def _sampling(req: TextBody, max_tokens: int | None, limit: TokenLimit | None) -> dict[str, Any]:
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


def check_choices(req: TextBody, max_n: int, prompts: int = 1) -> None:
    """A 400 naming ``n`` outside ``1..max_n`` (the server's ``--max-n``), or naming
    ``prompt`` where ``prompts`` x ``n`` choices are over it; or naming ``seed`` where a
    choice's seed (``seed + n - 1``) would not fit in 64 bits."""
    if not 1 <= req.n <= max_n:
        raise bad_field("n", f"expected 1..{max_n} (this server's --max-n), got {req.n}")
    if prompts * req.n > max_n:
        raise bad_field(
            "prompt",
            f"{prompts} prompts x n={req.n} are {prompts * req.n} choices, over this "
            f"server's --max-n ({max_n})",
        )
    if req.seed is not None and req.seed + req.n - 1 > INT_MAX:
        raise bad_field("seed", f"seed + n - 1 must fit in 64 bits (at most {INT_MAX})")


def text_choices(req: TextBody, preq: dict[str, Any]) -> list[dict[str, Any]]:
    """The pipeline requests of a text body's ``n`` choices (checked by
    :func:`check_choices`), as vLLM's ``n``: ``n`` requests of the one prompt ``preq``
    (an engine with a prefix cache shares their prefill). With a ``seed``, choice ``i``
    samples with ``seed + i``: it is what a request of its own with that seed answers.
    Without one (and ``n > 1``) the choices get ``base + i`` from a random ``base``, so
    each is drawn apart on every engine (the transformers engine samples a request without
    a seed with seed 0: its choices would all be the same)."""
    if req.n == 1:
        return [preq]
    base = req.seed if req.seed is not None else secrets.randbelow(INT_MAX - req.n + 2)
    return [{**preq, "seed": base + i} for i in range(req.n)]


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
    out.update(_prompt_logprobs(req))
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


Prompt = str | list[int]  # one prompt of a completion: text, or token ids


def prompts_of(req: CompletionRequest) -> list[Prompt]:
    """A completion's prompts: one, or the batch it sent (vLLM's ``prompt``: a string,
    token ids, or a list of either)."""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


def completion_requests(
    req: CompletionRequest, limit: TokenLimit | None, chars: PromptLimits = NO_PROMPT_LIMITS
) -> list[dict[str, Any]]:
    """The pipeline requests of a (legacy) completion, one per prompt (token ids are fed
    as they are; the pipeline's intake checks them against its vocabulary); ``limit`` and
    ``chars`` as :func:`chat_request`'s (``chars`` counts token ids as characters)."""
    prompts = prompts_of(req)
    for i, prompt in enumerate(prompts):
        chars.check("prompt" if len(prompts) == 1 else f"prompt[{i}]", len(prompt))
    if req.suffix:
        raise bad_field("suffix", "not supported")
    # the prompt as it is, never in an intake's chat template: a completion continues it
    out: dict[str, Any] = {"raw_prompt": True, **scheduling(req)}
    out.update(_sampling(req, req.max_tokens, limit))
    out.update(_prompt_logprobs(req))
    if req.logprobs is not None:  # 0: the chosen tokens' logprobs; N: and the top N
        out["logprobs"] = True
        if req.logprobs:
            out["top_logprobs"] = req.logprobs
        if req.echo:  # the prompt's tokens too, with as many alternatives as asked for
            # there (prompt_logprobs) or else here (vLLM's way)
            out.setdefault("prompt_logprobs", req.logprobs)
    return [{"prompt": p, **out} for p in prompts]


def _prompt_logprobs(req: TextBody) -> dict[str, Any]:
    """vLLM's ``prompt_logprobs`` field as the pipeline's: none when streamed (vLLM
    answers them only whole: a value over 0 is a 400 naming it, 0 is accepted)."""
    k = req.prompt_logprobs
    if k is None:
        return {}
    if req.stream:
        if k > 0:
            raise bad_field("prompt_logprobs", "not available when streaming ('stream': true)")
        return {}
    return {"prompt_logprobs": k}


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
