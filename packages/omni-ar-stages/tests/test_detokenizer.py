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


class _Chars:
    """A tokenizer whose token ids are code points: text arrives as chosen chunks."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def _naive_release(stops, chunks):
    """The reference: after each chunk, the earliest (then smallest) stop string found
    in the unreleased text, the longest stop-prefix tail held back (quadratic)."""
    text, emitted, out, stopped = "", 0, [], None
    for chunk in chunks:
        if stopped is not None:
            out.append("")
            continue
        text += chunk
        hits = [(i, s) for s in stops if (i := text.find(s, emitted)) >= 0]
        if hits:
            pos, stopped = min(hits)
            text, end = text[:pos], pos
        else:
            hold = max(
                (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0
            )
            end = max(emitted, len(text) - hold)
        out.append(text[emitted:end])
        emitted = end
    if stopped is None:
        out.append(text[emitted:])
    return out, stopped


def test_linear_stop_matching_equals_the_naive_search():
    """Random texts over a small alphabet (many partial matches), random stop sets and
    chunkings: every release and the stop found are the naive search's."""
    rng = random.Random(7)
    for _ in range(400):
        stops = list({"".join(rng.choices("ab", k=rng.randint(1, 5))) for _ in range(3)})
        text = "".join(rng.choices("abc", weights=[5, 5, 1], k=rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(1, max(2, len(text))), k=min(len(text) // 3, 6)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        d = IncrementalDetokenizer(_Chars(), stop=stops)
        got = [d.add([ord(c) for c in chunk]) for chunk in chunks]
        if d.stopped is None:
            got.append(d.flush())
        assert (got, d.stopped) == _naive_release(stops, chunks), (stops, chunks)


def test_a_long_stop_string_is_matched_across_many_chunks():
    """A 20,000-character stop string found after 400 chunks of partial matches, and one
    that fails at its last character released whole."""
    stop = "ab" * 10_000
    d = IncrementalDetokenizer(_Chars(), stop=[stop + "c"])
    chunks = ["ab" * 50] * 200
    assert [d.add([ord(c) for c in ch]) for ch in chunks] == [""] * 200  # all held back
    assert d.add([ord("d")]) == stop + "d"  # not the stop: released at once
    d = IncrementalDetokenizer(_Chars(), stop=[stop])
    out = "".join(
        d.add([ord(c) for c in ("x" + "ab" * 50 if i == 0 else "ab" * 50)]) for i in range(200)
    )
    assert out == "x" and d.stopped == stop


def _first_token_ending(tok, ids, stop):
    """How many tokens of ``ids`` it takes until their text holds ``stop``."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


@pytest.mark.parametrize("cuts", [[], "each", [2, 5, 11]])
def test_a_stop_string_counts_only_past_min_tokens(tok, cuts):
    text = "say stop, then more words and stop again"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    k = _first_token_ending(tok, ids, "stop")  # the first "stop" ends in token k
    cut = list(range(1, len(ids))) if cuts == "each" else cuts

    def run(min_tokens):
        d = IncrementalDetokenizer(tok, stop=["stop"], min_tokens=min_tokens)
        out, lo = "", 0
        for hi in [*cut, len(ids)]:
            out += d.add(ids[lo:hi])
            lo = hi
        return out + d.flush(), d.stopped

    first, second = text.index("stop"), text.index("stop", text.index("stop") + 1)
    assert run(0) == (text[:first], "stop")
    assert run(k - 1) == (text[:first], "stop")  # token k is past min_tokens: it stops
    assert run(k) == (text[:second], "stop")  # token k is not: passed over, the next counts
    assert run(len(ids)) == (text, None)  # never past min_tokens: no stop at all


def test_a_passed_over_match_leaves_the_matcher_ready_for_an_overlapping_one():
    from omni_ar.detokenizer import StopMatcher

    m = StopMatcher("aa")
    assert m.feed("aa", armed=False) is None and m.state == 1
    assert m.feed("a") == 1  # "aa" ends at the new "a" (its first "a" passed over)
    m = StopMatcher("abab")
    assert m.feed("abab", armed=False) is None and m.state == 2
    assert m.feed("ab") == 2
