"""Host time of the per-tensor work in a LoRA step, on tiny CPU tensors where compute is negligible (issue 9: the
64-frame H200 step waits ~0.1 s on the host; BENCHMARKS.md "One H200, session 11").

Run: python -m scripts.bench_lora_host [--rounds 7] [--calls 300] [--steps 20]

  branch     one projection's forward + backward ([4, 16] input, r = 8, dropout 0.05, one thread):
             peft   the frozen base plus PEFT's branch, base(x) + B(A(dropout(x))) * s
             lever  the frozen base plus train/lora_dropout.py's branch (what ships below ZeRO-3)
             node   train/lora_dropout.py's group of one (--sibling-lora: o_proj, down_proj), base and branch in one node
  siblings   q, k and v of one attention module reading one [4, 16] input (PEFT LoRA r = 8, dropout 0.05):
             peft      PEFT's own three branches
             lever     train/lora_dropout.py's branch per projection (--no-sibling-lora)
             grouped   the three as one autograd node (--sibling-lora, what ships below ZeRO-3)
  reduction  forward + backward + step of 504 tiny bf16 linears (the 4B LoRA's tensor count) on one rank:
             hooks      DeepSpeed ZeRO-2, a reduction hook per gradient, train.main's fused gradient checks (what
                        auto ran on one GPU before train/adamw.py)
             coalesced  the same engine inside DeepSpeed's engine.coalesce_grad_reduction()
             plain      DeepSpeed stage 0 stepping train/adamw.py's fp32-master AdamW (what auto runs on one GPU)
             torch      plain torch with foreach AdamW on the bf16 tensors, no DeepSpeed, no masters
The arms run interleaved, `--rounds` times; printed: the median per call (branch) or per step (reduction).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.nn.functional as F

from train.lora_dropout import _DropoutThenA, _SiblingBranches
from train.adamw import MasterWeightAdamW, clear_gradients_through
from train.zero import fuse_gradient_checks, skip_one_rank_allreduce

P, SCALE = 0.05, 2.0


def branch_arms():
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(16, 16)
    a = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, 8, requires_grad=True)
    drop = torch.nn.Dropout(P)

    def peft():
        (F.linear(x, w) + F.linear(F.linear(drop(x), a), b) * SCALE).sum().backward()

    def lever():
        torch.addmm(F.linear(x, w), _DropoutThenA.apply(x, a, P), b.t(), alpha=SCALE).sum().backward()

    def node():
        _SiblingBranches.apply(x, P, (SCALE,), w, a, b)[0].sum().backward()

    grads = []
    for f in (peft, node):
        torch.manual_seed(1)
        f()
        grads.append([t.grad.clone() for t in (x, a, b)])
        for t in (x, a, b):
            t.grad = None
    assert all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(grads[0], grads[1])), \
        "the one-node branch's gradients differ from PEFT's"
    return {"peft": peft, "lever": lever, "node": node}


class Qwen3VLTextAttention(torch.nn.Module):
    """A stand-in with the name train/lora_dropout.py knows: q, k and v called in that order on one input."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(16, 16, bias=False) for _ in range(3))

    def forward(self, x):
        return self.q_proj(x) + self.k_proj(x) + self.v_proj(x)


def sibling_arms():
    from peft import LoraConfig, get_peft_model

    from train.lora_dropout import recompute_lora_dropout

    x = torch.randn(4, 16, requires_grad=True)
    models = {}
    for name in ("peft", "lever", "grouped"):
        torch.manual_seed(0)
        model = get_peft_model(torch.nn.Sequential(Qwen3VLTextAttention()),
                               LoraConfig(r=8, lora_alpha=16, lora_dropout=P, target_modules=["q_proj", "k_proj", "v_proj"]))
        if name != "peft":
            n = recompute_lora_dropout(model, siblings=name == "grouped")
            assert n["sibling_groups"] == (name == "grouped"), n
        for p in model.parameters():  # B = 0 at init would make every gradient but B's zero
            if p.requires_grad:
                torch.nn.init.normal_(p)
        models[name] = model.train()
    grads = []
    for name, model in models.items():
        torch.manual_seed(1)
        model(x).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.requires_grad])
        x.grad = None
    assert all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for g in grads[1:] for p, q in zip(grads[0], g)), \
        "the lever's or the group's gradients differ from PEFT's"
    return {name: (lambda m=m: m(x).sum().backward()) for name, m in models.items()}


def reduction_arms(steps: int):
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    from train.main import init_distributed

    init_distributed()  # train.main's: a world of one on a free port, without DeepSpeed's CPU shared-memory op build
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    clip = 1.0

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(16, 8, bias=False) if i % 2 == 0 else
                                     torch.nn.Linear(8, 16, bias=False) for i in range(504)]).to(torch.bfloat16)

    def engine_arm(coalesced: bool):
        net = model()
        # torch's AdamW handed to DeepSpeed, as train.main does (a config optimizer would JIT-build FusedAdam)
        engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4), config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
            "gradient_clipping": clip, "steps_per_print": 10**9})
        fuse_gradient_checks(engine.optimizer)  # as train.main does (--fused-grad-checks, on by default)

        def run():
            for _ in range(steps):
                loss = engine(x).square().mean()
                with engine.coalesce_grad_reduction() if coalesced else contextlib.nullcontext():
                    engine.backward(loss)
                engine.step()
        return run

    def plain_adamw():
        net = model()
        # train.main's stage-0 path: DeepSpeed with its bf16 mode and clipping off, the one-rank all-reduce skipped
        engine, *_ = deepspeed.initialize(model=net, optimizer=MasterWeightAdamW(
            net.parameters(), lr=1e-4, weight_decay=0.0, max_grad_norm=clip), config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0,
            "steps_per_print": 10**9})
        assert skip_one_rank_allreduce(engine, 1)
        clear_gradients_through(engine, engine.optimizer)

        def run():
            for _ in range(steps):
                engine.backward(engine(x).square().mean())
                engine.step()
        return run

    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)

    def plain():
        for _ in range(steps):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return {"hooks": engine_arm(False), "coalesced": engine_arm(True), "plain": plain_adamw(), "torch": plain}


def interleaved(arms: dict, rounds: int, per_round: int) -> dict[str, float]:
    """Median time per unit (per_round units in one call of an arm), the arms alternating every round."""
    times = {k: [] for k in arms}
    for _ in range(rounds):
        for name, f in arms.items():
            t = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t) / per_round)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of every arm")
    ap.add_argument("--calls", type=int, default=300, help="projection forward + backward calls per branch round")
    ap.add_argument("--steps", type=int, default=20, help="training steps per reduction round")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    arms = branch_arms()
    branch = interleaved({k: (lambda f=f: [f() for _ in range(a.calls)]) for k, f in arms.items()}, a.rounds, a.calls)
    print("branch: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in branch.items()) + " per projection forward + backward")
    arms = sibling_arms()
    group = interleaved({k: (lambda f=f: [f() for _ in range(a.calls)]) for k, f in arms.items()}, a.rounds, a.calls)
    print("siblings: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in group.items()) + " per q/k/v forward + backward")
    reduction = interleaved(reduction_arms(a.steps), a.rounds, a.steps)
    print("reduction: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in reduction.items()) + " per step (504 tensors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
