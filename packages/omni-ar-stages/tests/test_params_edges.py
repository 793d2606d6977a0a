"""parse_request at each limit and one past it, and the fields its errors name."""

import json
import pickle
from types import SimpleNamespace

import jinja2
import msgspec
import pytest
from omni_ar.params import (
    MAX_SCHEMA_CHARS,
    PARAMS,
    RequestError,
    Sampled,
    SamplingParams,
    carried_params,
    params_payload,
    parse_request,
    template_error,
)

LIMIT = 100  # the max_tokens_limit these tests pass


def refused(request: dict, field: str, what: str = "", images: bool = False) -> None:
    """``request`` fails at intake with an error that names ``field`` (and says ``what``)."""
    with pytest.raises(RequestError) as e:
        parse_request(request, max_tokens_limit=LIMIT, images=images)
    assert str(e.value).startswith(f"field '{field}'"), str(e.value)
    assert what in str(e.value), str(e.value)


def test_a_bare_prompt_gets_the_default_params():
    source, p = parse_request({"prompt": "a"}, max_tokens_limit=LIMIT)
    assert source == "a"
    assert p == SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (16, 0.0, 1.0, None, [])
    assert (p.logprobs, p.top_logprobs, p.ignore_eos) == (False, 0, False)
    assert (p.response_format, p.structured_outputs, p.structured()) == (None, None, None)


def test_raw_prompt_is_a_boolean_for_a_plain_prompt_only():
    for raw in (True, False):
        assert parse_request({"prompt": "a", "raw_prompt": raw}, max_tokens_limit=LIMIT)[0] == "a"
    refused({"prompt": "a", "raw_prompt": 1}, "raw_prompt", "expected a boolean, got int")
    refused({"prompt": "a", "raw_prompt": "yes"}, "raw_prompt", "expected a boolean, got str")
    msgs = [{"role": "user", "content": "a"}]
    assert parse_request({"messages": msgs, "raw_prompt": False}, max_tokens_limit=LIMIT)
    refused({"messages": msgs, "raw_prompt": True}, "raw_prompt", "only with a plain 'prompt'")


def test_the_default_max_tokens_fits_a_limit_of_16():
    assert parse_request({"prompt": "a"}, max_tokens_limit=16)[1].max_tokens == 16


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("max_tokens", 0, "expected 1..100, got 0"),
        ("max_tokens", 1, None),
        ("max_tokens", LIMIT, None),
        ("max_tokens", LIMIT + 1, "expected 1..100, got 101"),
        ("temperature", -0.01, "expected 0..2, got -0.01"),
        ("temperature", 0.0, None),
        ("temperature", 1.5, None),
        ("temperature", 2.0, None),
        ("temperature", 2.01, "expected 0..2, got 2.01"),
        ("top_p", 0.0, "expected a value in (0, 1], got 0.0"),
        ("top_p", 0.01, None),
        ("top_p", 1.0, None),
        ("top_p", 1.01, "expected a value in (0, 1], got 1.01"),
        ("top_logprobs", -1, "expected 0..20, got -1"),
        ("top_logprobs", 0, None),
        ("top_logprobs", 20, None),
        ("top_logprobs", 21, "expected 0..20, got 21"),
    ],
)
def test_sampling_fields_at_their_limits(field, value, error):
    request = {"prompt": "a", "logprobs": True, field: value}
    if error is None:
        assert getattr(parse_request(request, max_tokens_limit=LIMIT)[1], field) == value
    else:
        refused(request, field, error)


def test_top_logprobs_needs_logprobs():
    refused({"prompt": "a", "top_logprobs": 1}, "top_logprobs", "needs 'logprobs': true")
    p = parse_request({"prompt": "a", "top_logprobs": 1, "logprobs": True}, LIMIT)[1]
    assert (p.logprobs, p.top_logprobs) == (True, 1)


def test_the_first_unknown_field_is_named():
    refused({"prompt": "a", "aaa": 1, "zzz": 2}, "aaa", "unknown request field")


@pytest.mark.parametrize("message", ["hi", {"content": "hi"}, {"role": 1, "content": "hi"}])
def test_a_message_without_a_role_is_refused(message):
    refused({"messages": [{"role": "user", "content": "a"}, message]}, "messages[1].role")


def test_a_field_of_the_wrong_type_is_named():
    refused({"prompt": "a", "temperature": "hot"}, "temperature", "Expected `float`")


# content parts


TEXT = {"type": "text", "text": "look"}
IMAGE = {"type": "image", "image": "/tmp/cat.png"}
IMAGE_BYTES = {"type": "image", "image": b"\x89PNG"}
HASHED = {"type": "image", "hash": "ab12"}
IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
GOOD_PARTS = [TEXT, IMAGE, IMAGE_BYTES, HASHED, IMAGE_URL]


