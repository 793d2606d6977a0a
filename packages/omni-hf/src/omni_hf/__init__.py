"""Hugging Face helpers both stage families use (``omni-ar-stages``, ``omni-dit-stages``).

Environment settings for the Hugging Face libraries inside a worker (quiet logs, no
network for weights) and the wording of hub errors. Nothing here imports a Hugging Face
library: call :func:`quiet_hub` or :func:`quiet_offline` *before* importing them, since
they read these variables at import time. ``omni-core`` knows nothing of Hugging Face;
the generic model cache (``omni_core.models.model_cache``) is the core's.
"""

from __future__ import annotations

import os

__all__ = [
    "OFFLINE_MARKER",
    "hub_cache",
    "hub_failure",
    "hub_offline",
    "looks_like_hub_id",
    "quiet_hub",
    "quiet_offline",
]

# set next to HF_HUB_OFFLINE when quiet_offline() set it (not the user), so that a later
# hub error in the same process can say who made it offline
OFFLINE_MARKER = "OMNI_SET_HF_HUB_OFFLINE"

_TRUE = {"1", "ON", "YES", "TRUE"}


def quiet_hub() -> None:
    """Hugging Face libraries in a worker: no progress bars or warnings in its log. Call
    before importing them (a variable the user set is kept)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


def quiet_offline() -> None:
    """:func:`quiet_hub`, and never a network call for weights (for stages that load only
    local or embedded models). ``HF_HUB_OFFLINE`` set by the user is kept as it is."""
    if "HF_HUB_OFFLINE" not in os.environ:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ[OFFLINE_MARKER] = "1"
    quiet_hub()


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is on (``1``, ``on``, ``yes``, ``true``), as the hub
    library reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def hub_cache() -> str:
    """Where the Hugging Face cache is, for messages: ``HF_HUB_CACHE``, else ``HF_HOME``,
    else the library's default."""
    return os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"


def looks_like_hub_id(model: str) -> bool:
    """``org/name``: two non-empty parts, not a relative or home path."""
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def hub_failure(model: str, error: BaseException) -> str:
    """The message for hub id ``model`` that could not be fetched or found in the cache:
    which cache, whether offline and who set it, and the library's own error."""
    if hub_offline():
        who = (
            " (set by omni's AR stages loaded in this process: fetch it first, or run "
            "with mrs.enabled: true)"
            if os.environ.get(OFFLINE_MARKER)
            else ""
        )
        why = f"not usable from the Hugging Face cache and HF_HUB_OFFLINE is set{who}"
    else:
        why = "download failed"
    return (
        f"model {model!r} (no local directory of that name; taken as a Hugging Face id, "
        f"cache {hub_cache()}): {why}: {type(error).__name__}: {error}"
    )
