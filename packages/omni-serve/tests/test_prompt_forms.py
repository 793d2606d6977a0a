"""A completion's prompt in every form vLLM's server takes, with the real ``openai``
client on the tiny Llama's text server: token ids (fed as they are: the same answer as
the text they encode), a batch of prompts (choices indexed prompt x n, usage counting
each prompt once, each echoing its own), and vLLM's ``prompt_logprobs`` field (a
completion choice's, a chat's top-level: per prompt token ``{id: {logprob, rank,
decoded_token}}``, equal to the model's own forward). Bad ids, too many prompts and
``prompt_logprobs`` when streaming are 400s naming the field."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("transformers")

PROMPT = "a red fox jumps over the lazy dog"
OTHER = "the quick brown fox"


@pytest.fixture(scope="module")
def ref(tiny_llama):
    from omni_ar.testing import prompt_forward

    return prompt_forward(tiny_llama, PROMPT, 2)


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "tiny_chat", **body}, timeout=60)


def test_token_ids_answer_as_the_text_they_encode(client, ref):
    text = client.completions.create(model="tiny_chat", prompt=PROMPT, max_tokens=6)
    ids = client.completions.create(model="tiny_chat", prompt=ref.ids, max_tokens=6)
    nested = client.completions.create(model="tiny_chat", prompt=[ref.ids], max_tokens=6)
    assert ids.choices[0].text == text.choices[0].text == nested.choices[0].text
    assert ids.usage.prompt_tokens == text.usage.prompt_tokens == len(ref.ids)


def test_echo_of_token_ids_is_their_decoded_text(client, ref):
    out = client.completions.create(
        model="tiny_chat", prompt=ref.ids, max_tokens=3, echo=True, logprobs=1
    )
    plain = client.completions.create(model="tiny_chat", prompt=ref.ids, max_tokens=3)
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    lp = out.choices[0].logprobs
    assert lp.tokens[: len(ref.ids)] == ref.texts
    assert lp.token_logprobs[1 : len(ref.ids)] == pytest.approx(ref.chosen, abs=1e-4)


def test_a_batch_of_prompts_answers_each_in_order(client):
    alone = [
        client.completions.create(model="tiny_chat", prompt=p, max_tokens=4).choices[0].text
        for p in (PROMPT, OTHER)
    ]
    both = client.completions.create(
        model="tiny_chat", prompt=[PROMPT, OTHER], max_tokens=4, echo=True
    )
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [PROMPT + alone[0], OTHER + alone[1]]
    one = client.completions.create(model="tiny_chat", prompt=OTHER, max_tokens=4)
    first = client.completions.create(model="tiny_chat", prompt=PROMPT, max_tokens=4)
    assert both.usage.prompt_tokens == one.usage.prompt_tokens + first.usage.prompt_tokens


def test_a_batch_with_n_indexes_choices_prompt_by_prompt(client):
    out = client.completions.create(
        model="tiny_chat", prompt=[PROMPT, OTHER], max_tokens=4, n=2, seed=7, temperature=1
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    seeded = [
        client.completions.create(
            model="tiny_chat", prompt=p, max_tokens=4, seed=7 + i, temperature=1
        )
        .choices[0]
        .text
        for p in (PROMPT, OTHER)
        for i in range(2)
    ]
    assert [c.text for c in out.choices] == seeded
    lone = client.completions.create(model="tiny_chat", prompt=PROMPT, max_tokens=1)
    other = client.completions.create(model="tiny_chat", prompt=OTHER, max_tokens=1)
    assert out.usage.prompt_tokens == lone.usage.prompt_tokens + other.usage.prompt_tokens


def test_a_streamed_batch_carries_each_choice_by_index(client):
    alone = [
        client.completions.create(model="tiny_chat", prompt=p, max_tokens=4).choices[0].text
        for p in (PROMPT, OTHER)
    ]
    texts = ["", ""]
    stream = client.completions.create(
        model="tiny_chat", prompt=[PROMPT, OTHER], max_tokens=4, stream=True
    )
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == alone


def check_entries(got: list, ref, k: int) -> None:
    """vLLM's prompt_logprobs shape, against the model's forward: null first, then each
    position's own token (its logprob and rank) and the k likeliest (ranks 1..k)."""
    assert got[0] is None and len(got) == len(ref.ids)
    for i, entry in enumerate(got[1:]):
        own = entry[str(ref.ids[i + 1])]
        assert own["logprob"] == pytest.approx(ref.chosen[i], abs=1e-4)
        assert own["rank"] == ref.ranks[i]
        assert own["decoded_token"] == ref.texts[i + 1]
        for rank, (tid, lp) in enumerate(ref.top_ids[i][:k], start=1):
            alt = entry[str(tid)]
            assert alt["logprob"] == pytest.approx(lp, abs=1e-4)
            assert alt["rank"] == (rank if tid != ref.ids[i + 1] else ref.ranks[i])
        assert len(entry) == k + (ref.ids[i + 1] not in [t for t, _ in ref.top_ids[i][:k]])


def test_prompt_logprobs_on_a_completion_choice(text_server, ref):
    r = post(text_server, {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    check_entries(choice["prompt_logprobs"], ref, 2)
    zero = post(text_server, {"prompt": ref.ids, "max_tokens": 2, "prompt_logprobs": 0})
    check_entries(zero.json()["choices"][0]["prompt_logprobs"], ref, 0)
    assert "prompt_logprobs" not in post(text_server, {"prompt": PROMPT}).json()["choices"][0]


def test_prompt_logprobs_of_a_chat_are_top_level(text_server, tiny_llama):
    from omni_ar.testing import PromptForward, prompt_forward
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": PROMPT}]
    r = post(
        text_server,
        {"messages": messages, "max_tokens": 2, "prompt_logprobs": 1},
        "/v1/chat/completions",
    )
    assert r.status_code == 200, r.text
    body = r.json()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want: PromptForward = prompt_forward(tiny_llama, templated, 1)
    assert body["usage"]["prompt_tokens"] == len(want.ids)
    check_entries(body["prompt_logprobs"], want, 1)
    assert "prompt_logprobs" not in body["choices"][0]


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"prompt": [5, 99999]}, "prompt[1]", "not in the vocabulary"),
        ({"prompt": [[5], [7, -1]]}, "prompt", ""),
        ({"prompt": []}, "prompt", ""),
        ({"prompt": [[]]}, "prompt", ""),
        ({"prompt": [1.5]}, "prompt", ""),
        ({"prompt": [True]}, "prompt", ""),
        ({"prompt": ["a"] * 17}, "prompt", "over this server's --max-n"),
        ({"prompt": ["a", "b"], "n": 9}, "prompt", "18 choices"),
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs", ""),
        ({"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs", ""),
        ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
        ({"prompt": [5, 99999], "echo": True}, "prompt[1]", "not a token id"),
        ({"prompt": [[5, 6], [5, 99999]]}, "prompt[1][1]", "not a token id"),
        ({"prompt": [[5], [99999]], "stream": True}, "prompt[1][0]", "not a token id"),
        ({"prompt": ["a", [5]]}, "prompt", ""),
    ],
)
def test_bad_prompts_are_400s_naming_the_field(text_server, body, field, says):
    r = post(text_server, {"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or (field == "prompt" and err["param"].startswith(field)), err
    assert says in err["message"]


def test_prompt_logprobs_zero_when_streaming_is_accepted(client):
    stream = client.completions.create(
        model="tiny_chat",
        prompt=PROMPT,
        max_tokens=2,
        stream=True,
        extra_body={"prompt_logprobs": 0},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices)
