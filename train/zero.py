"""ZeRO-3 partitioned parameters: gathered (the one helper checkpoint saving, load verification and the
chunked loss share), the check that partitioning really happened (ShardingReport), and leaf layers.

Why leaf layers: DeepSpeed's ZeRO-3 hooks every submodule (fetch before its forward, release after, the
same in backward and again in each recompute). A LoRA-wrapped Qwen3-VL-4B has ~60 submodules per decoder
layer, so one GPU spends most of a 64-frame step in that bookkeeping (measured on one H200: 3.60 s ZeRO-3 vs
0.90 s ZeRO-2, 3.09 s with every parameter persistent, so it is the hooks, not the gathers). Marked as
DeepSpeed leaf modules, each decoder layer and vision block is gathered and released as one unit: the same
parameters and numbers, one hook where there were ~60, and at most one layer gathered beyond the prefetch."""
from __future__ import annotations

import contextlib
import dataclasses
import time
import types
from pathlib import Path

import torch


def gathered(params):
    """Context manager that gathers the full values of ZeRO-3 partitioned parameters on every rank (a
    collective: every rank must enter it with the same parameters, in the same order); a no-op for plain
    parameters. Read-only: no rank's changes are written back."""
    zero = [p for p in params if hasattr(p, "ds_id")]
    if not zero:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(zero, modifier_rank=None)


def skip_one_rank_allreduce(engine, world_size: int) -> bool:
    """One rank, ZeRO stage 0, a plain torch optimizer: DeepSpeed's gradient all-reduce after every backward
    becomes what it amounts to there (returns whether it was replaced).

    Why: it flattens every gradient into one buffer, all-reduces it over the single rank (gloo), scales it by
    1 / world and copies each piece back: ~2.8 ms of the demo's ~95 ms CPU step for values that come back
    unchanged (x / 1 and a one-rank sum are x). Its one effect that stays is that a trainable parameter without
    a gradient gets a zero one (DeepSpeed's `_get_gradients_for_reduction`), so the optimizer steps it (weight
    decay, moments); the replacement does exactly that, at the same accumulation boundary."""
    if (world_size != 1 or engine.zero_optimization_stage() != 0 or not isinstance(engine.optimizer, torch.optim.Optimizer)
            or engine.has_moe_layers or engine.pipeline_parallelism):
        return False

    # the trainable tensors, listed once: walking every module after each backward is ~2,500 modules on the 4B
    trainable = [p for p in engine.module.parameters() if p.requires_grad and p.numel()]

    def allreduce_gradients(self, bucket_size=None):
        if self.is_gradient_accumulation_boundary():
            for p in trainable:
                if p.grad is None:
                    p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)

    engine.allreduce_gradients = types.MethodType(allreduce_gradients, engine)
    return True


