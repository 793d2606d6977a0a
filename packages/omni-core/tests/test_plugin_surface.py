"""``omni_core.plugin``, the plug-in API: exactly the names its stability rule covers, each
documented, light to import (the zygote imports stage modules before it forks), and the
context's placement as a stage calls it."""

from __future__ import annotations

import inspect
import subprocess
import sys

import omni_core
import pytest
from omni_core import plugin
from omni_core.plugin import DeviceError, StageContext

# The contract (omni_core/plugin.py's docstring: what a release may change). A name added or
# removed here is a change of the public API: the docs and the release notes say so.
SURFACE = {
    "IMAGE_INPUT_FORMATS",
    "MEDIA_TYPE",
    "PRIORITY_KEY",
    "ConfigSection",
    "DeviceError",
    "Error",
    "ImageProgress",
    "NamedModel",
    "OptionNames",
    "Placement",
    "Reporter",
    "SchedulerPolicy",
    "Segment",
    "Spelling",
    "SpellingError",
    "Stage",
    "StageContext",
    "StageEvent",
    "StageInput",
    "UserInputError",
    "Window",
    "apply_thread_env",
    "build_once",
    "cached",
    "cpu_has_bf16",
    "default_dtype",
    "installed_models",
    "usable_cores",
}
CONSTANTS = {
    "IMAGE_INPUT_FORMATS",
    "MEDIA_TYPE",
    "PRIORITY_KEY",
    "SchedulerPolicy",
    "StageEvent",
    "ConfigSection",
    "OptionNames",
}


def test_the_surface_is_exactly_the_listed_names():
    assert set(plugin.__all__) == SURFACE
    assert len(plugin.__all__) == len(SURFACE)  # no name listed twice
    public = {n for n in vars(plugin) if not n.startswith("_") and n != "annotations"}
    assert public == SURFACE, "a name in omni_core.plugin that __all__ does not list"


@pytest.mark.parametrize("name", sorted(SURFACE - CONSTANTS))
def test_each_class_and_function_is_documented(name):
    obj = getattr(plugin, name)
    assert inspect.getdoc(obj), f"omni_core.plugin.{name} has no docstring"
    if inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if callable(member) and not attr.startswith("_"):
                assert inspect.getdoc(member), f"{name}.{attr} has no docstring"


def test_the_top_level_names_a_stage_uses_are_the_same_objects():
    for name in ("Stage", "StageContext", "StageInput", "StageEvent", "Segment", "Window"):
        assert getattr(omni_core, name) is getattr(plugin, name)


def test_importing_the_surface_loads_no_torch_and_starts_no_thread():
    code = (
        "import sys, threading, omni_core.plugin\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_context_places_a_stage_on_the_cpu_and_names_it_when_it_cannot():
    pytest.importorskip("torch", reason="placement imports torch (the workspace has it)")
    import torch

    cpu = StageContext(name="talker", kind="x.talker", options={}, devices="")
    assert (cpu.place().device, cpu.place().dtype) == ("cpu", "float32")
    assert cpu.place("bfloat16").dtype == "bfloat16"
    with pytest.raises(DeviceError, match="stage 'talker': dtype 'int8'"):
        cpu.place("int8")
    if torch.cuda.is_available():
        return
    gpu = StageContext(name="talker", kind="x.talker", options={}, devices="1")
    with pytest.raises(DeviceError, match="stage 'talker': devices '1' asks for a GPU"):
        gpu.place()
