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
    opt = MasterWeightAdamW(params, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    before = [p.detach().clone() for p in params]
    _grads(params, 0)
    params[1].grad[3] = float("inf")
    opt.step()
    assert opt.overflow and float(opt._global_grad_norm) == -1.0  # DeepSpeed's sentinel for a non-finite norm
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, params))
    assert all(int(s["step"]) == 0 for s in opt.state.values())
    _grads(params, 1)
    params[2].grad = None  # no sample reached it: it steps with a zero gradient (weight decay only), not a stale one
    opt.step()
    assert not opt.overflow and all(int(s["step"]) == 1 for s in opt.state.values())
    assert not torch.equal(before[0], params[0].detach())
    torch.testing.assert_close(opt.masters[2], before[2].float() * (1 - 1e-2 * 0.1), rtol=0, atol=1e-7)


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
    state.pop("fp32_master")
    fresh.load_state_dict(state)
    assert any(not torch.equal(a, b) for a, b in zip(fresh.masters, resumed.masters))


def test_fp32_parameters_are_views_of_the_master_itself():
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(3))]
    opt = MasterWeightAdamW(params, lr=1e-2, weight_decay=0.0)
    assert params[0].untyped_storage().data_ptr() == opt.master.untyped_storage().data_ptr()
    assert opt.state_dict()["fp32_master"] is None  # nothing to carry twice
    params[1].grad = torch.ones(3)
    params[0].grad = torch.ones(4, 4)
    before = params[0].detach().clone()
    opt.step()
    assert not torch.equal(before, params[0].detach())


def test_applies_only_at_stage_0_with_the_trainers_own_config():
    assert applies(zero_stage=0, deepspeed_file=False, enabled=True)
    assert not applies(zero_stage=2, deepspeed_file=False, enabled=True)
    assert not applies(zero_stage=0, deepspeed_file=True, enabled=True)
    assert not applies(zero_stage=0, deepspeed_file=False, enabled=False)


def test_parameters_moved_after_the_optimizer_was_built_fail_loudly():
    """The trainable tensors become views into the optimizer's flat buffer; a model moved or cast afterwards (as
    deepspeed.initialize would move one left on the host) holds copies the step would never update: refused, not
    silently untrained."""
    params = _params()
    opt = MasterWeightAdamW(params, lr=1e-3, weight_decay=0.0)
    _grads(params, 0)
    opt.step()  # views: fine
    last = params[-1]
    last.data = last.data.clone()  # what module.to(other device) or a cast does to each tensor
    _grads(params, 1)
    with pytest.raises(RuntimeError, match="trainable tensor 2 no longer lives in the optimizer's flat buffer"):
        opt.step()


def test_trainable_tensors_of_several_dtypes_are_refused():
    with pytest.raises(ValueError, match="share one dtype and device"):
        MasterWeightAdamW([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))],
                          lr=1e-3, weight_decay=0.0)
