"""The AR engines' contract (omni_ar.engines.protocol): each engine class is an instance
of the protocols it claims and of none it does not, a decode's steps say what they can
do, and a stage refuses an engine that is not an Engine, naming what it lacks. (mypy
proves the signatures: omni_ar.engines.conformance, in ``hatch run lint``.)"""

import pytest
from omni_ar.engines import load_engine
from omni_ar.engines.protocol import (
    Closable,
    Engine,
    HiddenStatesEngine,
    Preemptible,
    StreamingEngine,
    require_engine,
)
from omni_ar.params import SamplingParams
from omni_ar.stages import base
from omni_ar.stages.decode import Generate
from omni_ar.testing import require_vllm
from omni_core import StageContext


def test_the_transformers_engine_is_an_engine_with_hidden_states_and_no_stream(tiny_model):
    engine = load_engine("transformers", tiny_model)
    assert isinstance(engine, Engine)  # before its model loads, too
    assert isinstance(engine, HiddenStatesEngine)
    assert not isinstance(engine, StreamingEngine)  # ar.generate: prefill, then decode
    assert engine.eos_ids == set()  # an attribute of every engine, empty until it loads


def test_the_transformers_decode_steps_can_be_paused_and_closed(engine):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first, _, keys, values = engine.prefill(engine.encode("the quick brown"), params)
    steps = engine.decode(first, keys, values, params)
    assert isinstance(steps, Preemptible) and isinstance(steps, Closable)
    steps.close()
    assert list(steps) == []  # closed: out of the batch


def test_the_vllm_engine_is_an_engine_that_streams(tiny_model, restore_environment):
    require_vllm()
    from omni_ar.engines.vllm_engine import VllmEngine

    engine = VllmEngine(tiny_model)  # no model loaded: the contract holds already
    assert isinstance(engine, Engine)
    assert isinstance(engine, StreamingEngine)
    assert not isinstance(engine, HiddenStatesEngine)


def test_require_engine_names_what_an_object_lacks():
    class Half:
        tokenizer = None
        eos_ids: set[int] = set()

        def encode(self, source):
            return []

    with pytest.raises(TypeError, match="Half is not an AR engine: it lacks ") as e:
        require_engine(Half())
    missing = str(e.value).split("lacks ")[1].split(" (")[0].split(", ")
    assert missing == [
        "check_constraint",
        "check_tokens",
        "decode",
        "load_model",
        "load_tokenizer",
        "prefill",
        "prefill_many",
    ]


def test_a_stage_refuses_an_engine_that_is_not_one(tiny_model, monkeypatch):
    monkeypatch.setattr(base, "load_engine", lambda *args, **kwargs: object())
    stage = Generate(StageContext("generate", "ar.generate", {"model": tiny_model}))
    with pytest.raises(TypeError, match=r"object is not an AR engine: it lacks .*decode"):
        stage.load()
