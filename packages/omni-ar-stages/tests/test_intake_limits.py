"""The intake stage's ``max_tokens_limit`` inside a running pipeline: a request over it
ends at intake with an error that names the field; one at the limit runs to its end.
(Prefill and decode keep the default limit, so only the intake's check stops it.)"""

import pytest
from omni_core import Pipeline
from omni_core.events import Error

LIMIT = 8
PROMPT = "the quick brown fox"


def config(model):
    opts = {"model": model, "threads": 1}
    return {
        "heartbeat_interval_s": 0.1,
        "stages": [
            {
                "name": "intake",
                "kind": "ar.intake",
                "options": {"model": model, "max_tokens_limit": LIMIT, "default_max_tokens": 4},
            },
            {"name": "prefill", "kind": "ar.prefill", "options": opts},
            {"name": "decode", "kind": "ar.decode", "options": opts},
            {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": model}},
        ],
        "edges": [
            {"from": "intake", "to": "prefill"},
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "postprocess"},
        ],
    }


def test_a_request_over_the_intake_max_tokens_limit_fails_naming_the_field(tiny_model):
    with Pipeline(config(tiny_model)) as pipe:
        over = pipe.submit({"prompt": PROMPT, "max_tokens": LIMIT + 1, "ignore_eos": True})
        at = pipe.submit({"prompt": PROMPT, "max_tokens": LIMIT, "ignore_eos": True})
        over_events, at_events = list(over), list(at)
    end = over_events[-1]
    assert isinstance(end, Error), end
    assert end.stage == "intake"
    assert "field 'max_tokens'" in end.message
    assert f"expected 1..{LIMIT}, got {LIMIT + 1}" in end.message
    assert over_events[:-1] == []  # no stage produced anything for it
    assert at.finish_reason == "completed", at_events[-1]
    tokens = [t for e in at_events[:-1] if e.stage == "postprocess" for t in e.tokens or []]
    assert len(tokens) == LIMIT


def test_a_prompt_of_token_ids_is_fed_as_it_is(tiny_model):
    """A prompt of token ids (vLLM's ``prompt: [int, ...]``): the same tokens as the text
    they encode, through a ``chat: true`` intake too (ids are never templated); an id
    past the vocabulary, or more ids than ``max_prompt_tokens``, ends the request at
    intake naming the field, while the next request runs."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model)(PROMPT)["input_ids"]
    cfg = config(tiny_model)
    cfg["stages"][0]["options"].update(chat=True, max_prompt_tokens=len(ids))
    with Pipeline(cfg) as pipe:
        text, given, bad, long, after = (
            pipe.submit({**req, "max_tokens": 4, "ignore_eos": True})
            for req in (
                {"prompt": PROMPT, "raw_prompt": True},
                {"prompt": ids},
                {"prompt": [*ids[:-1], 10**6]},
                {"prompt": [*ids, ids[0]]},
                {"prompt": ids},
            )
        )
        runs = [list(r) for r in (text, given, bad, long, after)]

    def tokens(events):
        return [t for e in events[:-1] if e.stage == "postprocess" for t in e.tokens or []]

    assert tokens(runs[0]) == tokens(runs[1]) == tokens(runs[4]) and len(tokens(runs[1])) == 4
    for events, field in ((runs[2], f"prompt[{len(ids) - 1}]"), (runs[3], "prompt")):
        (end,) = events
        assert isinstance(end, Error) and end.stage == "intake", end
        assert f"field '{field}'" in end.message
    assert "not in the vocabulary" in runs[2][0].message
    assert "max_prompt_tokens" in runs[3][0].message


def test_the_multimodal_intake_refuses_token_ids():
    from omni_ar.params import RequestError, parse_request

    with pytest.raises(RequestError, match="field 'prompt': expected a string, got list"):
        parse_request({"prompt": [1, 2]}, 16, images=True)
