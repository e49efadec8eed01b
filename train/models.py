"""Model families, the tiny random-weight models used by tests and the demo, and real-size shapes.

Tiny models are built from a config with the real transformers classes, saved with `save_pretrained` next
to the shipped tokenizer, and loaded back through the ordinary loading path, so nothing needs a hub.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from schemas.prompt import load_tokenizer, special_id

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
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


def create_random_model(name: str, out_dir: str | Path, *, seed: int = 0, dtype=torch.float32) -> Path:
    """Build the random-weight model `name` (a file in train/configs) with the bundled tokenizer, save both."""
    from transformers import AutoModelForImageTextToText

    out_dir = Path(out_dir)
    family, shape = load_shape(name)
    tokenizer = load_tokenizer()
    config = build_config(family, shape, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def ensure_tiny_model(family: str, cache_dir: str | Path) -> Path:
    """The tiny random model of `family` under cache_dir, created on first use."""
    out = Path(cache_dir) / f"tiny_{family}"
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".tmp")
        create_random_model(f"tiny_{family}", tmp)
        tmp.rename(out)
    return out
