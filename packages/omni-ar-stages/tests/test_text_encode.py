"""``ar.text_encode``'s encoder: padding, the pooled mean and the lead token, on the tiny
Llama (real transformers forward passes)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from omni_ar.text_encode import TextEncoder  # noqa: E402


@pytest.fixture(scope="module")
def encoders(tiny_model):
    plain = TextEncoder(tiny_model, max_tokens=8)
    led = TextEncoder(tiny_model, max_tokens=8, lead_token="<s>")
    return plain, led


def test_without_a_lead_token_the_text_starts_at_position_0(encoders):
    plain, _ = encoders
    ids = plain.engine.encode("the quick fox")
    ((embeds, pooled, n),) = plain.encode(["the quick fox"])
    assert n == len(ids) < 8
    hidden = plain.engine.hidden_states([ids + [plain.pad_id] * (8 - n)])[0]
    np.testing.assert_allclose(embeds, hidden, atol=1e-6)
    np.testing.assert_allclose(pooled, hidden[:n].mean(axis=0), atol=1e-6)


def test_a_lead_token_comes_first_and_stays_out_of_the_pooled_mean(encoders):
    _, led = encoders
    ids = led.engine.encode("the quick fox")
    bos = led.engine.tokenizer.convert_tokens_to_ids("<s>")
    (embeds, pooled, n), (other, _, _) = led.encode(["the quick fox", "a lazy dog"])
    assert n == len(ids)  # the text's own tokens, not the lead
    hidden = led.engine.hidden_states([[bos, *ids] + [led.pad_id] * (7 - n)])[0]
    np.testing.assert_allclose(embeds, hidden, atol=1e-6)
    np.testing.assert_allclose(pooled, hidden[1 : 1 + n].mean(axis=0), atol=1e-6)
    np.testing.assert_allclose(embeds[0], other[0], atol=1e-6)  # the lead's state: no text yet
    assert not np.allclose(embeds[1], other[1])  # the first word is its own now


def test_a_text_is_cut_to_max_tokens_with_the_lead_counted(encoders):
    _, led = encoders
    long = "the quick brown fox jumps over the lazy dog " * 3
    ((embeds, _, n),) = led.encode([long])
    assert embeds.shape[0] == 8 and n == 7


@pytest.mark.parametrize("bad", ["<nope>", "the quick", ""])
def test_a_lead_token_that_is_not_one_token_is_refused(tiny_model, bad):
    with pytest.raises(ValueError, match=r"option 'lead_token'"):
        TextEncoder(tiny_model, max_tokens=8, lead_token=bad)


def test_a_lead_token_needs_room_for_a_word(tiny_model):
    TextEncoder(tiny_model, max_tokens=2, lead_token="<s>")  # the lead and one token
    with pytest.raises(ValueError, match=r"option 'max_tokens'"):
        TextEncoder(tiny_model, max_tokens=1, lead_token="<s>")
