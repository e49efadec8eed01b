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

Sibling projections (`--sibling-lora`, on where the recomputed dropout applies): q/k/v read one input, and so do
gate/up. Through PEFT each is its own chain of autograd nodes (base linear, dropout + A, scaled B add), and
backward sums the input's six (three) gradients with five (two) separate adds over [tokens, hidden], plus one
masked scale per branch: on one H200 at 64 frames 553 bf16 adds (16.5 ms) and 249 masked scales (7.9 ms) a
step, each launched from Python. `_SiblingBranches` computes a group as one node: the same masks, drawn in
the order PEFT draws them (q, k, v; gate, up), and in backward the base input gradients accumulate in their
GEMMs (addmm) and each branch's masked gradient is added in one pass (add_masked_). The first member's call
computes the group; the others, called next with the same input (the attention and MLP forwards of Qwen3-VL / Qwen3.5,
liger's MLP and `_mlp_forward` do), return their share; any other call runs alone. Every other routed projection
(o_proj, a down projection that keeps its input) runs as a group of one: base and branch in one node, the B
product added into the base output in place. Same tensors kept.
"""
from __future__ import annotations

import contextlib
import functools
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


@contextlib.contextmanager
def _replayed(state: torch.Tensor, device: torch.device):
    """The generator of `device` at `state` (a forward's, saved in its ctx) inside the block, as it was after."""
    gen = _generator(device)
    now = gen.get_state()
    gen.set_state(state)
    try:
        yield
    finally:
        gen.set_state(now)


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
    with _replayed(ctx.rng, x.device):
        dropped, mask = torch.native_dropout(x, ctx.p, True)  # the forward's mask, drawn again
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


# Modules whose forward calls these projections on one input, in this order (the order PEFT draws their masks).
_ATTENTION, _MLP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
SIBLINGS = {"Qwen3VLTextAttention": (_ATTENTION,), "Qwen3_5Attention": (_ATTENTION,), "Qwen3VLTextMLP": (_MLP,),
            "Qwen3_5MLP": (_MLP,), "LigerSwiGLUMLP": (_MLP,), "LigerQwen3MoeSwiGLUMLP": (_MLP,)}


class _SiblingBranches(torch.autograd.Function):
    """y_i = x W_i^T + s_i (dropout_i(x) A_i^T) B_i^T for the projections i of one group, as one node. Keeps x,
    each h_i = dropout_i(x) A_i^T ([tokens, r]) and the RNG state; backward draws the masks again in order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, scalings: tuple[float, ...], *weights: torch.Tensor):
        n = len(scalings)
        bases, lora_a, lora_b = weights[:n], weights[n:2 * n], weights[2 * n:]
        ctx.rng, ctx.p, ctx.scalings = _generator(x.device).get_state(), p, scalings
        ctx.set_materialize_grads(False)
        rows = x.reshape(-1, x.shape[-1])
        outs, hs = [], []
        for w, a, b, s in zip(bases, lora_a, lora_b, scalings):
            result = F.linear(rows, w)
            dropped, _ = torch.native_dropout(rows, p, True)
            h = F.linear(dropped, a)
            del dropped
            # in place: `result` is this node's own (torch.addmm(result, ...) would first copy it, a DtoD copy
            # per projection in the H200 profile)
            outs.append(result.addmm_(h, b.t(), alpha=s).view(*x.shape[:-1], w.shape[0]))
            hs.append(h)
        ctx.save_for_backward(x, *weights, *hs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *rest = ctx.saved_tensors
        n = len(ctx.scalings)
        bases, lora_a, lora_b, hs = rest[:n], rest[n:2 * n], rest[2 * n:3 * n], rest[3 * n:]
        needs = ctx.needs_input_grad
        rows = x.reshape(-1, x.shape[-1])
        grad_x, grad_a, grad_b = None, [None] * n, [None] * n
        with _replayed(ctx.rng, x.device):
            for i, s in enumerate(ctx.scalings):
                dropped, mask = torch.native_dropout(rows, ctx.p, True)  # every member's, in forward's order
                if grads[i] is None:
                    continue
                g = grads[i].reshape(-1, grads[i].shape[-1])
                grad_h = torch.mm(g, lora_b[i]).mul_(s)
                if needs[3 + 2 * n + i]:
                    grad_b[i] = torch.mm(g.t(), hs[i]).mul_(s)
                if needs[3 + n + i]:
                    grad_a[i] = torch.mm(grad_h.t(), dropped)
                del dropped
                if needs[0]:
                    grad_x = torch.mm(g, bases[i]) if grad_x is None else grad_x.addmm_(g, bases[i])
                    add_masked_(grad_x, torch.mm(grad_h, lora_a[i]), mask, 1.0 / (1.0 - ctx.p))
        if grad_x is not None:
            grad_x = grad_x.view(x.shape)
        return (grad_x, None, None, *([None] * n), *grad_a, *grad_b)


MASKED_ADD_BLOCK = 4096


def add_masked_(out: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """out += scale * (value * mask), in place: a branch's dropout gradient added into its input's gradient.

    Why not addcmul alone: with a bool mask beside bf16 tensors torch runs its non-vectorized elementwise kernel
    (a cast per element), 156 ms a step at 512 frames and 29 ms at 64 on one H200 (BENCHMARKS.md, session 15).
    On CUDA a Triton kernel computes the same fp32 a + s * (b * c), rounded once, at memory speed; elsewhere (or
    without Triton, or on strided tensors) addcmul."""
    kernel = _masked_add_kernel() if out.is_cuda else None
    if kernel is None or not (out.is_contiguous() and value.is_contiguous() and mask.is_contiguous()) \
            or out.shape != value.shape or out.shape != mask.shape or out.dtype != value.dtype:
        return out.addcmul_(value, mask, value=scale)
    n = out.numel()
    kernel[(-(-n // MASKED_ADD_BLOCK),)](out, value, mask.view(torch.uint8), n, float(scale), BLOCK=MASKED_ADD_BLOCK,
                                         num_warps=8)
    return out


@functools.cache
def _masked_add_kernel():
    """The Triton kernel of add_masked_, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def masked_add(out_ptr, value_ptr, mask_ptr, n, scale, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        a = tl.load(out_ptr + offsets, mask=inside).to(tl.float32)
        b = tl.load(value_ptr + offsets, mask=inside).to(tl.float32)
        c = tl.load(mask_ptr + offsets, mask=inside).to(tl.float32)
        tl.store(out_ptr + offsets, (a + scale * (b * c)).to(out_ptr.dtype.element_ty), mask=inside)

    return masked_add


class _Group:
    """The members of one sibling group, and what the first member's call computed for the others."""

    def __init__(self, members: list) -> None:
        self.members = members
        self.pending: dict[int, torch.Tensor] = {}  # id(member) -> its output, for the input below
        self.input: torch.Tensor | None = None


def _sibling_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A member of a sibling group (module docstring): the first computes the group, the others take their share."""
    group = self._lora_siblings
    if self is not group.members[0]:
        out = group.pending.pop(id(self), None) if group.input is x and not args and not kwargs else None
        if not group.pending:
            group.input = None
        return out if out is not None else _forward(self, x, *args, **kwargs)
    group.pending, group.input = {}, None
    adapters = [_plain_adapter(m, kwargs) for m in group.members]
    if args or kwargs or any(a is None for a in adapters) or len({a[1] for a in adapters}) != 1:
        return _forward(self, x, *args, **kwargs)
    weights = ([m.base_layer.weight for m in group.members] + [m.lora_A[a].weight for m, (a, _) in zip(group.members, adapters)]
               + [m.lora_B[a].weight for m, (a, _) in zip(group.members, adapters)])
    if any(m.base_layer.bias is not None for m in group.members) or any(w.dtype != x.dtype for w in weights):
        return _forward(self, x, *args, **kwargs)
    scalings = tuple(float(m.scaling[a]) for m, (a, _) in zip(group.members, adapters))
    outs = _SiblingBranches.apply(x, adapters[0][1], scalings, *weights)
    group.pending = {id(m): o for m, o in zip(group.members[1:], outs[1:])}
    group.input = x
    return outs[0]


def recompute_lora_dropout(model: torch.nn.Module, *, product_inputs: bool = False,
                           siblings: bool = False) -> dict[str, int]:
    """Route every plain PEFT lora.Linear with dropout > 0 through `_forward`, with `product_inputs` every
    SwiGLU MLP whose down projection that is through `_mlp_forward`, and with `siblings` every q/k/v and gate/up
    group of a known attention / MLP through `_sibling_forward`; returns how many of each."""
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
    groups = singles = 0
    for module in model.modules() if siblings else ():
        for names in SIBLINGS.get(type(module).__name__, ()):
            members = [getattr(module, n, None) for n in names]
            if all(m is not None and getattr(m.forward, "__func__", None) is _forward for m in members):
                _join(members)
                groups += 1
    # o_proj, down_proj, ...: a group of one, the same one node (not a down projection _mlp_forward calls itself)
    product_downs = {id(m.down_proj) for m in model.modules() if hasattr(m, "_lora_product")}
    for module in model.modules() if siblings else ():
        if type(module) is Linear and getattr(module.forward, "__func__", None) is _forward \
                and id(module) not in product_downs:
            _join([module])
            singles += 1
    return {"projections": projections, "mlps": mlps, "sibling_groups": groups, "single_groups": singles}


def _join(members: list) -> None:
    group = _Group(members)
    for m in members:
        m._lora_siblings = group
        m.forward = types.MethodType(_sibling_forward, m)
