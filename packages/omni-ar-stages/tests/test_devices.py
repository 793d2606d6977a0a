"""Where the AR stages put their models (``devices`` and ``dtype``, through
:meth:`omni_core.plugin.StageContext.place`), and the vLLM engine's settings by device.

On a machine whose torch sees no GPU, a model-bearing stage given ``devices: "0"`` fails
its load with the placement's message; ``devices: cpu`` runs as before, bit for bit. The
GPU side itself (models on ``cuda:0``, bfloat16 by default) needs a GPU to run.
"""

import importlib.util
import os
import subprocess
import sys

import msgspec
import pytest
import torch
from omni_ar.engines import vllm_engine
from omni_ar.engines.transformers_engine import TransformersEngine
from omni_ar.engines.vllm_engine import engine_settings, set_vllm_env
from omni_ar.multimodal.stages import MMDecode, MMPrefill
from omni_ar.params import SamplingParams, params_payload
from omni_ar.stages.decode import Decode
from omni_ar.stages.intake import Intake
from omni_ar.stages.postprocess import Postprocess
from omni_ar.stages.prefill import Prefill
from omni_ar.stages.talker import Talker
from omni_ar.text_encode import TextEncode
from omni_core import Pipeline, StageInput
from omni_core.config import ConfigError, parse_config
from omni_core.dataplane.windows import Piece, Window
from omni_core.errors import StageStartError
from omni_core.plugin import DeviceError
from omni_core.stage import StageContext
from transformers import AutoModelForCausalLM, AutoTokenizer

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from omni_ar.multimodal.testing import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava")))


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy tokens of ``model.generate`` in this process (float32, CPU)."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = tok(PROMPT)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    return out[0, len(ids) :].tolist()


def stage(cls, kind, model, devices=None, **options):
    return cls(StageContext("s", kind, {"model": model, **options}, devices=devices))


MODEL_STAGES = [
    (Prefill, "ar.prefill"),
    (Decode, "ar.decode"),
    (Talker, "ar.talker"),
    (TextEncode, "ar.text_encode"),
]
MM_STAGES = [(MMPrefill, "ar.mm_prefill"), (MMDecode, "ar.mm_decode")]


# -- the vLLM engine's settings, chosen by device (no vLLM needed) ------------------------


def test_vllm_settings_on_the_cpu_follow_its_bf16(monkeypatch):
    monkeypatch.setenv("OMNI_CPU_BF16", "0")  # a CPU without native bfloat16
    assert engine_settings("cpu", "auto") == {"enforce_eager": True, "dtype": "float32"}
    monkeypatch.setenv("OMNI_CPU_BF16", "1")  # one with it: vLLM's own choice there
    assert engine_settings("cpu", "auto") == {"enforce_eager": True, "dtype": "bfloat16"}
    assert engine_settings("cpu", "float32") == {"enforce_eager": True, "dtype": "float32"}
    assert engine_settings("cpu", "bfloat16", 0.5) == {"enforce_eager": True, "dtype": "bfloat16"}


def test_vllm_settings_on_a_gpu_size_the_kv_cache_and_keep_cuda_graphs():
    assert engine_settings("cuda:0", "auto") == {"dtype": "auto", "gpu_memory_utilization": 0.9}
    args = engine_settings("cuda:0", "float16", 0.45)
    assert args == {"dtype": "float16", "gpu_memory_utilization": 0.45}
    assert "enforce_eager" not in args
    assert engine_settings("cuda:0", "auto", 1.0)["gpu_memory_utilization"] == 1.0


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, 2])
def test_vllm_gpu_memory_utilization_must_be_a_share(bad):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization .*expected 0 < x <= 1"):
        engine_settings("cuda:0", "auto", bad)


def test_vllm_environment_by_device(monkeypatch):
    for var in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    # not this test process's thread counts (their own test follows)
    monkeypatch.setattr(vllm_engine, "apply_thread_env", lambda: None)
    set_vllm_env(None, "cuda:0")
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # a CPU-only setting
    # engine args with kv_cache_memory_bytes: no default that vllm-cpu would put above them
    set_vllm_env(None, "cpu", kv_cache_sized=True)
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    set_vllm_env(None, "cpu")
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_vllm_environment_sets_one_thread_where_torch_is_already_loaded():
    """A worker forked from the zygote has torch loaded before the engine sets
    OMP_NUM_THREADS: the count is applied anyway (as a spawned worker's would be)."""
    code = (
        "import torch; torch.set_num_threads(2); "
        "from omni_ar.engines.vllm_engine import set_vllm_env; set_vllm_env(); "
        "print(torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1"]


