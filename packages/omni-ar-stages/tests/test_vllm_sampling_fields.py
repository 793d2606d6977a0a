"""vLLM's sampling fields on the vLLM engine (CPU): fused (one engine, ``stream``) and
split (prefill's engine hands the first token and the KV to decode's), each token for
token equal to vLLM's ``LLM.generate`` with the same ``SamplingParams``, greedy. The
split is where it could go wrong: decode's request holds the first token in its prompt,
so the fields that read the output need :mod:`omni_ar.engines.vllm_carried`.

Skipped when vLLM is not installed, except under CI (env ``CI`` set), where that fails.
"""

import json

import pytest
from omni_ar.testing import kv_engine_pair, require_vllm

require_vllm()

from omni_ar.logits import bad_word_ids  # noqa: E402
from omni_ar.params import RequestError, SamplingParams  # noqa: E402
from omni_ar.testing import run_oracle  # noqa: E402

ENGINE_ARGS = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20}
N = 12

ORACLE = """
import json, sys
from vllm import LLM, SamplingParams
model, args, cases = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=model, enforce_eager=True, dtype="float32", **args)
inputs = [{"prompt_token_ids": ids} for ids, _ in cases]
for _, kw in cases:  # JSON's keys are strings: vLLM's are token ids; greedy by default
    kw.setdefault("temperature", 0.0)
    kw["logit_bias"] = {int(k): v for k, v in (kw.get("logit_bias") or {}).items()} or None
params = [SamplingParams(**kw) for _, kw in cases]
outs = llm.generate(inputs, params, use_tqdm=False)
print("ORACLE" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""

pytestmark = pytest.mark.usefixtures("restore_environment")  # in-process engines below


def prompt(n, salt):
    return [3 + (i * 7 + salt) % 300 for i in range(n)]


@pytest.fixture(scope="module")
def engines(vllm_model):
    """(prefill's engine, a KV producer that also runs whole requests; decode's)."""
    return kv_engine_pair(vllm_model, ENGINE_ARGS)


def fused(engine, ids, params):
    return [s[0] for s in engine.stream(ids, params) if s is not None]


def split(engines, ids, params):
    prefill, decode = engines
    first, _, keys, values = prefill.prefill(ids, params)
    return [first, *(s[0] for s in decode.decode(first, keys, values, params, ids) if s)]


@pytest.fixture(scope="module")
def table(engines, vllm_model):
    """name -> (prompt ids, our fields, vLLM's tokens for them), and the plain greedy
    tokens of the first prompt."""
    ids = prompt(40, 0)
    greedy = fused(engines[0], ids, SamplingParams(max_tokens=N))
    g0 = str(greedy[0])
    word = engines[0].tokenizer.decode(greedy[:2])
    cases = {
        # the first token made likeliest at every step, so that it repeats: the
        # penalties take it back (each needs the first token counted in split decode)
        "frequency_penalty": {"logit_bias": {g0: 4.0}, "frequency_penalty": 1.5},
        "presence_penalty": {"logit_bias": {g0: 4.0}, "presence_penalty": 2.0},
        "penalties_with_repetition": {
            "logit_bias": {g0: 6.0},
            "frequency_penalty": 0.8,
            "presence_penalty": 0.6,
            "repetition_penalty": 1.4,
        },
        "negative_penalties": {"frequency_penalty": -2.0, "presence_penalty": -1.0},
        "repetition_penalty": {"repetition_penalty": 0.5},
        "logit_bias": {"logit_bias": {str(greedy[1]): -100.0, "7": 3.0}},
        "min_tokens": {"logit_bias": {"2": 50.0}, "min_tokens": 5},
        "min_tokens_stop_token_ids": {
            "logit_bias": {"2": 50.0, "9": 60.0},
            "min_tokens": 4,
            "stop_token_ids": [9],
        },
        "stop_token_ids": {"stop_token_ids": [greedy[4]]},
        "ignore_eos": {"logit_bias": {"2": 50.0}, "ignore_eos": True},
        # the first two tokens as a bad word: split decode bans the second after the first
        "bad_words": {"bad_words": [word]},
        "top_k_1": {"temperature": 1.5, "seed": 5, "top_k": 1},
        "min_p_1": {"temperature": 1.5, "seed": 5, "min_p": 1.0},
    }
    rows = [(ids, {"max_tokens": N, **kw}) for kw in cases.values()]
    expected = run_oracle(ORACLE, vllm_model, json.dumps(ENGINE_ARGS), json.dumps(rows))
    out = {name: (ids, rows[i][1], expected[i]) for i, name in enumerate(cases)}
    return out, greedy, bad_word_ids(engines[0].tokenizer, [word])


CASES = [
    "frequency_penalty",
    "presence_penalty",
    "penalties_with_repetition",
    "negative_penalties",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "min_tokens_stop_token_ids",
    "stop_token_ids",
    "ignore_eos",
    "bad_words",
    "top_k_1",
    "min_p_1",
]


@pytest.mark.parametrize("case", CASES)
def test_fused_and_split_equal_llm_generate(engines, table, case):
    cases, greedy, _ = table
    ids, kw, expected = cases[case]
    params = SamplingParams(**kw)
    assert fused(engines[0], ids, params) == expected
    assert split(engines, ids, params) == expected
    if case.startswith(("top_k", "min_p")):
        assert expected == greedy  # the likeliest token only
    else:
        assert expected != greedy  # the field changed something


def test_the_split_cases_exercise_the_first_token(table):
    """The penalties' cases repeat the first token, and the bad word starts with it."""
    cases, greedy, bad = table
    for case in ("frequency_penalty", "presence_penalty", "penalties_with_repetition"):
        _, _, expected = cases[case]
        assert expected[0] == greedy[0] and greedy[0] in expected[1:], case
    assert greedy[:2] in bad


def test_token_ids_outside_the_vocabulary_are_refused(engines):
    engines[1].check_tokens(SamplingParams(logit_bias={"319": 1.0}, stop_token_ids=[319]))
    for params, field in [
        (SamplingParams(logit_bias={"320": 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[320]), "stop_token_ids"),
    ]:
        with pytest.raises(RequestError, match=f"field '{field}': token id 320 is not in"):
            engines[1].check_tokens(params)


STOP_ORACLE = """
import json, sys
from vllm import LLM, SamplingParams
model, args, cases = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=model, enforce_eager=True, dtype="float32", **args)
inputs = [{"prompt_token_ids": ids} for ids, _ in cases]
params = [SamplingParams(temperature=0.0, **kw) for _, kw in cases]
outs = llm.generate(inputs, params, use_tqdm=False)
print("ORACLE" + json.dumps([o.outputs[0].text for o in outs]))
"""


def test_stop_strings_count_only_past_min_tokens_as_vllms(engines, vllm_model):
    """Our detokenizer over our engine's tokens gives vLLM's text for ``stop`` with
    ``min_tokens`` on both sides of the token whose text ends the stop string."""
    from omni_ar.detokenizer import detokenizer

    ids, tok = prompt(40, 3), engines[0].tokenizer
    greedy = fused(engines[0], ids, SamplingParams(max_tokens=N))
    pieces = [tok.decode(greedy[:k]) for k in range(N + 1)]
    # a stop string: 2 whole characters of the text past its start (then k: the first
    # token whose text holds it)
    full = pieces[N]
    stop = next(full[i : i + 2] for i in range(2, len(full)) if "\ufffd" not in full[i : i + 2])
    k = next(j for j in range(1, N + 1) if stop in pieces[j])
    rows = [(ids, {"max_tokens": N, "stop": [stop], "min_tokens": m}) for m in (0, k - 1, k, N)]
    expected = run_oracle(STOP_ORACLE, vllm_model, json.dumps(ENGINE_ARGS), json.dumps(rows))
    for (_, kw), want in zip(rows, expected, strict=True):
        params = SamplingParams(**kw)
        d = detokenizer(tok, params)
        text = "".join(d.add([t]) for t in fused(engines[0], ids, params)) + d.flush()
        assert text == want, kw
    assert len(set(expected)) >= 2  # min_tokens moved the stop
