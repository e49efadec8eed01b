"""Useful FLOPs of a training step, for MFU (model FLOPs utilisation = useful FLOPs / (seconds x peak)).

Counted (a multiply-add = 2 FLOPs), the convention of issue 9:
- language model, LoRA on a frozen base: forward 2·N·T plus the activation gradients 2·N·T = 4·N·T, N = the
  decoder layers' linear weights (no weight gradients for the frozen base; LoRA's own matmuls, r << hidden,
  ignored); full fine-tune adds the weight gradients, 6·N·T. Recompute under checkpointing is not useful work.
- causal attention (full-attention layers): QK^T and PV over the causal half, 2·T²·q per layer forward,
  counted x4 (forward, its recompute, and the backward's two matmul pairs), i.e. with recompute as the issue
  states; a packed row counts each sample's T² alone. Qwen3.5's linear-attention recurrence is not counted
  (its projections are, in N).
- lm_head at the supervised positions: 2·H·V forward + 2·H·V input gradient per position.
- vision tower, forward only (frozen, no autograd): 2·(qkv + proj + MLP) per patch and layer, per-group
  bidirectional attention 4·(h·w)²·hidden per group and layer, and the mergers per merged token.
"""
from __future__ import annotations

from train.shapes import ModelShape

# Dense bf16 peak per GPU (vendor figures, no sparsity), matched on torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H20": 148.0, "A100": 312.0, "L40S": 362.1, "RTX 3060": 51.2,
                    "RTX 4090": 165.2, "A10": 125.0}


def step_flops(shape: ModelShape, *, tokens: int, supervised: int, patches: int, patches_per_group: int,
               sample_tokens: list[int] | None = None, full_finetune: bool = False) -> dict[str, float]:
    """Useful FLOPs of one micro-batch's forward + backward, by part (and "total")."""
    n_lm = shape.linear_params
    lm = (6 if full_finetune else 4) * n_lm * tokens
    squares = sum(t * t for t in (sample_tokens or [tokens]))
    attn = sum(4 * 2 * squares * layer.q for layer in shape.layers if layer.kind == "full_attention")
    head = 4 * shape.hidden * shape.vocab * supervised
    Hv, Iv = shape.vision_hidden, shape.vision_intermediate
    per_patch = 2 * (4 * Hv * Hv + 2 * Hv * Iv) * shape.vision_depth
    groups = patches // max(patches_per_group, 1)
    vit_attn = 4 * patches_per_group ** 2 * Hv * shape.vision_depth * groups
    m2 = shape.merge ** 2
    merged = patches // m2
    mergers = 2 * merged * ((m2 * Hv) ** 2 + m2 * Hv * shape.vision_out) * (1 + shape.deepstack)
    vision = per_patch * patches + vit_attn + mergers
    parts = {"language_linear": float(lm), "attention": float(attn), "lm_head": float(head), "vision": float(vision)}
    parts["total"] = sum(parts.values())
    return parts


def layer_forward_flops(layer, tokens: int) -> tuple[float, float]:
    """(linear, attention) FLOPs of one decoder layer's forward over one sequence: what a checkpointed layer
    spends again in backward. Attention is the causal half, 2·T²·q, as above; a linear-attention layer's
    recurrence is not counted."""
    attention = 2.0 * tokens * tokens * layer.q if layer.kind == "full_attention" else 0.0
    return 2.0 * layer.params * tokens, attention


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device name, or None when unknown (then pass --peak-tflops)."""
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_TFLOPS[key]
    return None
