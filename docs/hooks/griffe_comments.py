"""Griffe extension (mkdocstrings): a field's ``#`` comment as its documentation.

Many option structs document their fields with comments rather than attribute
docstrings::

    class DecodeOptions(ModelOptions, kw_only=True):
        # detokenize in the decode loop itself (no postprocess stage)
        inline_detokenize: bool = False
        max_segment_tokens: int = 8  # tokens per segment at most

For an attribute declared in a class body (not ``self.x = ...`` in a method) that has
no docstring, this takes the block of full-line comments right above it (no blank line
between) and the comment at the end of its line(s), and makes them its docstring in the
API reference. Directives (``# type:``, ``# noqa``,
``# pragma``, ``# fmt:``) are left out. A real docstring always wins. Module-level
attributes take only the comment block above them. Nothing is imported: the source is
read as griffe reads it. Configured in mkdocs.yml (``extensions:`` of the python
handler).
"""

from __future__ import annotations

import ast
import io
import tokenize
from functools import cache
from pathlib import Path
from typing import Any

import griffe

DIRECTIVES = ("type:", "noqa", "pragma", "fmt:", "pyright:", "mypy:")


@cache
def _comments(path: str) -> tuple[dict[int, str], frozenset[int], frozenset[int]]:
    """({line: comment text}, the lines holding only a comment, blank lines) of a file."""
    text = Path(path).read_text(encoding="utf-8")
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string.lstrip("#").strip()
            elif tok.type not in (
                tokenize.NL,
                tokenize.NEWLINE,
                tokenize.INDENT,
                tokenize.DEDENT,
                tokenize.ENDMARKER,
            ):
                code_lines.update(range(tok.start[0], tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        return {}, frozenset(), frozenset()
    only = frozenset(n for n in comments if n not in code_lines)
    blank = frozenset(n for n, line in enumerate(text.splitlines(), 1) if not line.strip())
    return comments, only, blank


def _usable(comment: str) -> bool:
    return bool(comment) and not comment.startswith(DIRECTIVES)


class CommentDocs(griffe.Extension):
    """Attribute comments as attribute docstrings (see the module docstring)."""

    def on_attribute_instance(
        self, *, node: ast.AST | griffe.ObjectNode, attr: griffe.Attribute, **kwargs: Any
    ) -> None:
        if attr.docstring is not None or attr.lineno is None:
            return
        # only what the class body declares: `self.x = ...` in a method is an
        # implementation detail, whatever its comment says
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        if any(isinstance(t, ast.Attribute) for t in targets):
            return
        parent = attr.parent
        if parent is None or not (parent.is_class or parent.is_module):
            return
        try:
            path = str(attr.filepath)
        except Exception:  # noqa: BLE001 - no file (a builtin): nothing to read
            return
        if not path.endswith(".py"):
            return
        comments, only, blank = _comments(path)
        end = attr.endlineno or attr.lineno
        above: list[str] = []
        line = attr.lineno - 1
        while line in only and line not in blank:
            above.insert(0, comments[line])
            line -= 1
        trailing = [
            comments[n] for n in range(attr.lineno, end + 1) if n in comments and n not in only
        ]
        parts = [c for c in above if _usable(c)]
        if parent.is_class:
            parts += [c for c in trailing if _usable(c)]
        if not parts:
            return
        text = " ".join(parts)
        attr.docstring = griffe.Docstring(text, lineno=attr.lineno, endlineno=end, parent=attr)
