import random

import pytest
from omni_ar.detokenizer import IncrementalDetokenizer
from transformers import AutoTokenizer

TEXTS = ["héllo wörld, ünïcode ✓ 猫 and emoji 🦊 too", "the quick brown fox jumps", "猫🦊猫🦊"]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def stream(tok, ids, cuts, stop=()):
    d = IncrementalDetokenizer(tok, stop=list(stop))
    out, pieces, lo = "", [], 0
    for hi in [*cuts, len(ids)]:
        delta = d.add(ids[lo:hi])
        assert "\ufffd" not in delta  # never half a character
        pieces.append(delta)
        out += delta
        lo = hi
    out += d.flush()
    return out, d


@pytest.mark.parametrize("text", TEXTS)
def test_any_split_gives_the_full_text(tok, text):
    ids = tok(text)["input_ids"]
    assert len(ids) > len(text.split())  # multi-byte characters take several tokens
    rng = random.Random(1)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, rng.randint(1, 6))))
        out, _ = stream(tok, ids, cuts)
        assert out == tok.decode(ids, skip_special_tokens=True)


def test_one_token_at_a_time(tok):
    ids = tok(TEXTS[0])["input_ids"]
    out, _ = stream(tok, ids, list(range(1, len(ids))))
    assert out == TEXTS[0]


@pytest.mark.parametrize("stop", ["wörld", "✓ 猫", "🦊 t"])
def test_stop_strings_spanning_segments(tok, stop):
    text = TEXTS[0]
    ids = tok(text)["input_ids"]
    for cuts in ([], list(range(1, len(ids))), [3, 9, 14]):
        out, d = stream(tok, ids, cuts, stop=[stop])
        assert out == text[: text.index(stop)]
        assert d.stopped == stop


def test_a_stop_prefix_is_released_when_the_stop_does_not_follow(tok):
    ids = tok("the quick brown fox")["input_ids"]
    out, d = stream(tok, ids, list(range(1, len(ids))), stop=["quick red"])
    assert out == "the quick brown fox" and d.stopped is None