@no_gpu
def test_a_vllm_engine_without_a_device_takes_the_cpu_where_torch_sees_no_gpu(monkeypatch):
    from omni_ar.engines.vllm_engine import VllmEngine

    for var in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS"):
        monkeypatch.setenv(var, "1")  # restored afterwards; the engine only sets defaults
    engine = VllmEngine("unused", dtype="auto")  # nothing loads before load_model
    assert engine.device == "cpu" and engine.settings == engine_settings("cpu", "float32")


# -- options ------------------------------------------------------------------------------


def _config(kind, **options):
    return {"stages": [{"name": "s", "kind": kind, "options": {"model": "m", **options}}]}


@pytest.mark.parametrize("kind", ["ar.prefill", "ar.decode", "ar.text_encode", "ar.mm_decode"])
def test_dtype_is_auto_or_a_torch_float_type(kind):
    parse_config(_config(kind, dtype="bfloat16"))
    with pytest.raises(ConfigError, match=r"stages\[0\]\.options\.dtype"):
        parse_config(_config(kind, dtype="float64"))


@pytest.mark.parametrize("kind", ["ar.prefill", "ar.decode", "ar.text_encode", "ar.mm_decode"])
def test_threads_is_a_positive_count_or_all(kind):
    for good in (1, 3, "all"):
        parse_config(_config(kind, threads=good))
    for bad in (0, -1, "every"):
        with pytest.raises(ConfigError, match=r"stages\[0\]\.options\.threads"):
            parse_config(_config(kind, threads=bad))


@pytest.mark.parametrize("cls,kind", MODEL_STAGES + MM_STAGES, ids=lambda v: str(v))
def test_threads_all_is_every_core_the_worker_may_run_on(tiny_model, llava, cls, kind):
    """``all`` is counted where the stage loads: the process's CPU affinity."""
    from omni_core.plugin import usable_cores

    model = llava if kind.startswith("ar.mm_") else tiny_model
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stage(cls, kind, model, devices="", threads="all").load()
        assert torch.get_num_threads() == usable_cores() == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, 1.5])
def test_gpu_memory_utilization_option_is_checked_at_config_load(bad):
    parse_config(_config("ar.decode", engine="vllm", gpu_memory_utilization=0.4))
    with pytest.raises(ConfigError, match=r"stages\[0\]\.options\.gpu_memory_utilization"):
        parse_config(_config("ar.decode", engine="vllm", gpu_memory_utilization=bad))


@pytest.mark.parametrize("kind", ["ar.intake", "ar.mm_intake"])
def test_the_default_max_tokens_must_lie_within_the_limit_at_config_load(kind):
    parse_config(_config(kind, max_tokens_limit=8, default_max_tokens=8))  # at the limit
    with pytest.raises(ConfigError, match=r"stages\[0\]\.options: default_max_tokens 9 is"):
        parse_config(_config(kind, max_tokens_limit=8, default_max_tokens=9))  # one past
    with pytest.raises(ConfigError, match=r"default_max_tokens 16 is not in 1\.\.max_tokens_limit"):
        parse_config(_config(kind, max_tokens_limit=8))  # the default over a lower limit
    with pytest.raises(ConfigError, match=r"default_max_tokens 0 is not in"):
        parse_config(_config(kind, default_max_tokens=0))


# -- placement of the model-bearing stages ------------------------------------------------


@no_gpu
@pytest.mark.parametrize("cls,kind", MODEL_STAGES + MM_STAGES, ids=lambda v: str(v))
def test_a_gpu_torch_does_not_see_fails_the_load(tiny_model, llava, cls, kind):
    model = llava if kind.startswith("ar.mm_") else tiny_model
    s = stage(cls, kind, model, devices="0")
    with pytest.raises(DeviceError, match=r"stage 's': devices '0' asks for a GPU.*sees none"):
        s.load()


@pytest.mark.parametrize(
    "cls,kind", [(Intake, "ar.intake"), (Postprocess, "ar.postprocess")], ids=str
)
def test_tokenizer_stages_hold_no_model_and_place_nothing(tiny_model, cls, kind):
    s = stage(cls, kind, tiny_model, devices="0")
    s.load()  # a tokenizer only: its devices do not matter
    assert s.engine.model is None


@pytest.mark.parametrize("cls,kind", MODEL_STAGES + MM_STAGES, ids=lambda v: str(v))
def test_devices_cpu_loads_on_the_cpu_in_float32(tiny_model, llava, cls, kind):
    model = llava if kind.startswith("ar.mm_") else tiny_model
    s = stage(cls, kind, model, devices="")  # devices: cpu
    s.load()
    assert s.engine.device == "cpu" and s.engine.dtype == "float32"
    params = list(s.engine.model.parameters())
    assert {p.device.type for p in params} == {"cpu"}
    assert {p.dtype for p in params} == {torch.float32}


