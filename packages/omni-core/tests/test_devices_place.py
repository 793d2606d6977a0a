"""Where a stage's models go, decided in its worker: the device and the dtype, and the
error when a GPU is asked for where torch sees none (this machine: a CPU build)."""

import sys
import types

import pytest

torch = pytest.importorskip(
    "torch", reason="needs torch, which omni-core does not bring (runs in the workspace)"
)

from omni_core.events import StageStats  # noqa: E402
from omni_core.observability.gpu_stats import GpuProbe, nvml_device  # noqa: E402
from omni_core.placement import DeviceError, cpu_has_bf16, default_dtype, place  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def test_devices_cpu_is_the_cpu_in_float32():
    p = place("s", "")
    assert (p.device, p.dtype, p.is_gpu) == ("cpu", "float32", False)
    assert place("s", "", "bfloat16").dtype == "bfloat16"
    assert place("s", "", "auto").dtype == "float32"


@no_cuda
def test_no_devices_key_is_the_cpu_where_torch_sees_no_gpu():
    assert place("s", None) == place("s", "")


@no_cuda
def test_a_gpu_asked_for_where_there_is_none_names_stage_devices_and_what_torch_sees():
    with pytest.raises(DeviceError) as e:
        place("sample", "0,1")
    msg = str(e.value)
    assert "stage 'sample'" in msg and "'0,1'" in msg
    assert torch.__version__ in msg and "0 device(s)" in msg and "devices: cpu" in msg


def test_an_unknown_dtype_is_refused():
    with pytest.raises(DeviceError, match="dtype 'float8'"):
        place("s", "", "float8")


def test_gpu_dtype_default_follows_bf16_support(monkeypatch):
    assert default_dtype("cpu") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert default_dtype("cuda:0") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert default_dtype("cuda:0") == "float16"


SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
EPYC_ROME = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd atomics\n"


def test_cpu_bf16_is_read_from_the_cpus_flags():
    assert cpu_has_bf16(SAPPHIRE_RAPIDS) and cpu_has_bf16(GRAVITON3)
    assert not cpu_has_bf16(EPYC_ROME) and not cpu_has_bf16(GRAVITON2)
    assert not cpu_has_bf16("") and not cpu_has_bf16("flags: avx512_bf16x\n")  # whole flags
    assert cpu_has_bf16("flags\t: avx512bw\n") is False  # AVX-512 alone emulates bf16
    assert isinstance(cpu_has_bf16(), bool)  # this machine's, whatever it is


def test_cpu_bf16_can_be_forced_either_way(monkeypatch):
    monkeypatch.setenv("OMNI_CPU_BF16", "1")
    assert cpu_has_bf16() is True
    assert cpu_has_bf16(EPYC_ROME) is False  # given flags are read as they are
    monkeypatch.setenv("OMNI_CPU_BF16", "0")
    assert cpu_has_bf16() is False
    monkeypatch.setenv("OMNI_CPU_BF16", "yes")
    with pytest.raises(ValueError, match="OMNI_CPU_BF16='yes': expected 0 or 1"):
        cpu_has_bf16()


def test_nvml_finds_the_first_visible_gpu_by_index_or_uuid():
    assert nvml_device(None) == ("index", 0)
    assert nvml_device("3,1") == ("index", 3)
    assert nvml_device("GPU-8f3a,GPU-11") == ("uuid", "GPU-8f3a")


def test_gpu_figures_come_from_torch_once_cuda_is_in_use(monkeypatch):
    stats = StageStats()
    GpuProbe("0").sample(stats)  # CUDA never initialised here: nothing reported
    assert (stats.gpu_mem_allocated_bytes, stats.gpu_util_pct) == (0, None)
    fake_cuda = types.SimpleNamespace(
        is_initialized=lambda: True,
        memory_allocated=lambda: 3 << 20,
        memory_reserved=lambda: 8 << 20,
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=fake_cuda))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML: memory figures only
    GpuProbe("0").sample(stats)
    assert stats.gpu_mem_allocated_bytes == 3 << 20
    assert stats.gpu_mem_reserved_bytes == 8 << 20
    assert stats.gpu_util_pct is None
