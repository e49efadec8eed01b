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
but the masters are one flat fp32 tensor and the trainable tensors views into one flat buffer of their dtype, so
after the gradients' cast-copy (one multi-tensor call) the norm, the scale, fused AdamW and the copy back are one
kernel each. Gradients accumulate across micro-batches in the parameters' dtype, as
DeepSpeed's ZeRO-2 and stage-0 bf16 paths do by default (data_types.grad_accum_dtype unset). The memory is
ZeRO-2's on one rank (train/memplan.py counts the same bytes per trainable parameter), so the planner offers
stage 0 instead of 2 on one GPU. fp32 tensors are views into the master itself (no copy).

Its state_dict carries the master, so DeepSpeed's checkpoint (which saves a stage-0 optimizer's state_dict)
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
    """torch's fused AdamW over one flat fp32 master of the model's trainable tensors, stepped from their gradients
    with global-norm clipping and a skipped step on a non-finite norm (`overflow`, which DeepSpeed's engine reads to
    skip the scheduler step; `_global_grad_norm`, which its get_global_grad_norm returns).

    Why flat: the trainable tensors become views into one buffer of their dtype (the master itself when that is
    fp32), so after the gradients are copied in (one multi-tensor call) every stage of the step is one kernel on one
    tensor, not a multi-tensor call over 504 tensors that costs the host 1.3-3.4 ms each (BENCHMARKS.md, session 14).
    Why no host sync in `step`: the skip is decided on the device (fused AdamW's `found_inf`), so the host queues
    the whole step behind the backward; the verdict is read only when `overflow` is asked for, after all of it."""

    def __init__(self, params, *, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 max_grad_norm: float = 0.0):
        self.model_params = [p for p in params if p.requires_grad]
        if not self.model_params:
            raise ValueError("MasterWeightAdamW: no trainable parameters")
        kinds = sorted({f"{p.dtype} on {p.device}" for p in self.model_params})
        if len(kinds) > 1:
            raise ValueError(f"MasterWeightAdamW: the trainable tensors must share one dtype and device (one flat "
                             f"buffer), got {', '.join(kinds)}")
        sizes = [p.numel() for p in self.model_params]
        with torch.no_grad():  # tensor by tensor, each one's old storage freed as it moves: no second model copy
            first = self.model_params[0]
            flat = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
            for p, view in zip(self.model_params, flat.split(sizes)):
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
            master = flat if first.dtype == torch.float32 else flat.float()
        self.master, self._flat = master, flat
        self.masters = [v.view_as(p) for v, p in zip(master.split(sizes), self.model_params)]
        master.grad = torch.zeros_like(master)  # the fp32 gradient, reused every step
        self._grad_views = [v.view_as(p) for v, p in zip(master.grad.split(sizes), self.model_params)]
        super().__init__([master], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self.max_grad_norm = max_grad_norm
        self.found_inf = torch.zeros((), dtype=torch.float32, device=master.device)  # read by torch's fused step
        self._global_grad_norm: torch.Tensor | None = None

    @property
    def overflow(self) -> bool:
        """Whether the last step was skipped (a non-finite gradient norm): the one host sync, asked after the step."""
        return bool(self.found_inf.item())

    def _check_views(self) -> None:
        base = self._flat.untyped_storage().data_ptr()
        for i in (0, len(self.model_params) - 1):
            if self.model_params[i].untyped_storage().data_ptr() != base:
                raise RuntimeError(f"MasterWeightAdamW: trainable tensor {i} no longer lives in the optimizer's flat "
                                   f"buffer on {self._flat.device} (it is on {self.model_params[i].device}: the model "
                                   "was moved or cast after the optimizer was built); build the optimizer after that")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        self._check_views()
        have = [i for i, p in enumerate(self.model_params) if p.grad is not None]
        if len(have) < len(self.model_params):  # a tensor no sample reached: a zero gradient still steps it
            torch._foreach_zero_([g for i, g in enumerate(self._grad_views) if self.model_params[i].grad is None])
        torch._foreach_copy_([self._grad_views[i] for i in have], [self.model_params[i].grad for i in have])
        grad = self.master.grad
        # fp64: the same norm as DeepSpeed's fused check (train.zero), finite exactly when every element is
        norm = torch.linalg.vector_norm(grad, 2, dtype=torch.float64)
        finite = torch.isfinite(norm)
        self.found_inf.copy_(~finite)
        self._global_grad_norm = torch.where(finite, norm, -1.0).float()  # -1: DeepSpeed's non-finite sentinel
        if self.max_grad_norm > 0:
            grad.mul_((self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0).float())
        super().step()  # fused AdamW leaves master, moments and step count alone where found_inf is set
        if self._flat is not self.master:
            self._flat.copy_(self.master)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None

    def state_dict(self):
        state = super().state_dict()
        state["fp32_master"] = None if self._flat is self.master else self.master.detach().clone()
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        master = state_dict.pop("fp32_master", None)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            if master is not None:
                self.master.copy_(master)
                self._flat.copy_(master)
            elif self._flat is not self.master:  # no masters saved: start from the model's (rounded) values
                self.master.copy_(self._flat)