@pytest.mark.parametrize("bf16,want", [("1", torch.bfloat16), ("0", torch.float32)])
@pytest.mark.parametrize("cls,kind", MODEL_STAGES[:3], ids=lambda v: str(v))
def test_dtype_auto_on_the_cpu_is_bfloat16_where_the_cpu_computes_it(
    tiny_model, monkeypatch, cls, kind, bf16, want
):
    """``dtype: auto`` (the default) on the CPU loads a model in bfloat16 on a CPU with
    native bfloat16 (as vLLM's server does there), float32 elsewhere; a dtype the config
    names is kept either way; ``ar.text_encode`` (the DiT's conditioning) stays float32."""
    monkeypatch.setenv("OMNI_CPU_BF16", bf16)
    s = stage(cls, kind, tiny_model, devices="")
    s.load()
    assert s.engine.dtype == str(want).removeprefix("torch.")
    assert {p.dtype for p in s.engine.model.parameters()} == {want}
    named = stage(cls, kind, tiny_model, devices="", dtype="float32")
    assert named._placement() == ("cpu", "float32")
    assert stage(cls, kind, tiny_model, devices="", engine="vllm")._placement() == (
        "cpu",
        str(want).removeprefix("torch."),
    )


def test_a_bfloat16_cpu_runs_the_workers_in_bfloat16_end_to_end(tiny_model, monkeypatch):
    """On a CPU with bfloat16 a pipeline at ``dtype: auto`` loads its models in bfloat16
    in its worker processes (prefill's KV, as the caller sees it, is bfloat16), and the
    request completes; on one without, float32 (the KV float32 numpy)."""
    opts = {"model": tiny_model, "threads": 1}
    config = {
        "name": "bf16",
        "mrs": {"enabled": True},
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": {"model": tiny_model}},
            {"name": "prefill", "kind": "ar.prefill", "client_stream": True, "options": opts},
            {"name": "decode", "kind": "ar.decode", "options": opts},
        ],
        "edges": [{"from": "intake", "to": "prefill"}, {"from": "prefill", "to": "decode"}],
    }
    for bf16, want in (("1", "torch.bfloat16"), ("0", "float32")):
        monkeypatch.setenv("OMNI_CPU_BF16", bf16)  # the workers inherit it
        with Pipeline(config) as p:
            out = p.generate([{"prompt": PROMPT, "max_tokens": 8}])[0]
        assert out.ok, out.error
        (kv,) = [e for e in out.by_stage("prefill") if "keys" in e.arrays]
        assert str(kv.arrays["keys"].dtype) == want, bf16
        assert sum(len(e.tokens or []) for e in out.by_stage("decode")) == 8


def _run(s, tokens=None, arrays=None, payload=None, request=None):
    windows = {}
    if tokens is not None:
        windows["up"] = Window("up", 0, 0, 0, [Piece(0, tokens, arrays or {}, payload or {})], True)
    inp = StageInput("r", request or {"prompt": PROMPT, "max_tokens": 16}, windows, True, True)
    return [
        e
        for ev in s.process([inp])
        if ev is not None
        for e in (ev if isinstance(ev, list) else [ev])
    ]


def test_prefill_and_decode_on_the_cpu_equal_the_model(tiny_model, reference):
    """``devices: cpu`` and the default ``dtype: auto``: the KV crosses as float32 numpy
    arrays, and the tokens are ``model.generate``'s."""
    prefill, decode = (stage(c, k, tiny_model, devices="") for c, k in MODEL_STAGES[:2])
    prefill.load()
    decode.load()
    ids = prefill.engine.load_tokenizer()(PROMPT)["input_ids"]
    # the request's params, as ar.intake parses them and sends them on
    (ev,) = _run(prefill, ids, payload=params_payload(SamplingParams(max_tokens=16)))
    keys = ev.arrays["keys"]
    assert type(keys).__name__ == "ndarray" and keys.dtype == "float32"
    out = _run(decode, ev.tokens, ev.arrays, ev.payload)
    assert [t for e in out for t in e.tokens] == reference


