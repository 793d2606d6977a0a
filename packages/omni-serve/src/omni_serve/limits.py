"""The limits a pipeline's stages declare, which the server checks before a request
reaches them: each limit is set once (a stage option in the pipeline's config), and a
request over it is a 400 naming the field before the pipeline is asked."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import msgspec
from omni_core.registry import load_stage_class

from omni_serve.errors import bad_field

MAX_TOKENS_OPTION = "max_tokens_limit"  # the AR stages' option: the largest max_tokens


class TokenLimit(NamedTuple):
    """The largest ``max_tokens`` the pipeline takes, and the stage that declares it."""

    value: int
    stage: str


def token_limit(stages: Iterable[Any]) -> TokenLimit | None:
    """The smallest ``max_tokens_limit`` among ``stages`` (a config's stage specs) that
    declare one, as the option is given or its default in the stage's ``Options``; None
    where no stage has the option (a pipeline without AR stages)."""
    limits = []
    for spec in stages:
        options_type = getattr(load_stage_class(spec.kind), "Options", None)
        if options_type is None:
            continue
        value = getattr(msgspec.convert(spec.options, options_type), MAX_TOKENS_OPTION, None)
        if value is not None:
            limits.append(TokenLimit(value, spec.name))
    return min(limits, default=None)


def check_max_tokens(max_tokens: int, limit: TokenLimit | None) -> None:
    """A 400 naming ``max_tokens`` where it is over the pipeline's limit."""
    if limit is not None and max_tokens > limit.value:
        raise bad_field(
            "max_tokens",
            f"{max_tokens} is over this pipeline's limit of {limit.value} "
            f"(option {MAX_TOKENS_OPTION} of stage {limit.stage!r})",
        )
