"""omni_core knows no model hub: nothing of Hugging Face in its import graph or source.

What both stage families need of the hub (quiet logs, offline loads, hub error wording)
is ``omni_hf``'s (``packages/omni-hf``); the core keeps only the generic model cache.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import omni_core

SRC = Path(omni_core.__file__).parent
HUB = {
    "huggingface_hub",
    "transformers",
    "diffusers",
    "tokenizers",
    "safetensors",
    "accelerate",
    "gguf",
    "omni_hf",
}


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_hub_import_or_setting_in_the_source():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    for f in files:
        assert not _imported(f) & HUB, f"{f.relative_to(SRC)} imports {_imported(f) & HUB}"
        text = f.read_text()
        for word in ("HF_HUB", "HF_HOME", "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY"):
            assert word not in text, f"{f.relative_to(SRC)} mentions {word}"


def test_importing_every_module_loads_no_hub_library():
    """Every omni_core module imported in a fresh interpreter: no hub module loaded."""
    code = (
        "import importlib, pkgutil, sys, omni_core\n"
        "for m in pkgutil.walk_packages(omni_core.__path__, 'omni_core.'):\n"
        "    importlib.import_module(m.name)\n"
        f"print(sorted(n for n in sys.modules if n.split('.')[0] in {sorted(HUB)!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
