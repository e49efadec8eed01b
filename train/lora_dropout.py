"""LoRA dropout drawn again in backward (`--recompute-lora-dropout`, on by default where it applies).

PEFT's LoRA branch, `result + lora_B(lora_A(dropout(x))) * scaling`, keeps every targeted projection's
dropout output (bf16) and mask (bool) for backward: 3 bytes per input element and projection, although
q/k/v read one input and gate/up another. On the Qwen3-VL-4B shape that is 80 of the 160 KB a
non-checkpointed decoder layer keeps per token (train/memplan.py), which is what decides how many layers a
long window must recompute. Here the branch keeps its input x instead (one tensor its sibling projections
share) and the RNG state it drew the mask from; backward restores that state and draws the same mask again,
as activation checkpointing does, so the arithmetic and every mask are PEFT's. The scaled add of the
B product is one addmm (no separate multiply and add over [tokens, out]).

It replaces the forward of PEFT's plain `lora.Linear` only (one active adapter, no DoRA or other variant,
dropout > 0, training); any other case runs PEFT's own forward. The branch reads lora_A / lora_B's weights
without calling those modules, which ZeRO-3 needs to gather a partitioned weight, so it applies only below
ZeRO-3 (`applies`, the one rule the trainer and the memory planner follow), and not with --compile
(`switched_on`): dynamo cannot trace the generator state it saves, so every projection would break the graph.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def switched_on(cfg: dict) -> bool:
    """The switch as a run's config (a TrainConfig's vars or run.json's) leaves it: on unless turned off or --compile."""
    return bool(cfg.get("recompute_lora_dropout", True)) and not cfg.get("compile", False)


def applies(*, lora: bool, lora_dropout: float, zero_stage: int, quantized: bool, enabled: bool) -> bool:
    """Whether the trainer recomputes LoRA dropout: LoRA with dropout on a plain (not quantized: PEFT wraps
    bitsandbytes layers in other classes) base, below ZeRO-3, switch on."""
    return enabled and lora and lora_dropout > 0 and not quantized and zero_stage < 3


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class _DropoutThenA(torch.autograd.Function):
    """h = dropout(x) @ A^T that keeps x and the RNG state, not dropout's output and mask. native_dropout is what
    F.dropout runs on CUDA (and draws the same mask on CPU: the test compares with PEFT's nn.Dropout); backward
    calls it again from the saved state and its own backward kernel, with no nested autograd pass (the host
    time of this backward is on the step's critical path: 252 calls a step on the 4B)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, p: float) -> torch.Tensor:
        ctx.rng, ctx.p = _generator(x.device).get_state(), p
        ctx.save_for_backward(x, weight)
        dropped, _ = torch.native_dropout(x, p, True)
        return F.linear(dropped, weight)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        x, weight = ctx.saved_tensors
        gen = _generator(x.device)
        now = gen.get_state()
        gen.set_state(ctx.rng)
        dropped, mask = torch.native_dropout(x, ctx.p, True)  # the forward's mask, drawn again
        gen.set_state(now)
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad_h.reshape(-1, grad_h.shape[-1]).t() @ dropped.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.native_dropout_backward(grad_h @ weight, mask, 1.0 / (1.0 - ctx.p))
        return grad_x, grad_w, None


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT lora.Linear.forward for one plain adapter in training, keeping x instead of dropout's tensors."""
    adapters = [a for a in self.active_adapters if a in self.lora_A]
    if (not self.training or self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None
            or len(adapters) != 1 or adapters[0] in self.lora_variant):
        return type(self).forward(self, x, *args, **kwargs)
    (name,) = adapters
    p = getattr(self.lora_dropout[name], "p", 0.0)
    if p == 0 or self.lora_B[name].bias is not None:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
    h = _DropoutThenA.apply(x.to(lora_a.dtype), lora_a, p)
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]).to(result.dtype),
                      lora_b.t().to(result.dtype), alpha=self.scaling[name])
    return out.view(result.shape)


def recompute_lora_dropout(model: torch.nn.Module) -> int:
    """Route every plain PEFT lora.Linear with dropout > 0 through `_forward`; returns how many."""
    from peft.tuners.lora.layer import Linear

    n = 0
    for module in model.modules():
        if type(module) is Linear and any(getattr(d, "p", 0) > 0 for d in module.lora_dropout.values()):
            module.forward = types.MethodType(_forward, module)
            n += 1
    return n
