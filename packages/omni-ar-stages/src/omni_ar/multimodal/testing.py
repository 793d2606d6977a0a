"""A tiny Llava (CLIP vision tower + Llama) with random weights, and synthetic images.

Built from configs in about a second, nothing downloaded or committed; untied embeddings
and a large init range keep greedy output varied, and images change it.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from omni_ar.testing import build_tokenizer, tiny_llama_config

IMAGE_SIZE = 32  # the vision tower's input (shortest edge resized, then center-cropped)
PATCH = 8  # -> (32 / 8)^2 = 16 placeholders per image


def build_tiny_llava(path: str | Path, seed: int = 0, for_vllm: bool = False) -> Path:
    """Write a tiny Llava checkpoint and its processor into ``path``; returns it.
    ``for_vllm``: one vLLM's CPU backend runs (attention heads of 32, which its
    kernels need, and the vision tower's weights under ``vision_tower.vision_model.``,
    where vLLM's Llava looks for them; transformers loads it too)."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    try:  # transformers >= 5.20 names the PIL backend apart (the default needs torchvision)
        from transformers.models.clip.image_processing_pil_clip import (
            CLIPImageProcessorPil as CLIPImageProcessor,
        )
    except ImportError:
        from transformers import CLIPImageProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(extra_special=("<image>",))
    text = tiny_llama_config(len(tok), head_dim=32 if for_vllm else None)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        initializer_range=0.2,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(cfg).eval().save_pretrained(path)
    if for_vllm:
        _vision_model_keys(path / "model.safetensors")
    images = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by "default"
    ).save_pretrained(path)
    return path


QWEN_PATCH = 8  # Qwen2-VL's tiny vision patches (merged 2x2 into one placeholder each)
QWEN_SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_tiny_qwen2_vl(
    path: str | Path, seed: int = 0, version: str = "2.5", for_vllm: bool = False
) -> Path:
    """Write a tiny random Qwen2-VL (``version="2"``) or Qwen2.5-VL (``"2.5"``) checkpoint,
    its tokenizer and its image processor into ``path``; returns it. M-RoPE over
    (time, height, width), dynamic resolution: an image of H x W pixels becomes
    about ``H * W / 16**2`` placeholders (patches of 8, merged 2 x 2), between 1 and 64.
    ``for_vllm``: attention heads of 32, which vLLM's CPU kernels need. Where torchvision
    is installed the model's processor (with its video processor) is saved too, as
    vLLM loads it; transformers' image processor alone needs no torchvision."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLConfig

    try:  # transformers >= 5.20 names the PIL backend apart (the default needs torchvision)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    if version not in ("2", "2.5"):
        raise ValueError(f"version: expected '2' or '2.5', got {version!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(extra_special=QWEN_SPECIAL)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    head_dim = 32 if for_vllm else 16
    text = {
        "vocab_size": len(tok),
        "hidden_size": 4 * head_dim,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
        # the rotary frequencies (head_dim / 2) split over (time, height, width), as
        # Qwen2-VL's 128-dim heads split theirs 16 / 24 / 24
        "rope_scaling": {
            "type": "mrope",
            "mrope_section": [head_dim // 8, *[3 * head_dim // 16] * 2],
        },
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    vision: dict[str, Any] = {
        "depth": 2,
        "hidden_size": 4 * head_dim,
        "num_heads": 2,
        "patch_size": QWEN_PATCH,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": 0.2,
    }
    if version == "2":
        vision |= {"embed_dim": 32, "mlp_ratio": 2}
        config_cls: Any = Qwen2VLConfig
    else:
        vision |= {
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 4 * head_dim,
            "window_size": 2 * QWEN_PATCH * 2,
            "fullatt_block_indexes": [1],
        }
        config_cls = Qwen2_5_VLConfig
    cfg = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(cfg).eval().save_pretrained(path)
    images = ImageProcessor(
        min_pixels=(QWEN_PATCH * 2) ** 2,
        max_pixels=64 * (QWEN_PATCH * 2) ** 2,
        patch_size=QWEN_PATCH,
        merge_size=2,
        temporal_patch_size=2,
    )
    tok.save_pretrained(path)
    images.save_pretrained(path)
    _save_qwen_processor(path, images, tok, version)
    return path


def _save_qwen_processor(path: Path, images: Any, tok: Any, version: str) -> None:
    """The model's processor config beside its parts, where torchvision is there to build
    its video processor (vLLM's Qwen2-VL loads the processor whole)."""
    try:
        from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor(patch_size=QWEN_PATCH, merge_size=2, temporal_patch_size=2)
    except (ImportError, ValueError, AttributeError):
        return
    cls = Qwen2VLProcessor if version == "2" else Qwen2_5_VLProcessor
    cls(image_processor=images, tokenizer=tok, video_processor=video).save_pretrained(path)


def _vision_model_keys(file: Path) -> None:
    """Rename the vision tower's tensors ``vision_tower.X`` -> ``vision_tower.vision_model.X``
    (transformers 5 saves CLIP's tower without its ``vision_model`` level)."""
    from safetensors.torch import load_file, save_file

    tower, nested = "vision_tower.", "vision_tower.vision_model."
    state = {
        tower + "vision_model." + k[len(tower) :]
        if k.startswith(tower) and not k.startswith(nested)
        else k: v
        for k, v in load_file(file).items()
    }
    save_file(state, file, metadata={"format": "pt"})


def synthetic_image(seed: int, width: int = 64, height: int = 48, fmt: str = "PNG") -> bytes:
    """An encoded image: smooth colour gradients with a few bright rectangles and mild
    noise (photo-like enough that JPEG compresses it as it would a photo)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, 3)
    freq = rng.uniform(1.0, 4.0, 3)
    rgb = np.stack(
        [
            127 + 100 * np.sin(freq[c] * (x / width + y / height) * np.pi + phase[c])
            for c in range(3)
        ],
        axis=-1,
    )
    for _ in range(4):
        x0, y0 = rng.integers(0, width // 2), rng.integers(0, height // 2)
        rgb[y0 : y0 + height // 4, x0 : x0 + width // 4] = rng.uniform(0, 255, 3)
    rgb += rng.normal(0, 4, rgb.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buf, format=fmt, quality=90)
    return buf.getvalue()


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG of ``width x height`` black pixels: some 1/1000 of its size decoded
    (12 MP, 36 MB as RGB, in about 35 KB)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def vllm_llava_missing() -> str | None:
    """Why vLLM's Llava does not import here (transformers' Pixtral image processor needs
    torchvision, see the ``vllm-mm`` environment), or None where it does."""
    try:
        import vllm.model_executor.models.llava  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


VLLM_ORACLE = """
import json, sys
import numpy as np
from PIL import Image
from vllm import LLM, SamplingParams
model, args, cases = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=model, enforce_eager=True, dtype="float32", **args)
inputs = []
for c in cases:
    one = {"prompt": c["prompt"]}
    if c["images"]:
        one["multi_modal_data"] = {"image": [Image.fromarray(np.load(p)) for p in c["images"]]}
    inputs.append(one)
