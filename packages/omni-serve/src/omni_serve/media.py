"""Remote chat images (``--allow-remote-images``): the server fetches each http(s) URL
and passes the image on as a base64 data URL, so no stage ever touches the network and
the multimodal intake reads every image the same way. Off by default: with it on, a
client can make the server fetch any URL it can reach (internal addresses included)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from omni_serve.errors import APIError, bad_field
from omni_serve.openai_api import REMOTE

FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3


def remote_parts(request: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(``messages[i].content[j].image_url``, the part's ``image_url``) of each image
    part of a pipeline request whose URL is http(s)."""
    out = []
    for i, m in enumerate(request.get("messages") or []):
        if isinstance(m["content"], list):
            for j, part in enumerate(m["content"]):
                url = part.get("image_url", {}).get("url", "")
                if part["type"] == "image_url" and url.startswith(REMOTE):
                    out.append((f"messages[{i}].content[{j}].image_url", part["image_url"]))
    return out


async def fetch_remote(request: dict[str, Any], max_bytes: int) -> None:
    """Replace, in place, each http(s) image URL of ``request`` by a data URL of what it
    answers (at most ``max_bytes``, within :data:`FETCH_TIMEOUT_S`); a URL that cannot
    be fetched is a 400 naming the part."""
    parts = remote_parts(request)
    if not parts:
        return
    import httpx

    async with httpx.AsyncClient(
        follow_redirects=True, max_redirects=MAX_REDIRECTS, timeout=FETCH_TIMEOUT_S
    ) as client:
        urls = await asyncio.gather(*(_fetch(client, w, p["url"], max_bytes) for w, p in parts))
    for (_, part), url in zip(parts, urls, strict=True):
        part["url"] = url


async def _fetch(client: Any, where: str, url: str, max_bytes: int) -> str:
    import httpx

    shown = url if len(url) <= 200 else url[:200] + "..."
    try:
        async with client.stream("GET", url) as r:
            if r.status_code != 200:
                raise bad_field(where, f"fetching {shown} answered HTTP {r.status_code}")
            data = bytearray()
            async for chunk in r.aiter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise bad_field(
                        where, f"the image at {shown} is over {max_bytes} bytes (--max-body-bytes)"
                    )
            mime = r.headers.get("content-type", "").split(";")[0].strip()
    except APIError:
        raise
    except httpx.HTTPError as e:
        raise bad_field(where, f"cannot fetch {shown}: {type(e).__name__}: {e}") from None
    mime = mime if mime.startswith("image/") else "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(bytes(data)).decode()}"
