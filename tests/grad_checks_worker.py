"""One-rank ZeRO-2 and ZeRO-3 engines on CPU (gloo) comparing train.zero.fuse_gradient_checks with DeepSpeed's
own per-tensor gradient norm and inf/NaN check (tests/test_levers.py runs it in a subprocess: DeepSpeed's
process group must not outlive the check). Writes the comparison as JSON to argv[1]."""
from __future__ import annotations

import json
import sys

import torch

from tests.train_helpers import op_counter


def main(out: str) -> None:
    import deepspeed

    from train.main import init_distributed
    from train.zero import fuse_gradient_checks

    init_distributed()  # a world of one on loopback, as train.main starts it

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(24)])  # 48 gradient tensors
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt = engine.optimizer
    original = {name: getattr(type(opt), name) for name in ("has_overflow_partitioned_grads_serial", "get_grad_norm_direct")}
    replaced = fuse_gradient_checks(opt)

    def run_checks():
        grads, params = opt.averaged_gradients[0], opt.params_in_partition[0]
        result = {}
        for label, fns in (("deepspeed", {k: (lambda f: (lambda *a: f(opt, *a)))(f) for k, f in original.items()}),
                           ("fused", {k: getattr(opt, k) for k in original})):
            counter = op_counter()
            with counter:
                overflow = bool(fns["has_overflow_partitioned_grads_serial"]())
                norm = float(fns["get_grad_norm_direct"](grads, params))
            result[label] = {"overflow": overflow, "norm": norm, "ops": counter.ops}
        return result

    x = torch.randn(2, 16, dtype=torch.bfloat16)
    engine.backward(engine(x).float().square().sum())
    finite = run_checks()
    tensors = len(opt.averaged_gradients[0])
    engine.step()
    engine.backward(engine(x).float().square().sum())
    opt.averaged_gradients[0][5].view(-1)[3] = float("nan")
    nan = run_checks()
    before = [p.detach().clone() for p in model.parameters()]
    engine.step()  # a non-finite gradient: the step is skipped
    skipped = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    result = {"replaced": replaced, "tensors": tensors, "finite": finite, "nan": nan,
              "nan_step_skipped": skipped, "grad_norm_after_nan": float(engine.get_global_grad_norm())}
    result["stage3"] = stage3(config)
    json.dump(result, open(out, "w"))


def stage3(config: dict) -> dict:
    """The same model under ZeRO-3: DeepSpeed's per-tensor norm against the fused one, on the same gradients
    (finite, then with a NaN), and the norm the engine reports after a fused step."""
    import deepspeed

    from train.zero import fuse_gradient_checks

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(24)])
    config = {**config, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt = engine.optimizer
    original = type(opt).get_grad_norm_direct
    replaced = fuse_gradient_checks(opt)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    engine.backward(engine(x).float().square().sum())
    grads, params = opt.averaged_gradients[0], opt.fp16_groups[0]
    out: dict = {"replaced": replaced, "tensors": len(grads)}
    for label in ("finite", "nan"):
        if label == "nan":
            grads[5].view(-1)[3] = float("nan")
        row = {}
        for name, fn in (("deepspeed", lambda: original(opt, grads, params)), ("fused", lambda: opt.get_grad_norm_direct(grads, params))):
            counter = op_counter()
            with counter:
                norm = float(fn())
            row[name] = {"norm": norm, "ops": counter.ops}
        out[label] = row
    return out


def one_rank_allreduce(out: str) -> None:
    """Two one-rank ZeRO-0 fp32 engines from the same weights, one with train.zero.skip_one_rank_allreduce: the
    same parameters after every step (clipping on, weight decay on, one trainable tensor outside the graph)."""
    import deepspeed

    from train.main import init_distributed
    from train.zero import skip_one_rank_allreduce

    init_distributed()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.05,
              "zero_optimization": {"stage": 0}}
    engines, skipped = [], []
    for skip in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        model.unused = torch.nn.Parameter(torch.ones(4))  # trainable, never in the graph: gets no gradient
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                                               optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                                           weight_decay=0.1))
        skipped.append(skip_one_rank_allreduce(engine, 1) if skip else False)
        engines.append(engine)
    equal, unused_moved = [], []
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 16)
        for engine in engines:
            engine.backward(engine(x).square().sum())
            engine.step()
        a, b = (list(e.module.parameters()) for e in engines)
        equal.append(all(torch.equal(p, q) for p, q in zip(a, b)))
        unused_moved.append([not torch.equal(e.module.unused.detach(), torch.ones(4)) for e in engines])
    json.dump({"skipped": skipped, "equal": equal, "unused_moved": unused_moved}, open(out, "w"))


if __name__ == "__main__":
    (one_rank_allreduce if sys.argv[2:] == ["allreduce"] else main)(sys.argv[1])
