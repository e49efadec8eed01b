"""One-rank ZeRO-2 engine on CPU (gloo) comparing train.zero.fuse_gradient_checks with DeepSpeed's own
per-tensor gradient norm and inf/NaN check (tests/test_levers.py runs it in a subprocess: DeepSpeed's
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
    json.dump({"replaced": replaced, "tensors": tensors, "finite": finite, "nan": nan,
               "nan_step_skipped": skipped, "grad_norm_after_nan": float(engine.get_global_grad_norm())}, open(out, "w"))


if __name__ == "__main__":
    main(sys.argv[1])
