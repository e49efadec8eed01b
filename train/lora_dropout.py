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

Where the run checkpoints any layer (memory decides, `keeps_product_inputs`), the MLP's down projection goes one
step further: its input is SwiGLU's product act(gate) * up, which nothing else keeps (the frozen base needs no
input, SwiGLU's own backward keeps gate and up), so its branch keeps gate and up (the same tensors, no bytes) and
computes the product again in backward with the MLP's own function (liger's kernel or act_fn(gate) * up: the same
values to the bit). That is 19.5 of the 110 KB a kept 4B layer saves per token; at 512 frames ~1 GB a layer,
and about 0.9 ms of elementwise work a layer in backward, which a run that checkpoints nothing does not need.
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


def keeps_product_inputs(checkpointing: str) -> bool:
    """Whether the down projection's branch keeps gate and up instead of their product (module docstring): where
    the recomputed dropout applies and the run checkpoints some layer."""
    return checkpointing != "none"


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
        return (*_branch_grads(ctx, x, weight, grad_h, need_x=ctx.needs_input_grad[0],
                               need_w=ctx.needs_input_grad[1]), None)


def _branch_grads(ctx, x: torch.Tensor, weight: torch.Tensor, grad_h: torch.Tensor, *, need_x: bool, need_w: bool):
    """(grad x, grad A) of dropout(x) @ A^T, the forward's mask drawn again from the state saved in ctx.rng."""
    gen = _generator(x.device)
    now = gen.get_state()
    gen.set_state(ctx.rng)
    dropped, mask = torch.native_dropout(x, ctx.p, True)  # the forward's mask, drawn again
    gen.set_state(now)
    grad_x = grad_w = None
    if need_w:
        grad_w = grad_h.reshape(-1, grad_h.shape[-1]).t() @ dropped.reshape(-1, x.shape[-1])
    if need_x:
        grad_x = torch.ops.aten.native_dropout_backward(grad_h @ weight, mask, 1.0 / (1.0 - ctx.p))
    return grad_x, grad_w


class _ProductDropoutThenA(torch.autograd.Function):
    """_DropoutThenA of the product x = product(gate, up) that keeps gate and up, not x: backward computes x again
    with the same function (no autograd), then proceeds as _DropoutThenA. gate and up get no gradient here (x's
    own graph carries theirs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, p: float, product):
        ctx.rng, ctx.p, ctx.product = _generator(x.device).get_state(), p, product
        ctx.save_for_backward(gate, up, weight)
        dropped, _ = torch.native_dropout(x, p, True)
        return F.linear(dropped, weight)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        grad_x, grad_w = _branch_grads(ctx, ctx.product(gate, up), weight, grad_h,
                                       need_x=ctx.needs_input_grad[0], need_w=ctx.needs_input_grad[3])
        return grad_x, None, None, grad_w, None, None


def _plain_adapter(self, kwargs) -> tuple[str, float] | None:
    """(adapter, dropout p) where `_forward` applies: one plain adapter in training, dropout > 0, no B bias."""
    adapters = [a for a in self.active_adapters if a in self.lora_A]
    if (not self.training or self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None
            or len(adapters) != 1 or adapters[0] in self.lora_variant):
        return None
    (name,) = adapters
    p = getattr(self.lora_dropout[name], "p", 0.0)
    return None if p == 0 or self.lora_B[name].bias is not None else (name, p)


def _forward(self, x: torch.Tensor, *args, product_of=None, **kwargs) -> torch.Tensor:
    """PEFT lora.Linear.forward for one plain adapter in training, keeping x instead of dropout's tensors;
    `product_of` = (product, gate, up) with x = product(gate, up): keep gate and up instead of x."""
    adapter = _plain_adapter(self, kwargs)
    if adapter is None:
        return type(self).forward(self, x, *args, **kwargs)
    name, p = adapter
    result = self.base_layer(x, *args, **kwargs)
    lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
    if product_of is not None and x.dtype == lora_a.dtype:
        product, gate, up = product_of
        h = _ProductDropoutThenA.apply(x, gate, up, lora_a, p, product)
    else:
        h = _DropoutThenA.apply(x.to(lora_a.dtype), lora_a, p)
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]).to(result.dtype),
                      lora_b.t().to(result.dtype), alpha=self.scaling[name])
    return out.view(result.shape)


def _swiglu_product(mlp):
    """The function of (gate, up) a SwiGLU MLP feeds its down projection, or None where its forward is not known
    to be down_proj(product(gate_proj(x), up_proj(x))): liger's kernel where train/kernels.py (or liger's entry
    point) put liger's forward there, act_fn(gate) * up for transformers' own Qwen3-VL / Qwen3.5 MLP."""
    forward = getattr(mlp.forward, "__func__", None)
    try:  # both forwards are down_proj(_swiglu_dispatch(gate_proj(x), up_proj(x))) (liger 0.8.5)
        from liger_kernel.transformers.swiglu import LigerQwen3MoeSwiGLUMLP, LigerSwiGLUMLP, _swiglu_dispatch
        if forward in (LigerSwiGLUMLP.forward, LigerQwen3MoeSwiGLUMLP.forward):
            return _swiglu_dispatch
    except ImportError:
        pass
    if type(mlp).__name__ in ("Qwen3VLTextMLP", "Qwen3_5MLP") and forward is type(mlp).forward:
        return lambda gate, up: mlp.act_fn(gate) * up
    return None


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP whose down projection keeps gate and up rather than their product (module docstring)."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    return _forward(self.down_proj, self._lora_product(gate, up), product_of=(self._lora_product, gate, up))


def recompute_lora_dropout(model: torch.nn.Module, *, product_inputs: bool = False) -> dict[str, int]:
    """Route every plain PEFT lora.Linear with dropout > 0 through `_forward`, and with `product_inputs` every
    SwiGLU MLP whose down projection that is through `_mlp_forward`; returns how many of each."""
    from peft.tuners.lora.layer import Linear

    projections = mlps = 0
    for module in model.modules():
        if type(module) is Linear and any(getattr(d, "p", 0) > 0 for d in module.lora_dropout.values()):
            module.forward = types.MethodType(_forward, module)
            projections += 1
    for module in model.modules() if product_inputs else ():
        down = getattr(module, "down_proj", None)
        product = _swiglu_product(module) if down is not None and hasattr(module, "gate_proj") else None
        if product is not None and getattr(down.forward, "__func__", None) is _forward:
            module._lora_product = product
            module.forward = types.MethodType(_mlp_forward, module)
            mlps += 1
    return {"projections": projections, "mlps": mlps}
