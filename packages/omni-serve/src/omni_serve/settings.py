"""What ``omni serve`` lets an operator set (the defaults are the safe ones), checked once
at startup: a setting that cannot work is an error there, never a quiet default."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a timeout past a week is a mistake, not a wish
# room for a chat with a few images as base64 data URLs (4/3 of their encoded size)
MAX_BODY_BYTES = 20 << 20


class SettingsError(ValueError):
    """A setting ``omni serve`` cannot start with."""


def check_timeout(value: float | None, what: str) -> None:
    """``value`` is None or a finite number of seconds in (0, MAX_TIMEOUT_S]."""
    if value is None:
        return
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise SettingsError(f"{what}: expected 0 < seconds <= {MAX_TIMEOUT_S:g}, got {value}")


@dataclass
class ServeSettings:
    """The server's settings; ``ServeSettings(...)`` refuses ones that cannot work."""

    model_name: str
    """The model name the OpenAI endpoints answer to and ``/v1/models`` lists."""
    api_key: str | None = None
    """Every endpoint but ``/health`` (and the page) needs it as ``Authorization:
    Bearer KEY``; None: no key."""
    request_timeout_s: float | None = None
    """The cap of a request's timeout: a body's ``timeout_s`` may lower it, never raise
    it (None: the pipeline config's ``request_timeout_s``)."""
    max_body_bytes: int = MAX_BODY_BYTES
    """The largest request body, and the limit of a fetched remote image."""
    max_tokens: int = 4096
    """The largest ``max_tokens`` a text request may ask for."""
    max_image_pixels: int = 1024 * 1024
    """The largest image (width x height) an image request may ask for (``size``)."""
    max_images: int = 4
    """The most images one image request may ask for (``n``)."""
    allowed_hosts: tuple[str, ...] | None = None
    """``Host`` header names answered (any port); None: every ``Host`` (see
    ``omni_serve.middleware``)."""
    cors_origins: tuple[str, ...] = ()
    """Origins a browser may call from (none: no CORS headers at all)."""
    allow_remote_images: bool = False
    """Chat image parts with http(s) URLs are fetched by the server (off: only data
    URLs)."""

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise SettingsError(
                "the API key is empty (an empty --api-key or OMNI_API_KEY would leave the "
                "server open while looking guarded): set a key, or unset OMNI_API_KEY"
            )
        check_timeout(self.request_timeout_s, "--request-timeout")
        for name in ("max_body_bytes", "max_tokens", "max_image_pixels", "max_images"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name}: expected a positive number")