def test_bfloat16_kv_crosses_as_a_cpu_tensor_and_decode_takes_it_in_its_dtype(tiny_model):
    """The path a GPU's default dtype takes, run on the CPU: a bfloat16 prefill hands out
    CPU torch tensors (numpy has no bfloat16); decode copies them to its own device and
    dtype (here float32), and a bfloat16 decode continues from them as a bfloat16
    engine does in one process."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    bf16 = TransformersEngine(tiny_model, dtype="bfloat16")
    bf16.load_tokenizer()
    bf16.load_model()
    ids = bf16.encode(PROMPT)
    first, _, keys, values = bf16.prefill(ids, params)
    assert isinstance(keys, torch.Tensor) and keys.dtype == torch.bfloat16
    assert keys.device.type == "cpu" and keys.shape == values.shape and keys.shape[2] == len(ids)
    staged = [first, *(t for t, _ in bf16.decode(first, keys, values, params))]
    assert staged == bf16.generate(PROMPT, params)
    f32 = TransformersEngine(tiny_model, dtype="auto")  # float32 on the CPU
    f32.load_model()
    assert f32.dtype == "float32"
    assert len(list(f32.decode(first, keys, values, params))) == params.max_tokens - 1


def test_a_seed_gives_the_same_tokens_on_every_run(tiny_model):
    engine = TransformersEngine(tiny_model, device="cpu")
    engine.load_tokenizer()
    engine.load_model()
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    assert engine.generator(params).device.type == "cpu"
    runs = [engine.generate(PROMPT, params) for _ in range(2)]
    other = engine.generate(PROMPT, msgspec.structs.replace(params, seed=8))
    assert runs[0] == runs[1] and runs[0] != other


def test_requests_without_a_seed_sample_apart(tiny_model):
    """No seed is no fixed seed: unseeded requests at temperature 1 on the random tiny
    model do not repeat one another (12 tokens from a near-flat distribution over its
    vocabulary), whether generated whole or prefilled and decoded."""
    engine = TransformersEngine(tiny_model, device="cpu")
    engine.load_tokenizer()
    engine.load_model()
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    whole = [tuple(engine.generate(PROMPT, params)) for _ in range(3)]
    assert len(set(whole)) == 3
    ids = engine.encode(PROMPT)
    staged = []
    for _ in range(3):
        first, _, keys, values = engine.prefill(ids, params)
        staged.append((first, *(t for t, _ in engine.decode(first, keys, values, params))))
    assert len(set(staged)) == 3


def test_text_encode_on_the_cpu_emits_float32_numpy(tiny_model):
    s = stage(TextEncode, "ar.text_encode", tiny_model, devices="", max_tokens=8)
    s.load()
    (ev,) = _run(s, request={"prompt": PROMPT})
    assert (
        ev.arrays["prompt_embeds"].dtype == "float32" and ev.arrays["prompt_embeds"].shape[0] == 8
    )


# -- in a running pipeline -----------------------------------------------------------------


def ar_config(model, devices):
    opts = {"model": model, "threads": 1}
    return {
        "heartbeat_interval_s": 0.1,
        "stages": [
            {"name": "intake", "kind": "ar.intake", "options": {"model": model}},
            {"name": "prefill", "kind": "ar.prefill", "devices": devices, "options": opts},
            {"name": "decode", "kind": "ar.decode", "devices": devices, "options": opts},
            {"name": "postprocess", "kind": "ar.postprocess", "options": {"model": model}},
        ],
        "edges": [
            {"from": "intake", "to": "prefill"},
            {"from": "prefill", "to": "decode"},
            {"from": "decode", "to": "postprocess"},
        ],
    }


@no_gpu
def test_pipeline_with_a_gpu_stage_on_a_cpu_machine_fails_to_start(tiny_model):
    cfg = ar_config(tiny_model, "cpu")
    cfg["stages"][1]["devices"] = "0"
    with pytest.raises(StageStartError) as e:
        Pipeline(cfg).start()
    msg = str(e.value)
    assert "stage 'prefill' (kind 'ar.prefill') failed to load" in msg, msg
    assert "DeviceError: stage 'prefill': devices '0' asks for a GPU" in msg, msg
    assert "sees none" in msg and "CUDA_VISIBLE_DEVICES='0'" in msg, msg


def test_pipeline_with_devices_cpu_equals_the_model(tiny_model, reference):
    with Pipeline(ar_config(tiny_model, "cpu")) as pipe:
        out = pipe.generate([{"prompt": PROMPT, "max_tokens": 16}])[0]
    assert out.ok, out.error
    assert [t for e in out.by_stage("postprocess") for t in e.tokens] == reference


def test_the_mm_prefix_cache_keeps_bfloat16_kv_as_cpu_tensors():
    from omni_ar.multimodal.handoff import PrefixCache

    cache = PrefixCache(8)
    keys = torch.arange(2 * 2 * 8 * 4, dtype=torch.bfloat16).reshape(2, 2, 8, 4)
    cache.put(["a", "b"], keys, -keys, 4)  # two blocks of 4 positions
    keys[:] = 0  # the cache holds copies
    k, v = cache.get(["a", "b"])
    assert k.dtype == torch.bfloat16 and k.shape == (2, 2, 8, 4) and k.device.type == "cpu"
    assert torch.equal(v, -k) and k.float().abs().sum() > 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllms_logs_go_to_stderr_and_leave_stdout_to_the_callers_output():
    # `omni bench priority --json` printed vLLM's warnings into its JSON on stdout
    code = (
        "from omni_ar.engines.vllm_engine import set_vllm_env; set_vllm_env(); "
        "from vllm.logger import init_logger; init_logger('vllm.probe').warning('PROBE'); "
        "print('OUTPUT')"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["OUTPUT"]
    assert "PROBE" in out.stderr