def fuse_gradient_checks(optimizer) -> list[str]:
    """`--fused-grad-checks` (on by default): ZeRO-1/2's gradient norm and overflow check, and ZeRO-3's norm, in
    a few multi-tensor kernels instead of several kernels per gradient tensor; returns the methods replaced ([]
    where the optimizer is not one this covers: CPU offload, model or pipeline parallel, expert groups).

    Why: a LoRA run has ~500 small gradient tensors; DeepSpeed checks each for inf/NaN (amax, amin, two
    isfinite, and/not, an add) and takes each one's norm in fp64 (a copy and a norm), ~4,000 launches after
    every backward, host-bound (the profile of a 64-frame step on one H200: ~150 ms of host time). The fp64
    L2 norm of a tensor is finite exactly when every element is (fp32 squares cannot overflow fp64), so
    `torch._foreach_norm(..., dtype=float64)` answers both questions: the same norm (up to fp64 summation
    order) and the same overflow verdict, so a step with a non-finite gradient is still skipped."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def fp64_norms(gradients) -> torch.Tensor:
        grads = [g for g in gradients if g is not None and not getattr(g, "_zero_padding", False)]
        if not grads:
            return torch.zeros(1, dtype=torch.float64, device=optimizer.device)
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))

    if type(optimizer) is DeepSpeedZeroOptimizer_Stage3:
        return _fuse_stage3_norm(optimizer, fp64_norms)
    if (type(optimizer) is not DeepSpeedZeroOptimizer or optimizer.cpu_offload or optimizer.mpu is not None
            or getattr(optimizer, "has_moe_layers", False)):
        return []
    original_norm = optimizer.get_grad_norm_direct

    def has_overflow_partitioned_grads_serial(self):
        grads = [g for i in range(len(self.bit16_groups)) for g in (self.averaged_gradients[i] or ())]
        return fp64_norms(grads).isfinite().all().logical_not().view(1)

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or any(getattr(p, "ds_pipe_replicated", False) for p in params):
            return original_norm(gradients, params, norm_type)
        import deepspeed.comm as dist
        from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

        total = fp64_norms(gradients).square().sum().float()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        total = total.sqrt()
        mask_nan_or_inf_with_val_inplace(total, device=self.device)  # DeepSpeed's sentinel for a non-finite norm
        return total

    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(has_overflow_partitioned_grads_serial, optimizer)
    optimizer.get_grad_norm_direct = types.MethodType(get_grad_norm_direct, optimizer)
    return ["has_overflow_partitioned_grads_serial", "get_grad_norm_direct"]


def _fuse_stage3_norm(optimizer, fp64_norms) -> list[str]:
    """ZeRO-3's gradient norm in one multi-tensor kernel (its inf/NaN check already reads one flat buffer):
    DeepSpeed's takes each partition's norm apart (a copy, a cast and a norm per gradient tensor). Only where
    every rank's partitions count once: no CPU offload, model parallelism or expert groups."""
    if (optimizer.offload_optimizer or optimizer.model_parallel_group is not None
            or getattr(optimizer, "has_moe_layers", False) or getattr(optimizer, "use_muon", False)):
        return []
    original_norm = optimizer.get_grad_norm_direct

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or self._autoep_expert_parallel_group(params) is not None:
            return original_norm(gradients, params, norm_type)
        import deepspeed.comm as dist
        from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

        self._assert_same_partition_group(params)
        total = fp64_norms(gradients).square().sum()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._get_param_partition_group(params[0]))
        total = total.sqrt()
        mask_nan_or_inf_with_val_inplace(total, device=self.device)  # DeepSpeed's sentinel for a non-finite norm
        return total

    optimizer.get_grad_norm_direct = types.MethodType(get_grad_norm_direct, optimizer)
    return ["get_grad_norm_direct"]


