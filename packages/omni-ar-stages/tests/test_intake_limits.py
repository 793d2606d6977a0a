"""The intake stage's ``max_tokens_limit`` inside a running pipeline: a request over it
ends at intake with an error that names the field; one at the limit runs to its end.
(Prefill and decode keep the default limit, so only the intake's check stops it.)"""

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