def chat(parts: list) -> dict:
    return {"messages": [{"role": "user", "content": parts}]}


def test_content_parts_of_every_form_pass_with_images():
    source, _ = parse_request(chat(GOOD_PARTS), max_tokens_limit=LIMIT, images=True)
    assert source[0]["content"] == GOOD_PARTS


def test_content_parts_need_the_multimodal_stages():
    """The text stages (which do not pass ``images``) refuse them."""
    with pytest.raises(RequestError, match=r"field 'messages\[0\].content': .*multimodal stages"):
        parse_request(chat([TEXT]), max_tokens_limit=LIMIT)


def test_empty_content_parts_are_refused():
    refused(chat([]), "messages[0].content", "non-empty list of parts", images=True)


@pytest.mark.parametrize("good", GOOD_PARTS)
@pytest.mark.parametrize(
    "bad",
    [
        "look",
        {"type": "text", "text": 3},
        {"type": "text"},
        {"type": "text", "text": "a", "image": "x"},
        {"type": "bogus", "text": "a"},
        {"type": "image", "image": 3},
        {"type": "image", "image": "x", "hash": "ab"},
        {"type": "image", "hash": 3},
        {"type": "text", "hash": "ab"},
        {"type": "bogus", "image": "x"},
        {"type": "image_url", "image_url": "http://x/a.png"},
        {"type": "image_url", "image_url": {"url": 3}},
        {"type": "image_url", "image_url": {"url": "u"}, "text": "a"},
        {"type": "text", "image_url": {"url": "u"}},
    ],
)
def test_a_bad_part_after_a_good_one_is_named(good, bad):
    refused(chat([good, bad]), "messages[0].content[1]", "expected {'type': 'text'", images=True)


# response_format and structured_outputs


def schema_format(schema, **spec) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, **spec}}


@pytest.mark.parametrize(
    ("fmt", "constraint"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"json_object": True}),
        (schema_format({"type": "integer"}), {"json": {"type": "integer"}}),
        (
            schema_format({"type": "integer"}, strict=True, description="d"),
            {"json": {"type": "integer"}},
        ),
        (
            schema_format({"type": "integer"}, strict=None, description=None),
            {"json": {"type": "integer"}},
        ),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, {"json": {}}),
    ],
)
def test_response_formats_that_pass(fmt, constraint):
    p = parse_request({"prompt": "a", "response_format": fmt}, LIMIT)[1]
    assert (p.response_format, p.structured()) == (fmt, constraint)
    assert p.constraint_field() == "response_format"


@pytest.mark.parametrize(
    ("fmt", "field", "what"),
    [
        ({}, "response_format.type", "got 'None'"),
        ({"type": "bogus"}, "response_format.type", "['text', 'json_object', 'json_schema']"),
        ({"type": "x" * 50}, "response_format.type", f"got {'x' * 40!r}"),
        ({"type": "text", "zzz": 1, "aaa": 1}, "response_format.aaa", "unknown for type 'text'"),
        (
            {"type": "json_object", "json_schema": {}},
            "response_format.json_schema",
            "unknown for type 'json_object'",
        ),
        ({"type": "json_schema"}, "response_format.json_schema", "with 'name' and 'schema'"),
        (
            {"type": "json_schema", "json_schema": "{}"},
            "response_format.json_schema",
            "with 'name' and 'schema'",
        ),
        (
            schema_format({}, zzz=1, aaa=1),
            "response_format.json_schema.aaa",
            "unknown field",
        ),
        (schema_format({}, name=3), "response_format.json_schema.name", "expected a string"),
        (
            schema_format({}, description=3),
            "response_format.json_schema.description",
            "expected a string",
        ),
        (schema_format({}, strict="yes"), "response_format.json_schema.strict", "a boolean"),
        (
            {"type": "json_schema", "json_schema": {"name": "out"}},
            "response_format.json_schema.schema",
            "expected a JSON Schema object, got nothing",
        ),
        (
            schema_format([]),
            "response_format.json_schema.schema",
            "expected a JSON Schema object, got list",
        ),
        (
            schema_format({"type": "integer", "multipleOf": 2}),
            "response_format.json_schema.schema",
            "'multipleOf' at $ is not supported",
        ),
    ],
)
def test_response_formats_that_fail_name_the_field(fmt, field, what):
    refused({"prompt": "a", "response_format": fmt}, field, what)


def schema_of_size(n: int) -> dict:
    """A schema that is exactly ``n`` characters as JSON."""
    schema = {"type": "string", "description": ""}
    schema["description"] = "d" * (n - len(json.dumps(schema)))
    assert len(json.dumps(schema)) == n
    return schema


