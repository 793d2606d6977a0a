"""MkDocs hook: Sphinx roles in docstrings, as plain code in the API reference.

omni's docstrings cross-reference with reStructuredText roles (:class:`Stage`,
:meth:`Stage.load`), which mkdocstrings renders as text: ":class:" followed by the code.
This drops the role and keeps the code; as in Sphinx, :class:`~pkg.mod.Name` shows
``Name`` alone.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj):<code>(?:~(?:[\w.]+\.)?)?")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return ROLE.sub("<code>", html)
