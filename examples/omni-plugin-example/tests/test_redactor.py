"""The plug-in's own tests: the redaction logic alone, and the options as omni checks them.

Run them where the package is installed: ``pytest examples/omni-plugin-example/tests``.
"""

import msgspec
import pytest
from omni_core import ConfigError, parse_config
from omni_plugin_example import RedactOptions, StreamRedactor, word_pattern


def redact_stream(pieces, words, replacement="***"):
    r = StreamRedactor(word_pattern(words), replacement)
    out = [r.feed(p) for p in pieces]
    out.append(r.finish())
    return out, r.count


def test_whole_words_only_case_insensitive():
    (out, count) = redact_stream(["The Fox and the foxglove."], ["fox"])
    assert "".join(out) == "The *** and the foxglove."
    assert count == 1


@pytest.mark.parametrize("cut", range(1, 24))
def test_words_split_across_pieces(cut):
    text = "Foxes run; a fox sleeps"
    out, count = redact_stream([text[:cut], text[cut:]], ["fox", "foxes"])
    assert "".join(out) == "*** run; a *** sleeps"
    assert count == 2


def test_text_passes_on_as_soon_as_its_words_are_whole():
    r = StreamRedactor(word_pattern(["fox"]), "***")
    assert r.feed("a fo") == "a "  # "fo" may be the start of "fox": held back
    assert r.feed("x ran") == "*** "
    assert r.finish() == "ran"


def test_no_words_changes_nothing():
    out, count = redact_stream(["any ", "text"], [])
    assert "".join(out) == "any text" and count == 0


def test_options_are_checked_when_the_config_loads():
    assert msgspec.convert({"words": ["fox"]}, RedactOptions).replacement == "***"
    config = {
        "stages": [
            {"name": "a", "kind": "ar.intake", "options": {"model": "smollm2"}},
            {"name": "r", "kind": "example.redact", "options": {"words": ["two words"]}},
        ],
        "edges": [{"from": "a", "to": "r"}],
    }
    with pytest.raises(ConfigError, match=r"stages\[1\]\.options\.words\[0\]"):
        parse_config(config)  # the entry point is installed: its Options are checked
