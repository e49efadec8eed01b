"""Model families, the tiny random-weight models used by tests and the demo, real-size shapes, and the
processor files every saved model directory carries.

Tiny models are built from a config with the real transformers classes, saved with `save_pretrained` next
to the shipped tokenizer and a processor config, and loaded back through the ordinary loading path, so
nothing needs a hub and `AutoProcessor.from_pretrained(dir)` works on every directory the package writes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from schemas.prompt import load_tokenizer, special_id

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# What a Qwen-VL model directory holds besides weights and tokenizer for AutoProcessor (5.x writes the first;
# hub checkpoints ship the two per-processor files)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
FAMILIES = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration"}


def detect_family(model_dir: str | Path) -> str:
    """qwen3_vl or qwen3_5, from config.json's model_type."""
    cfg = Path(model_dir) / "config.json"
    if not cfg.exists():
        raise FileNotFoundError(f"{cfg} not found: --model must be a save_pretrained directory")
    model_type = json.loads(cfg.read_text()).get("model_type", "")
    if model_type not in FAMILIES:
        raise ValueError(f"{cfg}: model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    return model_type


def load_pretrained(model_dir: str | Path, **kwargs):
    """`AutoModelForImageTextToText.from_pretrained` as every stage of the package loads a model: with the
    Hub's kernels off. From transformers 5.25 `from_pretrained` kernelizes by default (the `kernels` package
    swaps layer forwards for kernels fetched from the Hub): offline clusters never reach the Hub, and the
    trainer chooses its kernels itself (train/kernels.py)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), use_kernels=False, **kwargs)


def token_ids(tokenizer) -> dict[str, int]:
    return {
        "image_token_id": special_id(tokenizer, "<|image_pad|>"),
        "video_token_id": special_id(tokenizer, "<|video_pad|>"),
        "vision_start_token_id": special_id(tokenizer, "<|vision_start|>"),
        "vision_end_token_id": special_id(tokenizer, "<|vision_end|>"),
    }


def build_config(family: str, shape: dict, tokenizer=None):
    """A transformers config for `family` with `shape` ({"text": {...}, "vision": {...}}) and the
    tokenizer's special ids (the tokenizer's vocabulary size unless the shape names one)."""
    from transformers import Qwen3_5Config, Qwen3VLConfig

    text, vision = dict(shape["text"]), dict(shape["vision"])
    ids = {}
    if tokenizer is not None:
        ids = token_ids(tokenizer)
        text.setdefault("vocab_size", len(tokenizer))
        text.setdefault("eos_token_id", special_id(tokenizer, "<|im_end|>"))
        text.setdefault("pad_token_id", tokenizer.pad_token_id)
    cls = {"qwen3_vl": Qwen3VLConfig, "qwen3_5": Qwen3_5Config}[family]
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=shape.get("tie_word_embeddings", False), **ids)


def load_shape(name: str) -> tuple[str, dict]:
    """(family, shape) from train/configs/<name>.json."""
    data = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    return data["family"], data


def create_random_model(name: str, out_dir: str | Path, *, seed: int = 0, dtype=torch.float32,
                        device: str = "cpu") -> Path:
    """Build the random-weight model `name` (a file in train/configs) with the bundled tokenizer, save both.
    device="cuda" initializes on the GPU (a 4B model in seconds instead of minutes on the CPU)."""
    from transformers import AutoModelForImageTextToText

    out_dir = Path(out_dir)
    family, shape = load_shape(name)
    tokenizer = load_tokenizer()
    config = build_config(family, shape, tokenizer)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir)
    save_processor(out_dir, model_config=config, tokenizer=tokenizer)
    return out_dir


def save_processor(out_dir: str | Path, *, model_config, tokenizer, source_dir: str | Path | None = None) -> Path:
    """Make out_dir open with `AutoProcessor.from_pretrained`: the tokenizer (with its chat template), and
    the processor files of source_dir (the base model directory) copied verbatim when it has them, else a
    processor_config.json with the model's own vision geometry (both families use transformers'
    Qwen3VLProcessor). Written as JSON, so saving needs no torchvision; loading it does (transformers')."""
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(str(out_dir))
    found = [Path(source_dir) / n for n in PROCESSOR_FILES if source_dir is not None and (Path(source_dir) / n).is_file()]
    if found:
        for path in found:
            if path.resolve() != (out_dir / path.name).resolve():
                shutil.copyfile(path, out_dir / path.name)
        return out_dir
    vision = model_config.vision_config
    geometry = {"patch_size": _side(vision.patch_size), "temporal_patch_size": vision.temporal_patch_size,
                "merge_size": vision.spatial_merge_size, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    config = {"processor_class": "Qwen3VLProcessor",
              "image_processor": {"image_processor_type": "Qwen2VLImageProcessor", **geometry},
              "video_processor": {"video_processor_type": "Qwen3VLVideoProcessor", **geometry}}
    (out_dir / PROCESSOR_FILES[0]).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def _side(v) -> int:
    return int(v[0] if isinstance(v, (list, tuple)) else v)


def ensure_tiny_model(family: str, cache_dir: str | Path) -> Path:
    """The tiny random model of `family` under cache_dir, created on first use."""
    out = Path(cache_dir) / f"tiny_{family}"
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".tmp")
        create_random_model(f"tiny_{family}", tmp)
        tmp.rename(out)
    elif not any((out / n).is_file() for n in PROCESSOR_FILES):  # created by an older version: add them
        from transformers import AutoConfig

        save_processor(out, model_config=AutoConfig.from_pretrained(out), tokenizer=load_tokenizer())
    return out
