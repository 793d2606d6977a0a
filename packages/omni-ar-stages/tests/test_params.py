import pytest
from omni_ar.params import RequestError, parse_request


@pytest.mark.parametrize(
    "request_,field,what",
    [
        ({}, "prompt", "exactly one"),
        ({"prompt": "a", "messages": []}, "prompt", "exactly one"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": 3}, "prompt", "expected a string"),
        ({"messages": []}, "messages", "non-empty"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "string"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens", "expected 1..100"),
        ({"prompt": "a", "max_tokens": 101}, "max_tokens", "expected 1..100"),
        ({"prompt": "a", "max_tokens": "x"}, "max_tokens", "Expected `int`"),
        ({"prompt": "a", "temperature": -1}, "temperature", "expected 0..2"),
        ({"prompt": "a", "top_p": 0}, "top_p", "(0, 1]"),
        ({"prompt": "a", "stop": [""]}, "stop", "empty"),
        ({"prompt": "a", "stop": "x"}, "stop", "Expected `array`"),
        ({"prompt": "a", "stop": [str(i) for i in range(17)]}, "stop", "at most 16 stop strings"),
        ({"prompt": "a", "stop": ["x" * 1_000_000]}, "stop", "at most 1024 characters"),
        ({"prompt": "a", "bogus": 1}, "bogus", "unknown request field"),
    ],
)
def test_bad_requests_name_the_field(request_, field, what):
    with pytest.raises(RequestError) as e:
        parse_request(request_, max_tokens_limit=100)
    assert f"field '{field}'" in str(e.value) and what in str(e.value)


def test_good_request():
    source, p = parse_request(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stop": ["\n"]}, 100
    )
    assert source == [{"role": "user", "content": "hi"}]
    assert (p.max_tokens, p.temperature, p.stop) == (5, 0.0, ["\n"])


@pytest.mark.parametrize(
    ("stop", "refused"),
    [
        ([str(i) for i in range(16)], None),  # exactly MAX_STOP_STRINGS
        ([str(i) for i in range(17)], "at most 16 stop strings, got 17"),
        (["x" * 1024], None),  # exactly MAX_STOP_CHARS
        (["é" * 1024], None),  # characters, not UTF-8 bytes
        (["a", "x" * 1025], "at most 1024 characters, got 1025"),
    ],
)
def test_stop_strings_at_their_limits(stop, refused):
    request = {"prompt": "a", "stop": stop}
    if refused is None:
        assert parse_request(request, max_tokens_limit=100)[1].stop == stop
    else:
        with pytest.raises(RequestError, match=f"field 'stop': .*{refused}"):
            parse_request(request, max_tokens_limit=100)
