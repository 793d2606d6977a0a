"""Structured logs: every record may carry ``request_id``, ``stage`` and ``sequence``.

Pass them as ``extra=`` (``log.error("...", extra={"stage": name, "request_id": rid})``).
``OMNI_LOG_FORMAT=json`` writes one JSON object per line (for log shippers); the default
text format appends the fields as ``key=value``. ``OMNI_LOG_LEVEL`` sets the level.
"""

from __future__ import annotations

import json
import logging
import os
import sys

FIELDS = ("request_id", "stage", "sequence")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, and the request fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...`` (the request fields present)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = [
            f"{k}={getattr(record, k)}" for k in FIELDS if getattr(record, k, None) is not None
        ]
        if not fields:
            return text
        head, nl, rest = text.partition("\n")  # keep a traceback below the fields
        return f"{head} {' '.join(fields)}{nl}{rest}"


def configure_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Root logging to stderr in the format asked for (default: the environment's)."""
    fmt = (fmt or os.environ.get("OMNI_LOG_FORMAT") or "text").lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"log format: expected 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("OMNI_LOG_LEVEL") or "WARNING").upper())