def test_a_schema_at_the_size_limit_passes():
    fmt = schema_format(schema_of_size(MAX_SCHEMA_CHARS))
    assert parse_request({"prompt": "a", "response_format": fmt}, LIMIT)[1].response_format == fmt


def test_a_schema_one_character_over_is_refused():
    fmt = schema_format(schema_of_size(MAX_SCHEMA_CHARS + 1))
    refused(
        {"prompt": "a", "response_format": fmt},
        "response_format.json_schema.schema",
        "65537 characters of JSON, over 65536",
    )


def test_structured_outputs_alone_or_beside_a_text_format():
    for request in (
        {"prompt": "a", "structured_outputs": {"regex": "[ab]"}},
        {
            "prompt": "a",
            "structured_outputs": {"regex": "[ab]"},
            "response_format": {"type": "text"},
        },
    ):
        p = parse_request(request, LIMIT)[1]
        assert p.structured() == {"regex": "[ab]"}
        assert p.constraint_field() == "structured_outputs"


def test_structured_outputs_beside_a_json_format_is_refused():
    refused(
        {
            "prompt": "a",
            "structured_outputs": {"regex": "[ab]"},
            "response_format": {"type": "json_object"},
        },
        "structured_outputs",
        "not both",
    )


# the chat template's errors


class TemplateError(Exception):
    """Named as jinja2's but not jinja2's."""


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            jinja2.TemplateError("roles must alternate"),
            "field 'messages': the chat template refused them: roles must alternate",
        ),
        (
            jinja2.UndefinedError("x is undefined"),
            "field 'messages': the chat template cannot be applied to them",
        ),
        (TemplateError("secret"), "field 'messages': the chat template cannot be applied to them"),
        (ValueError("secret"), "field 'messages': the chat template cannot be applied to them"),
    ],
)
def test_only_the_templates_own_refusal_is_shown(error, message):
    assert str(template_error(error)) == message


# params carried between stages, and sampled tokens


def test_params_are_carried_with_the_first_segment():
    _, p = parse_request({"prompt": "a", "max_tokens": 7, "stop": ["."]}, LIMIT)
    window = SimpleNamespace(payloads=[{"other": 1}, params_payload(p)])
    assert carried_params(window) == p


def test_no_carried_params_is_an_error():
    with pytest.raises(RuntimeError, match="no request params from upstream"):
        carried_params(SimpleNamespace(payloads=[{"other": 1}]))


def test_carried_params_refuse_an_unknown_field():
    with pytest.raises(msgspec.ValidationError, match="unknown field `bogus`"):
        carried_params(SimpleNamespace(payloads=[{PARAMS: {"bogus": 1}}]))


def test_sampling_params_take_their_fields_by_name():
    with pytest.raises(TypeError):
        SamplingParams(5)  # type: ignore[misc]


def test_a_sampled_token_without_alternatives_has_an_empty_top():
    plain, with_top = Sampled((3, -0.5)), Sampled((3, -0.5), [(4, -1.0)])
    assert (tuple(plain), plain.top) == ((3, -0.5), [])
    assert with_top.top == [(4, -1.0)]
    copy = pickle.loads(pickle.dumps(with_top))
    assert (tuple(copy), copy.top) == ((3, -0.5), [(4, -1.0)])


def test_a_prompt_of_token_ids_where_the_stage_takes_them():
    """``ids=True`` (ar.intake): a prompt may be token ids, ints >= 0 (a boolean is not
    one), at most MAX_PROMPT_IDS; each bad one named by its index. Elsewhere a list is
    not a prompt."""
    from omni_ar.params import MAX_PROMPT_IDS

    assert parse_request({"prompt": [0, 7]}, 16, ids=True)[0] == [0, 7]
    assert len(parse_request({"prompt": [1] * MAX_PROMPT_IDS}, 16, ids=True)[0]) == MAX_PROMPT_IDS
    with pytest.raises(RequestError, match=f"at most {MAX_PROMPT_IDS} token ids, got"):
        parse_request({"prompt": [1] * (MAX_PROMPT_IDS + 1)}, 16, ids=True)
    for bad, at in (([1, True], 1), ([-1], 0), ([0, 1, 2.0], 2), ([3, "4"], 1), ([[1]], 0)):
        with pytest.raises(RequestError, match=rf"field 'prompt\[{at}\]': expected a token id"):
            parse_request({"prompt": bad}, 16, ids=True)
    with pytest.raises(RequestError, match="field 'prompt': must not be empty"):
        parse_request({"prompt": []}, 16, ids=True)
    with pytest.raises(RequestError, match="expected a string, got list"):
        parse_request({"prompt": [1, 2]}, 16)
    with pytest.raises(RequestError, match="expected a string or token ids, got dict"):
        parse_request({"prompt": {"a": 1}}, 16, ids=True)
