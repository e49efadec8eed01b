"""--quantize-base nf4|int8: the frozen base's language-model linear layers held by bitsandbytes (QLoRA).

For small cards: the 4B base drops from 8.3 GiB (bf16) to about 2.6 GiB (nf4; train/memplan.py counts 0.53
bytes per weight, scales included). It changes the model (the forward sees dequantized weights), so it is
never switched on by `--zero-stage auto`; LoRA trains in bf16 on top. The vision tower and the lm_head stay
in bf16: the tower runs frozen without autograd and is cheap, and the chunked loss uses the lm_head weight
directly. bitsandbytes weights cannot be ZeRO-3 partitioned, so this runs with ZeRO <= 2 (refused in
TrainConfig). CUDA only; refused elsewhere with the reason.
"""
from __future__ import annotations

import importlib.util

import torch

SKIP_MODULES = ["visual", "lm_head"]  # kept in the model dtype


def quantization_kwargs(mode: str) -> dict:
    """The BitsAndBytesConfig arguments of `mode` (plain data, so it is testable without bitsandbytes)."""
    if mode == "nf4":
        return {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                "bnb_4bit_compute_dtype": torch.bfloat16, "llm_int8_skip_modules": list(SKIP_MODULES)}
    if mode == "int8":
        return {"load_in_8bit": True, "llm_int8_skip_modules": list(SKIP_MODULES)}
    raise ValueError(f"--quantize-base {mode!r}: choose nf4 or int8")


def quantize_problem(device_type: str) -> str | None:
    """Why --quantize-base cannot run here, or None."""
    if device_type != "cuda":
        return f"--quantize-base needs a CUDA device (bitsandbytes kernels); this run is on {device_type}"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "--quantize-base needs bitsandbytes (pip install bitsandbytes); it is not importable here"
    return None


def from_pretrained_kwargs(mode: str | None, local_rank: int) -> dict:
    """Extra from_pretrained arguments: the quantization config, and the rank's device (bitsandbytes
    quantizes while placing the weights on the GPU)."""
    if mode is None:
        return {}
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(**quantization_kwargs(mode)), "device_map": {"": local_rank}}
