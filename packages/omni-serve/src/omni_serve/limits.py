"""The limits a pipeline's stages declare, which the server checks before a request
reaches them: each limit is set once (a stage option in the pipeline's config), and a
request over it is a 400 naming the field before the pipeline is asked.

A prompt's tokens are only known once a stage has tokenized all of it, so the server
holds its characters instead, before anything is tokenized: at most the stage's token
limit times :data:`CHARS_PER_TOKEN`, a bound no real text comes near (English averages
some 4 characters a token), so a prompt refused here would have been refused (or cut, by
a text encoder) there, only after the tokenizer had spent its time on it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import msgspec
from omni_core.registry import load_stage_class

from omni_serve.errors import bad_field

MAX_TOKENS_OPTION = "max_tokens_limit"  # the AR stages' option: the largest max_tokens
# the most characters a token is taken to hold: a prompt's characters are capped at its
# stage's token limit times this, before it is tokenized
CHARS_PER_TOKEN = 32
# stage kind -> (its option bounding the tokens of a prompt it reads, the bound where the
# option is None); a source stage of such a kind reads the request's prompt (or chat)
PROMPT_TOKEN_OPTIONS: dict[str, tuple[str, int | None]] = {
    "ar.intake": ("max_prompt_tokens", None),
    "ar.mm_intake": ("max_prompt_tokens", None),
    "speech.thinker": ("max_prompt_tokens", None),
    "speech.voice_intake": ("max_prompt_tokens", None),
    "ar.text_encode": ("max_tokens", None),  # it cuts a longer prompt
    "dit.text_encode": ("max_sequence_length", 512),  # T5's tokens; None: at most 512
}
NEGATIVE_PROMPT_STAGES = {"ar.text_encode", "dit.text_encode"}  # they encode negative_prompt


class TokenLimit(NamedTuple):
    """The largest ``max_tokens`` the pipeline takes, and the stage that declares it."""

    value: int
    stage: str


class CharLimit(NamedTuple):
    """The most characters of a request's text field: ``tokens`` (option ``option`` of
    stage ``stage``) times :data:`CHARS_PER_TOKEN`."""

    chars: int
    tokens: int
    option: str
    stage: str

    def check(self, field: str, chars: int) -> None:
        """A 400 naming ``field`` where its ``chars`` characters are over the limit."""
        if chars > self.chars:
            raise bad_field(
                field,
                f"{chars} characters, over this pipeline's limit of {self.chars} "
                f"({self.tokens} tokens, option {self.option} of stage {self.stage!r}, "
                f"x {CHARS_PER_TOKEN} characters a token)",
            )


class PromptLimits(NamedTuple):
    """The character limits of a request's texts (None: no stage bounds it)."""

    prompt: CharLimit | None = None  # a prompt; each chat message and a whole chat
    negative_prompt: CharLimit | None = None  # an image request's negative_prompt

    def check(self, field: str, chars: int, negative: bool = False) -> None:
        """A 400 naming ``field`` where ``chars`` is over its limit (``negative``: the
        negative prompt's)."""
        limit = self.negative_prompt if negative else self.prompt
        if limit is not None:
            limit.check(field, chars)


NO_PROMPT_LIMITS = PromptLimits()


def _options(spec: Any) -> Any:
    """A stage spec's options as its stage's ``Options`` (defaults filled); None where
    the stage declares no ``Options``."""
    options_type = getattr(load_stage_class(spec.kind), "Options", None)
    return None if options_type is None else msgspec.convert(spec.options, options_type)


def token_limit(stages: Iterable[Any]) -> TokenLimit | None:
    """The smallest ``max_tokens_limit`` among ``stages`` (a config's stage specs) that
    declare one, as the option is given or its default in the stage's ``Options``; None
    where no stage has the option (a pipeline without AR stages)."""
    limits = []
    for spec in stages:
        value = getattr(_options(spec), MAX_TOKENS_OPTION, None)
        if value is not None:
            limits.append(TokenLimit(value, spec.name))
    return min(limits, default=None)


def prompt_limits(stages: Iterable[Any], edges: Iterable[Any]) -> PromptLimits:
    """The character limits of a pipeline's request texts: a prompt (or chat) is held to
    the smallest token limit of the source stages that read it (:data:`PROMPT_TOKEN_OPTIONS`;
    ``edges``: the config's, whose targets are not sources), a negative prompt to that of
    every stage that encodes one, each times :data:`CHARS_PER_TOKEN`."""
    targets = {e.target for e in edges}
    prompt, negative = [], []
    for spec in stages:
        if spec.kind not in PROMPT_TOKEN_OPTIONS:
            continue
        option, otherwise = PROMPT_TOKEN_OPTIONS[spec.kind]
        tokens = getattr(_options(spec), option, None)
        tokens = otherwise if tokens is None else tokens
        if tokens is None:
            continue
        limit = CharLimit(tokens * CHARS_PER_TOKEN, tokens, option, spec.name)
        if spec.name not in targets:
            prompt.append(limit)
        if spec.kind in NEGATIVE_PROMPT_STAGES:
            negative.append(limit)
    return PromptLimits(min(prompt, default=None), min(negative, default=None))


def check_max_tokens(max_tokens: int, limit: TokenLimit | None) -> None:
    """A 400 naming ``max_tokens`` where it is over the pipeline's limit."""
    if limit is not None and max_tokens > limit.value:
        raise bad_field(
            "max_tokens",
            f"{max_tokens} is over this pipeline's limit of {limit.value} "
            f"(option {MAX_TOKENS_OPTION} of stage {limit.stage!r})",
        )
