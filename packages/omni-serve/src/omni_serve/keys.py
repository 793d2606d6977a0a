"""API keys: one (``--api-key``, ``--api-key-file``, ``$OMNI_API_KEY``: named
``default``, no limits of its own) or several from a keys file (``--api-keys-file``), each
named and with its own share of the server: open connections, requests in flight,
queued pipeline requests, the best priority it may ask for, how long its refusals
are held before they are answered, and its weight at ``--max-running-requests``' fair gate.

The file is TOML (``.toml``) or JSON (``.json``)::

    [defaults]          # optional; these are the defaults without it
    max_connections = 64
    max_inflight = 16
    max_queued = 64
    best_priority = 0
    refusal_delay_s = 1.0
    weight = 1

    [[keys]]
    name = "alice"      # in logs and metrics labels (the key never is)
    key = "..."         # at least 32 characters
    max_inflight = 4

It is read strictly: a file that group or others may read, an unknown field, a name twice,
a key twice or too short, a limit that is not a positive integer, a ``best_priority``
above 0, a ``refusal_delay_s`` outside 0..10, a ``weight`` outside 1..1000 is a
:class:`KeysFileError` naming the file and the field (and the line, for a file that
does not parse)."""

from __future__ import annotations

import hmac
import json
import math
import os
import re
import stat
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SINGLE_KEY_NAME = "default"  # the one key of --api-key, --api-key-file, $OMNI_API_KEY
MIN_KEY_CHARS = 32
MAX_FILE_BYTES = 1 << 20
INT64_MIN = -(2**63)
MAX_REFUSAL_DELAY_S = 10.0
MAX_WEIGHT = 1000
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no space: a bearer token
LIMITS = ("max_connections", "max_inflight", "max_queued")
# a key's share where the file gives none (best_priority: the default priority or worse)
# (refusal_delay_s: a client that asks again at once after its 429 waits about as long as
# its Retry-After tells it to)
DEFAULTS: dict[str, float] = {
    "max_connections": 64,
    "max_inflight": 16,
    "max_queued": 64,
    "best_priority": 0,
    "refusal_delay_s": 1.0,
    "weight": 1,
}


class KeysFileError(ValueError):
    """A keys file ``omni serve`` cannot start with."""


@dataclass(frozen=True, eq=False)
class ApiKey:
    """One API key and its share (None: no limit of its own). Compared by identity."""

    name: str
    key: str = field(repr=False)
    max_connections: int | None = None
    """Connections that carried this key, open at once (kept-alive ones included)."""
    max_inflight: int | None = None
    """HTTP requests with this key being answered at once (streams until their end)."""
    max_queued: int | None = None
    """Pipeline requests of this key open at once (``n`` images: ``n``)."""
    best_priority: int | None = None
    """The lowest (best) ``priority`` its requests may ask for (lower runs first)."""
    refusal_delay_s: float = 0.0
    """How long a 429 of this key (over its connections, in flight or queued) is held
    before it is sent: a client that floods past its share waits instead of costing the
    server an answer at once each time. Bounded: every held refusal sits on a connection
    its key's (or its address's) connection cap already counts."""
    weight: int = 1
    """Its weight at the fair gate (``--max-running-requests``): with other keys active,
    its share of the running places is N times its weight over the active keys' weights
    (rounded up). Keys of one weight share equally."""


def identify(keys: Sequence[ApiKey], authorization: str) -> ApiKey | None:
    """The key an ``Authorization: Bearer KEY`` header value carries (None: none of
    ``keys``), compared with every key in constant time (no early exit)."""
    scheme, _, token = authorization.partition(" ")
    bearer = scheme.lower() == "bearer"
    raw = token.strip().encode() if bearer else b""
    found = None
    for k in keys:
        if hmac.compare_digest(raw, k.key.encode()) and found is None:
            found = k
    return found if bearer else None


