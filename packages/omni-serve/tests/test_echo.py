"""``echo`` on completions, with the real ``openai`` client on the tiny Llama's text
server: the prompt before the completion's text; with ``logprobs: N`` each prompt token's
logprob (the first one's null) and its N likeliest alternatives before the completion's,
equal to the model's own forward over the prompt; streamed, the first chunk carries the
prompt. This is what lm-evaluation-harness's ``local-completions`` log-likelihood asks:
``max_tokens: 1, logprobs: 1, echo: true``."""

from __future__ import annotations

import openai
import pytest

pytest.importorskip("transformers")

PROMPT = "a red fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def forward(tiny_llama):
    """The prompt's token texts, each later token's logprob and the two likeliest
    alternatives after each position ({text: logprob}), from transformers' forward."""
    from omni_ar.testing import prompt_forward

    ref = prompt_forward(tiny_llama, PROMPT, 2)
    return ref.texts, ref.chosen, [dict(t) for t in ref.tops]


def test_echo_puts_the_prompt_before_the_text(client):
    plain = client.completions.create(model="tiny_chat", prompt=PROMPT, max_tokens=6)
    echoed = client.completions.create(model="tiny_chat", prompt=PROMPT, max_tokens=6, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens


def test_echo_with_logprobs_gives_the_prompts_then_the_texts(client, forward):
    texts, chosen, tops = forward
    n = len(texts)
    plain = client.completions.create(model="tiny_chat", prompt=PROMPT, max_tokens=4, logprobs=2)
    out = client.completions.create(
        model="tiny_chat", prompt=PROMPT, max_tokens=4, logprobs=2, echo=True
    )
    got, want = out.choices[0].logprobs, plain.choices[0].logprobs
    assert got.tokens == texts + want.tokens
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.token_logprobs[1:n] == pytest.approx(chosen, abs=1e-4)
    for mine, ref in zip(got.top_logprobs[1:n], tops, strict=True):
        assert mine.keys() == ref.keys()
        assert list(mine.values()) == pytest.approx(list(ref.values()), abs=1e-4)
    assert got.token_logprobs[n:] == pytest.approx(want.token_logprobs, abs=1e-5)
    # each token's offset in the whole text, the prompt's first
    offsets = [sum(len(t) for t in got.tokens[:i]) for i in range(len(got.tokens))]
    assert got.text_offset == offsets
    assert out.choices[0].text == PROMPT + plain.choices[0].text


def test_a_log_likelihood_request_as_lm_eval_sends_it(client, forward):
    """``max_tokens: 1, logprobs: 1, echo: true, temperature: 0``: the prompt's logprobs,
    then one generated token; with ``logprobs: 0`` no alternatives at all."""
    texts, chosen, _ = forward
    out = client.completions.create(
        model="tiny_chat", prompt=PROMPT, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(texts) + 1 and len(lp.top_logprobs) == len(texts) + 1
    assert sum(lp.token_logprobs[1 : len(texts)]) == pytest.approx(sum(chosen), abs=1e-3)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    bare = client.completions.create(
        model="tiny_chat", prompt=PROMPT, max_tokens=1, logprobs=0, echo=True
    )
    assert bare.choices[0].logprobs.top_logprobs is None
    assert bare.choices[0].logprobs.token_logprobs[1 : len(texts)] == pytest.approx(
        chosen, abs=1e-4
    )


def test_a_streamed_echo_is_the_whole_answer_in_chunks(client):
    whole = client.completions.create(
        model="tiny_chat", prompt=PROMPT, max_tokens=5, logprobs=1, echo=True
    )
    chunks = list(
        client.completions.create(
            model="tiny_chat", prompt=PROMPT, max_tokens=5, logprobs=1, echo=True, stream=True
        )
    )
    # every chunk of a choice (one may carry a token whose text is not whole yet)
    texted = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert texted[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in texted) == whole.choices[0].text
    tokens = [t for c in texted for t in c.choices[0].logprobs.tokens]
    lps = [x for c in texted for x in c.choices[0].logprobs.token_logprobs]
    offsets = [x for c in texted for x in c.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens
    assert lps[0] is None and lps[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:])
    assert offsets == whole.choices[0].logprobs.text_offset


def test_echo_logprobs_past_the_limit_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny_chat", prompt=PROMPT, max_tokens=1, logprobs=21, echo=True
        )
    assert "logprobs" in str(e.value)