def keep_frozen_resident(optimizer) -> bool:
    """One rank with every parameter whole (train.config.keeps_parameters_whole): ZeRO-3's step stops releasing the
    frozen parameters; returns whether it was replaced.

    Why: each step DeepSpeed releases every parameter (`_partition_all_parameters`) and gathers the persistent ones
    back after the update (`_post_step`), a Python call and a copy per parameter, for a frozen base whose values
    never change (CPU profile, tiny 12-layer Qwen3-VL: 41 of a step's 314 ms of host time). The trainable ones
    are still released and gathered back, so the updated partitions reach the model; a frozen parameter stays
    AVAILABLE, which `_post_step`'s gather skips."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if (type(optimizer) is not DeepSpeedZeroOptimizer_Stage3 or optimizer.offload_param or optimizer.swap_optimizer
            or dist.get_world_size(group=optimizer.dp_process_group) != 1):
        return False
    trainable = [p for group in optimizer.fp16_groups for p in group]

    def _partition_all_parameters(self):
        for p in trainable:
            p.ds_active_sub_modules.clear()
            if p.ds_status == ZeroParamStatus.AVAILABLE:
                p.partition()

    optimizer._partition_all_parameters = types.MethodType(_partition_all_parameters, optimizer)
    return True


def mark_leaf_layers(model) -> list[str]:
    """Flag every decoder layer and vision block of `model` (the classes its `_no_split_modules` names,
    looked up through PEFT wrappers) as ZeRO-3 leaf modules; returns the class names flagged. Call before
    deepspeed.initialize, which registers the hooks."""
    from deepspeed.utils import set_z3_leaf_modules

    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    present = sorted({type(m).__name__ for m in model.modules()} & names)
    if present:
        set_z3_leaf_modules(model, present)
    return present


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingReport:
    """Parameter bytes this rank holds right after engine init, against the 1/world ZeRO-3 should leave."""

    rank: int
    world: int
    total_bytes: int  # every parameter at its logical size
    resident_bytes: int  # this rank's partitions (ds_tensor) + any parameter ZeRO never partitioned
    persistent_bytes: int  # gathered whole at run time by stage3_param_persistence_threshold (reported, not held yet)
    unpartitioned_bytes: int  # parameters DeepSpeed never partitioned (should be 0)
    tolerance: float = 0.10

    @property
    def expected_bytes(self) -> float:
        return self.total_bytes / self.world

    @property
    def ok(self) -> bool:
        return abs(self.resident_bytes - self.expected_bytes) <= self.tolerance * self.expected_bytes

    def message(self) -> str:
        mib = 2**20
        return (f"ZeRO-3 sharding, rank {self.rank} of {self.world}: holds {self.resident_bytes / mib:.2f} MiB of "
                f"{self.total_bytes / mib:.2f} MiB of parameters, expected 1/{self.world} = "
                f"{self.expected_bytes / mib:.2f} MiB; not partitioned {self.unpartitioned_bytes / mib:.2f} MiB; "
                f"{self.persistent_bytes / mib:.2f} MiB will be kept whole once gathered "
                f"(stage3_param_persistence_threshold): {'ok' if self.ok else 'NOT SHARDED as configured'} "
                f"(tolerance {self.tolerance:.0%})")


def sharding_report(model, *, rank: int, world: int) -> ShardingReport:
    """Count what each parameter occupies on this rank: a ZeRO-3 parameter its partition (`ds_tensor`), any
    other parameter its whole size."""
    total = resident = persistent = unpartitioned = 0
    for p in model.parameters():
        size = p.element_size()
        if hasattr(p, "ds_id"):
            total += p.ds_numel * size
            resident += p.ds_tensor.numel() * size
            if getattr(p, "ds_persist", False):
                persistent += p.ds_numel * size
        else:
            total += p.numel() * size
            resident += p.numel() * size
            unpartitioned += p.numel() * size
    return ShardingReport(rank=rank, world=world, total_bytes=total, resident_bytes=resident,
                          persistent_bytes=persistent, unpartitioned_bytes=unpartitioned)


STALE_BUILD_LOCK_S = 900  # DeepSpeed's CPU Adam op builds in about a minute; a lock this old outlived its build


def stale_build_lock(op: str = "cpu_adam", *, max_age_s: float = STALE_BUILD_LOCK_S) -> Path | None:
    """The JIT build lock of DeepSpeed op `op` (torch's extension directory) when older than max_age_s, or None.

    Why: `--offload-optimizer` builds DeepSpeed's CPU Adam op on first use; a build killed mid-way (a timeout,
    Ctrl-C) leaves `<build dir>/lock`, and every later run then waits on it forever without a word (torch's
    FileBaton). Seen on one H200: a bench leg killed while building, the next leg silent for 235 s."""
    folder = op_build_dir(op)
    if folder is None:
        return None
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    return lock if age > max_age_s else None


def op_build_dir(op: str = "cpu_adam") -> Path | None:
    """Where torch's JIT extension loader builds (and later finds) DeepSpeed op `op`: TORCH_EXTENSIONS_DIR or its
    per-Python, per-CUDA default; `<op>.so` there once built. None where this torch no longer has the (private)
    helper: the checks that use it are then skipped, never the run."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return None
    return Path(_get_build_directory(op, verbose=False))
