"""The trainer's own AdamW at ZeRO stage 0 (`--plain-adamw`, on by default where it applies).

Why: on one rank ZeRO-1/2 partition nothing (the one partition is everything), yet DeepSpeed's ZeRO-2 optimizer
runs Python per trainable tensor: a hook on each gradient as it lands (copy into a bucket, bookkeeping), then
flat-buffer copies, checks and the fp32 -> bf16 write-back around the step. A LoRA run of the Qwen3-VL-4B shape
has 504 such tensors (`python -m scripts.bench_lora_host`, CPU: 77-93 ms a step of host time against 41-44 ms
here and 34-37 ms for plain torch). On one H200 at 64 frames the step gained less than that: 0.485 against 0.495 s
side by side, and it stopped varying as ZeRO-2's did (0.457-0.585 s over three calls; BENCHMARKS.md, session 12).
DeepSpeed's own stage 0 with bf16 wraps the optimizer again (its fp16-style master weights, a loop per tensor).

Here DeepSpeed runs stage 0 with neither fp16 nor bf16 set, so it steps this optimizer as a plain torch one (and
train.zero.skip_one_rank_allreduce makes its one-rank all-reduce a no-op). This optimizer keeps what the
wrapper kept: an fp32 master of each bf16 trainable tensor, AdamW on the masters, clipping by the global norm
and a skipped step (no update, no scheduler step) when that norm is not finite, as DeepSpeed's ZeRO-1/2 do;
but each of those is one multi-tensor call over all tensors (cast-copy of the gradients, fp64 norms, scale,
fused AdamW on CUDA, cast-copy back). Gradients accumulate across micro-batches in the parameters' dtype, as
DeepSpeed's ZeRO-2 and stage-0 bf16 paths do by default (data_types.grad_accum_dtype unset). The memory is
ZeRO-2's on one rank (train/memplan.py counts the same bytes per trainable parameter), so the planner offers
stage 0 instead of 2 on one GPU. fp32 tensors are their own masters (no copy).

Its state_dict carries the masters, so DeepSpeed's checkpoint (which saves a stage-0 optimizer's state_dict)
resumes them exactly. It applies to train.main's own DeepSpeed config only (`applies`, the one rule the config
builder, train.main and the planner follow): a --deepspeed file keeps DeepSpeed's path.
"""
from __future__ import annotations

import torch


def switched_on(cfg: dict) -> bool:
    """The switch as a run's config (a TrainConfig's vars or run.json's) leaves it."""
    return bool(cfg.get("plain_adamw", True))


def applies(*, zero_stage: int, deepspeed_file: bool, enabled: bool) -> bool:
    """Whether train.main steps this optimizer: ZeRO stage 0 (no offload exists there), its own DeepSpeed
    config (not a --deepspeed file), switch on."""
    return enabled and zero_stage == 0 and not deepspeed_file


def clear_gradients_through(engine, optimizer: "MasterWeightAdamW") -> None:
    """DeepSpeed's stage-0 engine clears gradients after each step by walking every module parameter (~2,500
    modules on the 4B, a host gap before the next forward on one H200); the optimizer holds the only tensors that
    have gradients, so the engine clears those."""
    engine.zero_grad = optimizer.zero_grad


class MasterWeightAdamW(torch.optim.AdamW):
    """torch's AdamW over fp32 masters of the model's trainable tensors, stepped from their gradients with
    global-norm clipping and a skipped step on a non-finite norm (`overflow`, which DeepSpeed's engine reads to
    skip the scheduler step; `_global_grad_norm`, which its get_global_grad_norm returns)."""

    def __init__(self, params, *, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 max_grad_norm: float = 0.0):
        self.model_params = [p for p in params if p.requires_grad]
        if not self.model_params:
            raise ValueError("MasterWeightAdamW: no trainable parameters")
        self.masters = [p if p.dtype == torch.float32 else p.detach().float() for p in self.model_params]
        low = [i for i, (m, p) in enumerate(zip(self.masters, self.model_params)) if m is not p]
        self._low_params = [self.model_params[i] for i in low]
        self._low_masters = [self.masters[i] for i in low]
        for m in self._low_masters:
            m.grad = torch.zeros_like(m)  # fp32 gradient buffers, reused every step
        self._low_master_grads = [m.grad for m in self._low_masters]
        fused = all(m.is_cuda for m in self.masters)  # one kernel on CUDA; elsewhere multi-tensor (foreach) ops
        super().__init__(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None,
                         foreach=None if fused else True)
        self.max_grad_norm = max_grad_norm
        self.overflow = False
        self._global_grad_norm: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        if self.model_params[0].device != self.masters[0].device:  # e.g. the model moved after this was built
            raise RuntimeError(f"MasterWeightAdamW: the parameters are on {self.model_params[0].device} but their "
                               f"masters on {self.masters[0].device}; build the optimizer after moving the model")
        for p in self.model_params:
            if p.grad is None:  # a tensor no sample reached: a zero gradient still steps it, as DeepSpeed's does
                p.grad = torch.zeros_like(p)
        if self._low_params:
            torch._foreach_copy_(self._low_master_grads, [p.grad for p in self._low_params])
        grads = [m.grad for m in self.masters]  # an fp32 parameter is its own master: its gradient is in place
        # fp64 norms: the same norm as DeepSpeed's fused check (train.zero), finite exactly when every element is
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)))
        finite = bool(torch.isfinite(norm))  # the one host sync: the engine needs the verdict to skip the scheduler
        self.overflow = not finite
        self._global_grad_norm = norm.float() if finite else torch.full_like(norm, -1.0).float()
        if not finite:
            return None
        if self.max_grad_norm > 0:
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0).float()
            torch._foreach_mul_(grads, coef)
        super().step()
        if self._low_params:
            torch._foreach_copy_(self._low_params, self._low_masters)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None

    def state_dict(self):
        state = super().state_dict()
        state["fp32_masters"] = {i: m.detach().clone() for i, (m, p) in enumerate(zip(self.masters, self.model_params))
                                 if m is not p}
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("fp32_masters", {})
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for i, value in masters.items():
                self.masters[int(i)].copy_(value)
                self.model_params[int(i)].copy_(value)
