"""Structured generation: what a request may constrain its output to, and the grammar
that holds it there while tokens are sampled.

A constraint is one of vLLM's ``structured_outputs`` kinds, spelled as vLLM spells them:
``{"json": schema}``, ``{"json_object": true}``, ``{"regex": pattern}``, ``{"choice":
[str, ...]}`` or ``{"grammar": ebnf_or_lark}``. OpenAI's ``response_format``
(``json_object``, ``json_schema``) maps onto the first two. :func:`check_constraint`
validates one where it enters (intake, a stage's options) without a tokenizer, so a bad
schema, regex or grammar is an error naming the field before any engine sees it.

Both engines sample under xgrammar with the same settings (JSON without free whitespace,
``,``/``:`` separators), so a constraint allows the same tokens on both:

* vLLM runs its own structured outputs (``backend: xgrammar``) wherever it samples a
  request from its first token (``ar.generate``, ``ar.prefill``'s first token, a prompt
  ``ar.decode`` prefills itself);
* the transformers engine, and vLLM's decode of a handed-off request, mask each step's
  logits with a :class:`Matcher` of :class:`Grammars`; a decode rebuilds the request's
  matcher from the constraint and the tokens sampled before it (prefill's first token),
  which is the whole of the grammar's state that crosses the handoff.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from omni_ar.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 65536  # a schema (as JSON), regex, grammar or the choices, at most
MAX_CHOICES = 1024  # a choice's alternatives, at most
MAX_JSON_DEPTH = 64  # a schema's nesting, at most
CACHE_BYTES = 64 << 20  # compiled grammars kept per engine, at most (least recently used go)
# the JSON grammar's separators: no free whitespace (a small model pads until
# max_tokens where the grammar lets it), as the vLLM engine sets its backend
JSON_SEPARATORS = (",", ":")
# string formats xgrammar's JSON-schema converter enforces (others it would ignore)
_FORMATS = {
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
}  # fmt: skip


class ConstraintError(RequestError):
    """A constraint that is malformed, or that the grammar backend cannot hold to."""


def from_response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """The constraint OpenAI's ``response_format`` (checked already) asks for, or None
    (``text``, or none given)."""
    kind = (fmt or {}).get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        return {"json": fmt["json_schema"]["schema"]}  # type: ignore[index]
    return None


def check_constraint(spec: Any, where: str = "structured_outputs") -> dict[str, Any]:
    """``spec`` normalized (a ``json`` schema given as a string parsed to an object), or a
    ConstraintError naming ``where`` and the key at fault. The schema, regex or grammar
    is parsed by xgrammar (without a tokenizer: no model is needed here)."""
    if not isinstance(spec, dict):
        raise ConstraintError(f"field {where!r}: expected an object with one of {list(KINDS)}")
    unknown = sorted(set(spec) - set(KINDS))
    if unknown:
        raise ConstraintError(
            f"field '{where}.{unknown[0]}': unknown; expected one of {list(KINDS)}"
        )
    given = [k for k in KINDS if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise ConstraintError(
            f"field {where!r}: give exactly one of {list(KINDS)}, got {given or 'none'}"
        )
    kind = given[0]
    value = spec[kind]
    at = f"{where}.{kind}"
    if kind == "json_object":
        if value is not True:
            raise ConstraintError(f"field {at!r}: expected true")
        return {"json_object": True}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ConstraintError(f"field {at!r}: expected a non-empty list of strings")
        if len(value) > MAX_CHOICES:
            raise ConstraintError(f"field {at!r}: at most {MAX_CHOICES} choices, got {len(value)}")
        if any(not c for c in value):
            raise ConstraintError(f"field {at!r}: a choice must not be empty")
        _check_size(at, sum(len(c) for c in value))
        _parse(at, "ebnf", choice_grammar(value))
        return {"choice": list(value)}
    if kind == "json":
        schema = value
        if isinstance(value, str):
            _check_size(at, len(value))
            try:
                schema = json.loads(value)
            except (ValueError, RecursionError) as e:
                raise ConstraintError(f"field {at!r}: not JSON: {e}") from None
        return {"json": check_schema(schema, at)}
    if not isinstance(value, str) or not value:
        raise ConstraintError(f"field {at!r}: expected a non-empty string")
    _check_size(at, len(value))
    if "\x00" in value:
        raise ConstraintError(f"field {at!r}: must not contain a NUL character")
    if kind == "regex":
        _parse(at, "regex", value)
        return {"regex": value}
    _parse(at, grammar_syntax(value), value)
    return {"grammar": value}


def check_schema(schema: Any, at: str) -> dict[str, Any]:
    """``schema`` if xgrammar can hold a JSON output to it, else a ConstraintError naming
    ``at`` (and, for a keyword it would ignore, the keyword's place)."""
    if not isinstance(schema, dict):
        raise ConstraintError(f"field {at!r}: expected a JSON Schema object")
    _check_size(at, len(json.dumps(schema)))
    _check_depth(at, schema)
    unsupported = unsupported_schema_feature(schema)
    if unsupported:
        raise ConstraintError(
            f"field {at!r}: {unsupported} is not supported by the grammar backend"
        )
    _parse(at, "json", schema)
    return schema


def _check_size(at: str, n: int) -> None:
    if n > MAX_SPEC_CHARS:
        raise ConstraintError(f"field {at!r}: {n} characters, over {MAX_SPEC_CHARS}")


def _check_depth(at: str, schema: Any) -> None:
    """A schema nested at most :data:`MAX_JSON_DEPTH` deep (the converter recurses)."""
    todo: list[tuple[Any, int]] = [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise ConstraintError(f"field {at!r}: nested deeper than {MAX_JSON_DEPTH}")
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        todo.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def unsupported_schema_feature(schema: dict[str, Any]) -> str | None:
    """The first keyword of ``schema`` that xgrammar's converter would ignore (so the
    output would not be held to it), named with its place, or None."""
    todo: list[tuple[Any, str]] = [(schema, "$")]
    while todo:
        node, path = todo.pop()
        if isinstance(node, list):
            todo.extend((c, f"{path}[{i}]") for i, c in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
        if types & {"integer", "number"} and "multipleOf" in node:
            return f"'multipleOf' at {path}"
        if "array" in types:
            for key in ("uniqueItems", "contains", "minContains", "maxContains"):
                if key in node:
                    return f"{key!r} at {path}"
        if "string" in types and "format" in node and node["format"] not in _FORMATS:
            return f"format {str(node['format'])[:40]!r} at {path}"
        if "string" in types and _bounded_pattern(node):
            return f"'pattern' or 'format' with a length bound at {path}"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"'allOf' with more than one schema at {path}"
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and ("properties" in node or len(patterns) > 1):
            return f"'patternProperties' beside 'properties' or another pattern at {path}"
        names = node.get("propertyNames")
        if "propertyNames" in node and (
            {"properties", "patternProperties"} & set(node)
            or node.get("unevaluatedProperties", True) is not True
            or (isinstance(names, dict) and _bounded_pattern(names))
        ):
            return f"'propertyNames' with other property keywords at {path}"
        todo.extend((v, f"{path}.{k}") for k, v in node.items() if isinstance(v, (dict, list)))
    return None


def _bounded_pattern(node: dict[str, Any]) -> bool:
    return ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node)


def grammar_syntax(grammar: str) -> str:
    """``"ebnf"`` where a line defines a rule with ``::=`` (xgrammar's GBNF-style EBNF),
    else ``"lark"`` (as vLLM tells them apart)."""
    for line in grammar.splitlines():
        if "::=" in re.sub(r"(#|//).*$", "", line):
            return "ebnf"
    return "lark"


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices``, each exactly."""
    quoted = (json.dumps(c, ensure_ascii=False) for c in choices)
    return "root ::= " + " | ".join(quoted)


_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _backend_message(e: Exception) -> str:
    """xgrammar's error without its log prefix (time, source file), first line only."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _XGRAMMAR_PREFIX.sub("", text)[:300]


def _parse(at: str, syntax: str, spec: Any) -> Any:
    """xgrammar's grammar of ``spec`` (no tokenizer), or a ConstraintError naming ``at``."""
    import xgrammar as xgr

    try:
        if syntax == "json":
            return xgr.Grammar.from_json_schema(
                json.dumps(spec), any_whitespace=False, separators=JSON_SEPARATORS
            )
        if syntax == "regex":
            return xgr.Grammar.from_regex(spec)
        if syntax == "lark":
            return xgr.Grammar.from_lark(spec)
        return xgr.Grammar.from_ebnf(spec)
    except Exception as e:  # xgrammar raises RuntimeError (and others) for bad specs
        raise ConstraintError(f"field {at!r}: {_backend_message(e)}") from None


class Matcher:
    """One request's place in its grammar: :meth:`mask` forbids the tokens the grammar
    does not allow next, :meth:`accept` advances it by the token sampled."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.matcher = matcher
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: Any) -> None:
        """``logits`` (one row, float, on the CPU or a GPU) with the forbidden tokens at
        -inf, in place. A finished grammar (only with ``ignore_eos``) masks nothing."""
        import xgrammar as xgr

        if self.matcher.is_terminated():
            return
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = logits.view(1, -1)
        xgr.apply_token_bitmask_inplace(row, self.bitmask.to(logits.device))

    def accept(self, token: int) -> None:
        """The grammar advanced by ``token``; a token it forbids is an error (a masked
        sampler never picks one)."""
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token} it did not mask")


class Grammars:
    """Constraints compiled for one tokenizer (cached per constraint), and matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int] = ()) -> None:
        """``vocab_size``: the model's logits' width (at least the tokenizer's);
        ``stop_ids``: the model's end-of-sequence ids, allowed where the grammar ends
        beside the tokenizer's own."""
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.stop_ids = sorted({*self.info.stop_token_ids, *stop_ids})
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(
            self.info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_BYTES
        )

    def compile(self, constraint: dict[str, Any]) -> Any:
        """xgrammar's compiled grammar of a checked constraint (see :func:`check_constraint`)."""
        (kind, value), *_ = constraint.items()
        c = self.compiler
        if kind == "json_object":
            return c.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS
            )
        if kind == "json":
            return c.compile_json_schema(
                json.dumps(value), any_whitespace=False, separators=JSON_SEPARATORS
            )
        if kind == "regex":
            return c.compile_regex(value)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(value))
        if grammar_syntax(value) == "lark":
            import xgrammar as xgr

            return c.compile_grammar(xgr.Grammar.from_lark(value))
        return c.compile_grammar(value)

    def matcher(
        self,
        constraint: dict[str, Any],
        sampled: Iterable[int] = (),
        field: str = "structured_outputs",
    ) -> Matcher:
        """A matcher at the start of ``constraint``'s grammar, advanced by the tokens the
        request already ``sampled`` (a decode continuing a prefill's request); a
        ConstraintError naming ``field`` (the request's, whence the constraint came) where
        the grammar cannot be compiled for this tokenizer."""
        import xgrammar as xgr

        try:
            compiled = self.compile(constraint)
        except Exception as e:
            kind = next(iter(constraint))
            at = f"{field}.{kind}" if field == "structured_outputs" else field
            raise ConstraintError(f"field {at!r}: {_backend_message(e)}") from None
        m = Matcher(
            xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_ids), self.vocab_size
        )
        for tok in sampled:
            m.accept(tok)
        return m