def load_keys_file(path: str | os.PathLike[str]) -> tuple[ApiKey, ...]:
    """The keys of a keys file (see the module's docstring); KeysFileError names what is
    wrong and where."""
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise KeysFileError(f"{where}: not a regular file")
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise KeysFileError(
                    f"{where}: mode {stat.S_IMODE(st.st_mode):o} lets other users read the "
                    "keys; chmod 600 it"
                )
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise KeysFileError(f"{where}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise KeysFileError(f"{where}: over {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
        suffix = Path(where).suffix.lower()
        if suffix == ".toml":
            doc: Any = tomllib.loads(text)
        elif suffix == ".json":
            doc = json.loads(text)
        else:
            raise KeysFileError(f"{where}: expected a .toml or .json file")
    except UnicodeDecodeError as e:
        raise KeysFileError(f"{where}: not UTF-8 (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise KeysFileError(f"{where}: {e}") from None  # "... (at line 3, column 7)"
    except json.JSONDecodeError as e:
        raise KeysFileError(f"{where}: line {e.lineno}, column {e.colno}: {e.msg}") from None
    return parse_keys(doc, where)


def parse_keys(doc: Any, where: str = "keys file") -> tuple[ApiKey, ...]:
    """The keys of a parsed keys file ``doc``; KeysFileError names the field."""
    if not isinstance(doc, dict):
        raise KeysFileError(f"{where}: expected a table with 'keys'")
    _no_unknown(doc, {"defaults", "keys"}, where, "")
    defaults = dict(DEFAULTS)
    given = doc.get("defaults", {})
    if not isinstance(given, dict):
        raise KeysFileError(f"{where}: defaults: expected a table")
    _no_unknown(given, set(DEFAULTS), where, "defaults.")
    for name, value in given.items():
        defaults[name] = _share(value, name, where, f"defaults.{name}")
    entries = doc.get("keys")
    if not isinstance(entries, list) or not entries:
        raise KeysFileError(f"{where}: keys: expected a list of at least one key")
    out: list[ApiKey] = []
    names: dict[str, str] = {}
    secrets: dict[str, str] = {}
    for i, entry in enumerate(entries):
        at = f"keys[{i}]"
        if not isinstance(entry, dict):
            raise KeysFileError(f"{where}: {at}: expected a table")
        _no_unknown(entry, {"name", "key", *DEFAULTS}, where, f"{at}.")
        name = entry.get("name")
        if not (isinstance(name, str) and NAME.fullmatch(name)):
            raise KeysFileError(
                f"{where}: {at}.name: expected 1-64 of A-Z a-z 0-9 . _ - (not first: . _ -)"
            )
        at = f"{at} ({name!r})"
        if name in names:
            raise KeysFileError(f"{where}: {at}.name: also the name of {names[name]}")
        key = entry.get("key")
        if not (isinstance(key, str) and len(key) >= MIN_KEY_CHARS and KEY.fullmatch(key)):
            raise KeysFileError(
                f"{where}: {at}.key: expected at least {MIN_KEY_CHARS} printable ASCII "
                "characters without spaces (python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))')"
            )
        if key in secrets:
            raise KeysFileError(f"{where}: {at}.key: the same key as {secrets[key]}")
        names[name] = secrets[key] = at
        shares = {
            n: _share(entry[n], n, where, f"{at}.{n}") if n in entry else defaults[n]
            for n in DEFAULTS
        }
        out.append(ApiKey(name, key, **shares))  # type: ignore[arg-type]
    return tuple(out)


def _no_unknown(table: dict[str, Any], known: set[str], where: str, prefix: str) -> None:
    for name in table:
        if name not in known:
            raise KeysFileError(
                f"{where}: {prefix}{name}: unknown field (expected {', '.join(sorted(known))})"
            )


def _share(value: Any, name: str, where: str, at: str) -> float:
    """A limit (a positive integer), ``best_priority`` (an integer in -2^63..0),
    ``refusal_delay_s`` (seconds in 0..MAX_REFUSAL_DELAY_S) or ``weight`` (an integer in
    1..MAX_WEIGHT)."""
    if name == "refusal_delay_s":
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isfinite(value) and 0 <= value <= MAX_REFUSAL_DELAY_S:
            return float(value)
        raise KeysFileError(
            f"{where}: {at}: expected seconds in 0..{MAX_REFUSAL_DELAY_S:g}, got {value!r}"
        )
    if isinstance(value, int) and not isinstance(value, bool):
        if name == "weight" and 1 <= value <= MAX_WEIGHT:
            return value
        if name == "best_priority" and INT64_MIN <= value <= 0:
            return value
        if name in LIMITS and value >= 1:
            return value
    if name == "best_priority":
        want = f"an integer in {INT64_MIN}..0 (lower runs first; every key may ask for 0)"
    elif name == "weight":
        want = f"an integer in 1..{MAX_WEIGHT}"
    else:
        want = "a positive integer"
    raise KeysFileError(f"{where}: {at}: expected {want}, got {value!r}")
