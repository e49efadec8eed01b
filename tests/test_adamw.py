"""train/adamw.py: the trainer's fp32-master AdamW that DeepSpeed steps at stage 0."""
from __future__ import annotations

import copy

import pytest
import torch

from train.adamw import MasterWeightAdamW, applies


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16)) for shape in ((8, 16), (16,), (3, 8))]


def _grads(params, seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def test_steps_fp32_masters_like_torch_adamw_with_clipping():
    """Each step equals torch's AdamW on fp32 copies of the bf16 tensors, given the bf16 gradients cast up and
    clipped by their global norm; the model's tensors are the masters rounded to bf16, and the masters keep the
    precision bf16 would lose (an lr small enough that bf16 alone would round some updates away)."""
    params = _params()
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = MasterWeightAdamW(params, lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1)
    for step in range(4):
        _grads(params, step, scale=3.0)  # global norm well above 1: clipping is active
        for r, p in zip(ref, params):
            r.grad = p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        opt.step()
        assert not opt.overflow
        assert float(opt._global_grad_norm) == pytest.approx(float(norm), rel=1e-6)
        for m, r, p in zip(opt.masters, ref, params):
            torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-7)
            assert torch.equal(p.detach(), m.to(torch.bfloat16))
        opt.zero_grad()
        assert all(p.grad is None for p in params)
    assert any(not torch.equal(m, p.detach().float()) for m, p in zip(opt.masters, params))


def test_non_finite_gradient_skips_the_step_and_a_missing_one_steps_as_zero():
    params = _params()
    opt = MasterWeightAdamW(params, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0)
    before = [p.detach().clone() for p in params]
    _grads(params, 0)
    params[1].grad[3] = float("inf")
    opt.step()
    assert opt.overflow and float(opt._global_grad_norm) == -1.0  # DeepSpeed's sentinel for a non-finite norm
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, params))
    assert opt.state == {} or all(int(s["step"]) == 0 for s in opt.state.values())
    _grads(params, 1)
    params[2].grad = None  # no sample reached it: it steps with a zero gradient (weight decay, moments)
    opt.step()
    assert not opt.overflow
    assert not torch.equal(before[0], params[0].detach())
    assert params[2].grad is not None and not params[2].grad.any()


def test_state_dict_carries_the_masters_so_a_resumed_optimizer_continues_exactly():
    params = _params()
    opt = MasterWeightAdamW(params, lr=1e-3, weight_decay=0.01, max_grad_norm=0.0)
    for step in range(2):
        _grads(params, step)
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]  # what the module checkpoint holds
    resumed = MasterWeightAdamW(resumed_params, lr=1e-3, weight_decay=0.01, max_grad_norm=0.0)
    resumed.load_state_dict(saved)
    for step in (2, 3):
        for ps, o in ((params, opt), (resumed_params, resumed)):
            _grads(ps, step)
            o.step()
            o.zero_grad()
    for a, b in zip(opt.masters, resumed.masters):
        assert torch.equal(a, b)
    # without the masters in the checkpoint, the resumed run starts from the bf16-rounded values and drifts
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = MasterWeightAdamW(fresh_params, lr=1e-3, weight_decay=0.01, max_grad_norm=0.0)
    state = dict(saved)
    state.pop("fp32_masters")
    fresh.load_state_dict(state)
    assert any(not torch.equal(a, b) for a, b in zip(fresh.masters, resumed.masters))


def test_fp32_parameters_are_their_own_masters():
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    opt = MasterWeightAdamW(params, lr=1e-2, weight_decay=0.0)
    assert opt.masters[0] is params[0] and "fp32_masters" in opt.state_dict() and not opt.state_dict()["fp32_masters"]
    params[0].grad = torch.ones(4, 4)
    before = params[0].detach().clone()
    opt.step()
    assert not torch.equal(before, params[0].detach())


def test_applies_only_at_stage_0_with_the_trainers_own_config():
    assert applies(zero_stage=0, deepspeed_file=False, enabled=True)
    assert not applies(zero_stage=2, deepspeed_file=False, enabled=True)
    assert not applies(zero_stage=0, deepspeed_file=True, enabled=True)
    assert not applies(zero_stage=0, deepspeed_file=False, enabled=False)


def test_parameters_moved_after_the_masters_were_made_fail_loudly():
    """The masters are made where the parameters are when the optimizer is built; a model moved afterwards (as
    deepspeed.initialize moves it) would step on the host, copying every gradient there: refused, not slow."""
    params = _params()
    opt = MasterWeightAdamW(params, lr=1e-3, weight_decay=0.0)
    opt.masters[0] = opt.masters[0].to("meta")  # CPU only here: the masters stand elsewhere instead
    _grads(params, 0)
    with pytest.raises(RuntimeError, match="parameters are on cpu but their masters on meta"):
        opt.step()
