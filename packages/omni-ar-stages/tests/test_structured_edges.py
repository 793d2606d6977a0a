"""Structured generation at its edges, without a model: every check of a constraint at its
limit and one past it, each schema keyword the grammar backend would ignore, and the
grammars and matchers on a tokenizer of single characters (one token per printable ASCII
character, and an end token), so that what a constraint allows is read character by
character."""

from __future__ import annotations

import json
import re

import pytest
from omni_ar import structured
from omni_ar.structured import (
    CACHE_BYTES,
    MAX_CHOICES,
    MAX_JSON_DEPTH,
    MAX_SPEC_CHARS,
    ConstraintError,
    Grammars,
    _backend_message,
    _bounded_pattern,
    _check_depth,
    _parse,
    check_constraint,
    check_schema,
    choice_grammar,
    from_response_format,
    grammar_syntax,
    unsupported_schema_feature,
)

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

WHERE = "structured_outputs"


def refused(spec, where: str = WHERE) -> str:
    with pytest.raises(ConstraintError) as e:
        check_constraint(spec, where)
    return str(e.value)


# -- response_format ---------------------------------------------------------------------


def test_response_format_maps_onto_json_object_and_json_schema_only():
    assert from_response_format(None) is None
    assert from_response_format({}) is None
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == {"json_object": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
    assert from_response_format(fmt) == {"json": {"type": "integer"}}


# -- the constraint's shape ----------------------------------------------------------------


def test_a_constraint_is_an_object_with_known_kinds_only():
    assert refused("regex") == (
        f"field 'structured_outputs': expected an object with one of {list(structured.KINDS)}"
    )
    assert refused({"zz": 1, "xml": 1, "regex": "a"}, "opts.c").startswith(
        "field 'opts.c.xml': unknown; expected one of"
    )  # the first unknown key, sorted


def test_exactly_one_kind_is_given_none_and_false_are_not_given():
    assert check_constraint({"regex": None, "choice": ["a"]}) == {"choice": ["a"]}
    assert check_constraint({"json_object": False, "regex": "a+"}) == {"regex": "a+"}
    assert check_constraint({"json_object": True, "grammar": None}) == {"json_object": True}
    assert refused({"regex": None, "json_object": False}).endswith("got none")
    assert refused({"regex": "a", "choice": ["b"]}).endswith("got ['regex', 'choice']")
    assert refused({"json_object": 1}) == "field 'structured_outputs.json_object': expected true"


@pytest.mark.parametrize("value", ["a", [], ["a", 2], ("a",), {"a": 1}])
def test_choices_are_a_non_empty_list_of_strings(value):
    assert "expected a non-empty list of strings" in refused({"choice": value})


def test_choices_at_their_limits_and_one_past():
    assert MAX_CHOICES == 1024  # the documented limit (docs/structured-output.md)
    many = [f"c{i}" for i in range(MAX_CHOICES)]
    assert check_constraint({"choice": many}) == {"choice": many}
    assert refused({"choice": [*many, "x"]}).endswith(
        f"at most {MAX_CHOICES} choices, got {MAX_CHOICES + 1}"
    )
    assert refused({"choice": ["a", ""]}).endswith("a choice must not be empty")
    # their characters together: at the limit, and one past
    long = ["a" * (MAX_SPEC_CHARS // 2), "b" * (MAX_SPEC_CHARS // 2)]
    assert check_constraint({"choice": long}) == {"choice": long}
    over = [*long[:1], "b" * (MAX_SPEC_CHARS // 2 + 1)]
    assert refused({"choice": over}).endswith(f"{MAX_SPEC_CHARS + 1} characters, over 65536")


def test_the_choices_returned_are_a_copy():
    choices = ["yes", "no"]
    out = check_constraint({"choice": choices})["choice"]
    assert out == choices and out is not choices


@pytest.mark.parametrize("kind", ["regex", "grammar"])
@pytest.mark.parametrize("value", ["", None, 3, ["a"]])
def test_a_regex_or_grammar_is_a_non_empty_string(kind, value):
    spec = {kind: value}
    if value is None:
        assert refused(spec).endswith("got none")
    else:
        assert refused(spec) == f"field 'structured_outputs.{kind}': expected a non-empty string"


@pytest.mark.parametrize("kind", ["regex", "grammar"])
def test_a_regex_or_grammar_at_the_size_limit_and_one_past(kind):
    if kind == "regex":
        at = "a" * MAX_SPEC_CHARS
    else:
        at = 'root ::= "a"' + " " * (MAX_SPEC_CHARS - len('root ::= "a"'))
    assert check_constraint({kind: at}) == {kind: at}
    assert refused({kind: at + " "}).endswith(f"{MAX_SPEC_CHARS + 1} characters, over 65536")
    assert refused({kind: "a\x00b"}).endswith("must not contain a NUL character")


def test_a_json_schema_as_a_string_is_parsed_and_held_to_the_size_limit():
    schema = {"type": "integer"}
    assert check_constraint({"json": json.dumps(schema)}) == {"json": schema}
    padded = json.dumps(schema) + " " * (MAX_SPEC_CHARS - len(json.dumps(schema)))
    assert check_constraint({"json": padded}) == {"json": schema}
    assert refused({"json": padded + " "}).endswith(f"{MAX_SPEC_CHARS + 1} characters, over 65536")
    assert "not JSON: Expecting" in refused({"json": "{not json"})
    # nested past what the parser recurses: a RecursionError, named the same way
    assert "not JSON: maximum recursion depth" in refused({"json": "[" * MAX_SPEC_CHARS})


def test_a_schema_object_is_checked_at_its_size_limit_and_one_past():
    def sized(n: int) -> dict:
        base = {"type": "string", "description": ""}
        return {**base, "description": "d" * (n - len(json.dumps(base)))}

    assert check_schema(sized(MAX_SPEC_CHARS), "at") == sized(MAX_SPEC_CHARS)
    with pytest.raises(ConstraintError, match=r"^field 'at': 65537 characters, over 65536$"):
        check_schema(sized(MAX_SPEC_CHARS + 1), "at")
    with pytest.raises(ConstraintError, match=r"^field 'at': expected a JSON Schema object$"):
        check_schema([{"type": "string"}], "at")


def nested(depth: int, leaf=None, via: str = "dict"):
    """A schema ``depth`` containers deep (dicts, or lists inside a dict), a scalar at the
    bottom (not a container: not counted)."""
    node = {"type": "string"} if leaf is None else leaf
    for _ in range(depth - 1):
        node = {"anyOf": [node]} if via == "list" else {"items": node}
    return node


def test_a_schema_is_nested_at_most_64_deep_scalars_not_counted():
    _check_depth("at", nested(MAX_JSON_DEPTH))
    with pytest.raises(ConstraintError, match=r"^field 'at': nested deeper than 64$"):
        _check_depth("at", nested(MAX_JSON_DEPTH + 1))
    # a list counts as one level as a dict does: {"anyOf": [...]} is two
    _check_depth("at", {"x": nested(MAX_JSON_DEPTH // 2, via="list")})  # 1 + 1 + 2 * 31
    with pytest.raises(ConstraintError):
        _check_depth("at", nested(MAX_JSON_DEPTH // 2 + 1, via="list"))  # 1 + 2 * 32
    assert "nested deeper than 64" in refused({"json": nested(MAX_JSON_DEPTH + 1)})


def test_a_deep_schema_is_refused_before_its_keywords_are_looked_at():
    deep = nested(MAX_JSON_DEPTH + 1, leaf={"type": "integer", "multipleOf": 2})
    assert refused({"json": deep}).endswith("nested deeper than 64")


# -- schema keywords the backend would ignore --------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "found"),
    [
        ({"type": "integer", "multipleOf": 2}, "'multipleOf' at $"),
        ({"type": "number", "multipleOf": 2}, "'multipleOf' at $"),
        ({"type": ["string", "integer"], "multipleOf": 2}, "'multipleOf' at $"),
        ({"type": "string", "multipleOf": 2}, None),
        ({"multipleOf": 2}, None),  # no type: nothing it applies to
        ({"type": 3, "multipleOf": 2}, None),
        ({"type": "array", "uniqueItems": True}, "'uniqueItems' at $"),
        ({"type": "array", "contains": {}}, "'contains' at $"),
        ({"type": "array", "minContains": 1}, "'minContains' at $"),
        ({"type": ["array"], "maxContains": 1}, "'maxContains' at $"),
        ({"type": "object", "uniqueItems": True}, None),
        ({"type": "array", "items": {"type": "string"}}, None),
        ({"type": "string", "format": "color"}, "format 'color' at $"),
        ({"type": "string", "format": "f" * 50}, f"format {'f' * 40!r} at $"),
        ({"type": "string", "format": "email"}, None),
        ({"type": "integer", "format": "color"}, None),
        ({"type": "string", "pattern": "a+", "minLength": 1}, "'pattern' or 'format'"),
        ({"type": "string", "format": "email", "maxLength": 9}, "'pattern' or 'format'"),
        ({"type": "string", "pattern": "a+"}, None),
        ({"type": "string", "minLength": 1, "maxLength": 3}, None),
        ({"type": "integer", "pattern": "a", "minLength": 1}, None),
        ({"allOf": [{"type": "string"}, {"minLength": 1}]}, "'allOf' with more than one"),
        ({"allOf": [{"type": "string"}]}, None),
        ({"allOf": {"type": "string"}}, None),
        ({"patternProperties": {"a": {}}}, None),
        ({"patternProperties": {"a": {}, "b": {}}}, "'patternProperties' beside"),
        ({"patternProperties": {"a": {}}, "properties": {}}, "'patternProperties' beside"),
        ({"patternProperties": ["a", "b"], "properties": {}}, None),
        ({"propertyNames": {"pattern": "^a"}}, None),
        ({"propertyNames": {"pattern": "^a"}, "unevaluatedProperties": True}, None),
        ({"propertyNames": {}, "properties": {}}, "'propertyNames' with other"),
        ({"propertyNames": {}, "patternProperties": {}}, "'propertyNames' with other"),
        ({"propertyNames": {}, "unevaluatedProperties": False}, "'propertyNames' with other"),
        ({"propertyNames": {}, "unevaluatedProperties": {}}, "'propertyNames' with other"),
        ({"propertyNames": {"pattern": "a", "maxLength": 2}}, "'propertyNames' with other"),
        ({"propertyNames": True}, None),
        ({"properties": {"propertyNames": {}}}, None),  # a property so named, not the keyword
    ],
)
def test_each_keyword_the_backend_would_ignore_is_named(schema, found):
    said = unsupported_schema_feature(schema)
    if found is None:
        assert said is None
    else:
        assert said is not None and said.startswith(found), said


def test_a_keyword_deep_in_a_schema_is_named_with_its_place():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string"},
            "b": {"anyOf": [{"type": "string"}, {"type": "integer", "multipleOf": 3}]},
        },
    }
    assert unsupported_schema_feature(schema) == "'multipleOf' at $.properties.b.anyOf[1]"
    assert unsupported_schema_feature({"items": [1, "x", None]}) is None
    # a list looked at before a sibling's keyword: the walk goes on past it
    sibling_first = {
        "properties": {"a": {"type": "integer", "multipleOf": 2}},
        "anyOf": [{"type": "string"}],
    }
    assert unsupported_schema_feature(sibling_first) == "'multipleOf' at $.properties.a"
    assert "is not supported by the grammar backend" in refused({"json": schema})


@pytest.mark.parametrize(
    ("node", "bounded"),
    [
        ({"pattern": "a", "minLength": 1}, True),
        ({"pattern": "a", "maxLength": 1}, True),
        ({"format": "date", "minLength": 1}, True),
        ({"format": "date", "maxLength": 1}, True),
        ({"pattern": "a"}, False),
        ({"format": "date"}, False),
        ({"minLength": 1, "maxLength": 2}, False),
    ],
)
def test_a_pattern_or_format_is_bounded_only_with_a_length(node, bounded):
    assert _bounded_pattern(node) is bounded


# -- grammars, their syntax, the backend's words ---------------------------------------------


@pytest.mark.parametrize(
    ("grammar", "syntax"),
    [
        ('root ::= "a"', "ebnf"),
        ('start: "a"\nroot ::= "a"', "ebnf"),  # any line defining a rule
        ('start: "a"', "lark"),
        ('# root ::= "a"\nstart: "a"', "lark"),  # in a comment
        ('start: "a"  // root ::= "a"', "lark"),
        ("", "lark"),
    ],
)
def test_a_grammar_is_ebnf_where_a_line_defines_a_rule_with_its_sign(grammar, syntax):
    assert grammar_syntax(grammar) == syntax


def test_choices_are_exact_strings_non_ascii_kept():
    assert choice_grammar(["\u00e9t\u00e9", 'a"b']) == 'root ::= "\u00e9t\u00e9" | "a\\"b"'


def test_the_backends_message_loses_its_log_prefix_and_is_cut():
    e = RuntimeError("[16:54:59] /project/cpp/grammar_parser.cc:106: EBNF lexer error\nline 2")
    assert _backend_message(e) == "EBNF lexer error"
    assert _backend_message(RuntimeError("   ")) == "RuntimeError"
    assert _backend_message(ValueError("")) == "ValueError"
    assert _backend_message(RuntimeError("x" * 400)) == "x" * 300
    assert _backend_message(RuntimeError("  plain words  ")) == "plain words"


@pytest.mark.parametrize(
    ("syntax", "spec", "text"),
    [
        ("json", {"type": "integer"}, None),
        ("regex", "a|b", 'root ::= (("a") | ("b"))'),
        ("lark", 'start: "a" "b"', 'root ::= (("a" "b"))'),
        ("ebnf", 'root ::= "a" | "b"', None),
    ],
)
def test_each_syntax_is_parsed_as_itself(syntax, spec, text):
    grammar = _parse("at", syntax, spec)
    assert isinstance(grammar, xgr.Grammar)
    if text is not None:
        assert str(grammar).strip() == text


@pytest.mark.parametrize(
    ("syntax", "spec"),
    [
        ("json", {"type": "nonsense"}),
        ("regex", "(a"),
        ("lark", "start: undefined_rule"),
        ("ebnf", 'start: "a"'),  # lark is not EBNF
        ("ebnf", "a|b"),  # a regex is not either
    ],
)
def test_a_spec_the_backend_refuses_is_a_constraint_error_naming_the_field(syntax, spec):
    with pytest.raises(ConstraintError, match=r"^field 'x\.y': ") as e:
        _parse("x.y", syntax, spec)
    assert "grammar_parser.cc" not in str(e.value) and "\n" not in str(e.value)


def test_a_grammar_constraint_is_checked_in_its_own_syntax():
    assert check_constraint({"grammar": 'start: "a"'}) == {"grammar": 'start: "a"'}
    assert check_constraint({"grammar": 'root ::= "a"'}) == {"grammar": 'root ::= "a"'}
    assert "Lark error" in refused({"grammar": "start: undefined_rule"})
    assert "EBNF parser error" in refused({"grammar": 'root ::= "a" | '})
    assert check_constraint({"regex": "[a-z]+"}) == {"regex": "[a-z]+"}
    assert "parenthesis" in refused({"regex": "(a"})


# -- grammars and matchers on a tokenizer of single characters -----------------------------------

VOCAB = [chr(i) for i in range(32, 127)] + ["</s>"]  # token i: chr(32 + i); 95: the end
END = 95


def tok(ch: str) -> int:
    return ord(ch) - 32


@pytest.fixture
def grammars(monkeypatch):
    """:class:`Grammars` for the single-character tokenizer (``from_huggingface`` faked);
    ``stop_ids``: a second end token, ``#``."""
    asked = []

    def from_huggingface(tokenizer, vocab_size=None):
        asked.append((tokenizer, vocab_size))
        return xgr.TokenizerInfo(
            VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[END]
        )

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", staticmethod(from_huggingface))
    g = Grammars("the tokenizer", 128, stop_ids=[tok("#"), END])
    assert asked == [("the tokenizer", 128)]
    return g


def allowed(m) -> set[int]:
    logits = torch.zeros(128)
    m.mask(logits)
    return {i for i in range(128) if logits[i] == 0}


def feeds(m, text: str) -> bool:
    """Feed ``text`` character by character, each one checked allowed first."""
    for ch in text:
        if tok(ch) not in allowed(m):
            return False
        m.accept(tok(ch))
    return True


def reads(m, text: str) -> bool:
    """:func:`feeds`, and the grammar may end there (an end token allowed)."""
    return feeds(m, text) and END in allowed(m)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    ("constraint", "good", "bad"),
    [
        ({"json_object": True}, '{"a":1}', '{"a": 1}'),  # no free whitespace
        ({"json": SCHEMA}, '{"n":12}', '{"n": 12}'),
        ({"json": SCHEMA}, '{"n":12}', '{"n":"x"}'),
        ({"regex": "(cat|dog)s?"}, "dogs", "cow"),
        ({"choice": ["yes", "no"]}, "no", "maybe"),
        ({"grammar": 'root ::= "a" ("b" | "c") "!"'}, "ac!", "ad!"),
        ({"grammar": 'start: "a" ("b" | "c") "!"'}, "ab!", "a!"),
    ],
)
def test_each_kind_allows_its_sentences_character_by_character(grammars, constraint, good, bad):
    assert reads(grammars.matcher(constraint), good)
    assert not reads(grammars.matcher(constraint), bad)


def test_a_json_object_uses_the_compact_separators(grammars):
    m = grammars.matcher({"json_object": True})
    assert feeds(m, '{"a":1')
    assert allowed(m) >= {tok(","), tok("}")} and tok(" ") not in allowed(m)
    m = grammars.matcher({"json": SCHEMA})
    assert feeds(m, '{"n"')
    assert allowed(m) == {tok(":")}


def test_the_model_and_the_tokenizer_end_tokens_both_end_a_sentence(grammars):
    assert grammars.stop_ids == [tok("#"), END]
    m = grammars.matcher({"choice": ["yes"]})
    assert reads(m, "yes")
    assert allowed(m) == {tok("#"), END}
    m.accept(tok("#"))
    assert m.matcher.is_terminated()


def test_a_matcher_picks_up_after_the_tokens_already_sampled(grammars):
    m = grammars.matcher({"choice": ["yes", "yet", "no"]}, sampled=[tok("y"), tok("e")])
    assert allowed(m) == {tok("s"), tok("t")}


def test_a_token_the_grammar_forbids_is_an_error_and_a_finished_one_masks_nothing(grammars):
    m = grammars.matcher({"choice": ["ab"]})
    with pytest.raises(RuntimeError, match=r"^the grammar refused token 66 it did not mask$"):
        m.accept(tok("b"))
    m = grammars.matcher({"choice": ["a"]}, sampled=[tok("a"), END])
    assert m.matcher.is_terminated()
    logits = torch.full((128,), 2.0)
    m.mask(logits)
    assert bool((logits == 2.0).all())  # nothing masked (ignore_eos goes on)
    m.accept(tok("z"))  # and nothing refused


def test_the_mask_covers_the_models_whole_width(grammars):
    m = grammars.matcher({"choice": ["a"]})
    assert tuple(m.bitmask.shape) == (1, 4)  # 128 tokens: 4 words of 32 bits
    logits = torch.zeros(1, 128)
    m.mask(logits)
    assert torch.isinf(logits[0, 96:]).all()  # past the tokenizer's vocabulary


def test_the_compiled_grammars_are_cached_within_the_limit(grammars):
    assert grammars.compiler.cache_limit_bytes == CACHE_BYTES == 64 * 1024 * 1024
    grammars.matcher({"regex": "a+"})
    assert grammars.compiler.get_cache_size_bytes() > 0


@pytest.mark.parametrize(
    ("field", "at"),
    [
        ("structured_outputs", "structured_outputs.regex"),
        ("response_format.json_schema.schema", "response_format.json_schema.schema"),
    ],
)
def test_a_constraint_that_cannot_compile_names_the_requests_field(grammars, field, at):
    with pytest.raises(ConstraintError, match=rf"^field {re.escape(repr(at))}: ") as e:
        grammars.matcher({"regex": "(a"}, field=field)
    assert "\n" not in str(e.value)
