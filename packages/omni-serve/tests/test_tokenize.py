"""vLLM's ``/tokenize`` and ``/detokenize`` on the tiny Llama's text server: a prompt's ids
are the tokenizer's, a chat's the chat template's (and the chat completion's
``prompt_tokens``), detokenize undoes tokenize, and a token outside the vocabulary or a
prompt over the character limit is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("transformers")

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the quick brown fox"},
]
PROMPT = "a red fox jumps over the lazy dog"
CHAR_LIMIT = 64 * 32  # the intake's max_prompt_tokens (conftest) x CHARS_PER_TOKEN


@pytest.fixture(scope="module")
def http(text_server):
    with httpx.Client(base_url=text_server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def post(http, path, body, status=200):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def test_a_prompt_is_the_tokenizers_ids(http, tokenizer):
    out = post(http, "/tokenize", {"model": "tiny_chat", "prompt": PROMPT})
    ids = tokenizer(PROMPT)["input_ids"]
    assert out == {"count": len(ids), "max_model_len": 64, "tokens": ids}
    plain = post(http, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert plain["tokens"] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    strs = post(http, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(ids)


def test_messages_are_the_chat_templates_ids_and_the_chats_prompt_tokens(http, tokenizer):
    out = post(http, "/tokenize", {"messages": MESSAGES})
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert out["tokens"] == ids and out["count"] == len(ids)
    chat = post(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == out["count"]
    bare = post(http, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert bare["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert bare["count"] < out["count"]


def test_detokenize_undoes_tokenize(http):
    ids = post(http, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})["tokens"]
    assert post(http, "/detokenize", {"model": "tiny_chat", "tokens": ids}) == {"prompt": PROMPT}


def test_a_token_outside_the_vocabulary_is_a_400_naming_it(http, tokenizer):
    vocab = len(tokenizer)
    post(http, "/detokenize", {"tokens": [1, vocab - 1]})  # the last id: in
    for bad in (vocab, -1):
        err = post(http, "/detokenize", {"tokens": [1, 2, bad]}, 400)["error"]
        assert err["param"] == "tokens[2]" and str(bad) in err["message"]


def test_a_prompt_over_the_limit_is_a_400_naming_it(http):
    post(http, "/tokenize", {"prompt": "a" * CHAR_LIMIT, "add_special_tokens": False})
    err = post(http, "/tokenize", {"prompt": "a" * (CHAR_LIMIT + 1)}, 400)["error"]
    assert err["param"] == "prompt" and str(CHAR_LIMIT + 1) in err["message"]
    long = [{"role": "user", "content": "a" * (CHAR_LIMIT + 1)}]
    err = post(http, "/tokenize", {"messages": long}, 400)["error"]
    assert err["param"] == "messages[0].content"


def test_bad_bodies_name_the_field(http):
    err = post(http, "/tokenize", {"prompt": PROMPT, "model": "other"}, 404)["error"]
    assert err["param"] == "model"
    err = post(http, "/tokenize", {"prompt": PROMPT, "bogus": 1}, 400)["error"]
    assert err["param"] == "bogus"
    err = post(http, "/detokenize", {"tokens": ["x"]}, 400)["error"]
    assert err["param"].startswith("tokens")
    body = {"messages": MESSAGES, "continue_final_message": True}
    err = post(http, "/tokenize", body, 400)["error"]
    assert err["param"] == "continue_final_message"


def test_a_pipeline_without_a_text_model_says_why():
    from types import SimpleNamespace

    from omni_serve.errors import APIError
    from omni_serve.routes.tokenize import Tokenizer

    stage = SimpleNamespace(name="plan", kind="dit.plan", options={})
    config = SimpleNamespace(name="images", stages=[stage], edges=[])
    with pytest.raises(APIError) as e:
        Tokenizer(SimpleNamespace(pipe=SimpleNamespace(config=config)))
    assert e.value.status == 404 and "no text model" in str(e.value) and "dit.plan" in str(e.value)