params = [SamplingParams(max_tokens=c["max_tokens"], temperature=0) for c in cases]
outs = llm.generate(inputs, params, use_tqdm=False)
print("ORACLE" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def vllm_generate(
    model: str,
    cases: list[tuple[str, list[np.ndarray], int]],
    engine_args: dict[str, Any],
    tmp: str | Path,
) -> list[list[int]]:
    """vLLM's own ``LLM.generate``, greedy, of each (prompt text with one image marker per
    image, decoded RGB images, max_tokens), in a process of its own (the images pass
    through ``tmp`` as ``.npy`` files)."""
    import json

    from omni_ar.testing import run_oracle

    rows = []
    for i, (prompt, images, max_tokens) in enumerate(cases):
        paths = []
        for j, px in enumerate(images):
            paths.append(str(Path(tmp) / f"oracle-{i}-{j}.npy"))
            np.save(paths[-1], px)
        rows.append({"prompt": prompt, "images": paths, "max_tokens": max_tokens})
    most = max((len(c[1]) for c in cases), default=0)
    args = {**engine_args, "limit_mm_per_prompt": {"image": max(most, 1)}}
    return run_oracle(VLLM_ORACLE, model, json.dumps(args), json.dumps(rows), timeout=600)


def vllm_handoff_engines(model: str, engine_args: dict[str, Any]) -> list[Any]:
    """The two ends of the handoff on vLLM, loaded in this process: (prefill, a KV
    producer with the vision tower; decode, a media-free KV consumer)."""
    from omni_ar.engines.vllm_engine import VllmEngine

    out = []
    for role in ("kv_producer", "kv_consumer"):
        e = VllmEngine(model, kv_role=role, multimodal=True, engine_args=engine_args)
        e.load_model()
        out.append(e)
    return out


def chat_case(render: Any, request: dict[str, Any]) -> tuple[str, list[np.ndarray], int]:
    """A chat request as :func:`vllm_generate` takes it: the chat template's text with one
    image marker per image, as ``ar.mm_intake`` renders it (``render``: a
    :class:`~omni_ar.multimodal.engine.VLMEngine` with its tokenizer loaded, whose
    ``marker`` is the model's: Llava's ``<image>``, Qwen2-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``), its images decoded."""
    from omni_ar.multimodal.media import decode_image, flatten, image_parts, source_bytes

    msgs = request["messages"]
    text = render.tokenizer.apply_chat_template(
        flatten(msgs, render.marker), add_generation_prompt=True, tokenize=False
    )
    images = [decode_image(source_bytes(p, "x"), "x", 10**9) for _, p in image_parts(msgs)]
    return text, images, request["max_tokens"]
