"""Optimizer over trainable parameters only, and the learning-rate schedule."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from ddptrain import optim
from ddptrain.config import OptimConfig, Scheduler
from ddptrain.optim import build_optimizer, build_scheduler, drop_update_if, lr_multiplier


class TwoLayers(nn.Module):
    """A frozen 'base' layer and a trainable 'adapter' layer with a bias."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.base.requires_grad_(False)
        self.norm = nn.LayerNorm(4)
        self.adapter = nn.Linear(4, 4)


def _ids(params) -> set[int]:
    return {id(p) for p in params}


def test_optimizer_holds_only_trainable_parameters():
    model = TwoLayers()
    optimizer = build_optimizer(OptimConfig(lr=1e-3), model)
    held = _ids(p for group in optimizer.param_groups for p in group["params"])
    assert held == _ids(p for p in model.parameters() if p.requires_grad)
    assert held.isdisjoint(_ids(model.base.parameters()))


def test_frozen_parameters_get_no_optimizer_state_and_do_not_move():
    torch.manual_seed(0)
    model = TwoLayers()
    optimizer = build_optimizer(OptimConfig(lr=1e-2, weight_decay=0.1), model)
    before = model.base.weight.clone()
    model.adapter(model.norm(model.base(torch.randn(3, 4)))).pow(2).sum().backward()
    optimizer.step()
    assert torch.equal(model.base.weight, before)
    assert _ids(optimizer.state) == _ids(p for p in model.parameters() if p.requires_grad)


def test_no_weight_decay_on_biases_and_norm_weights():
    model = TwoLayers()
    optimizer = build_optimizer(OptimConfig(lr=1e-3, weight_decay=0.1), model)
    decay_of = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert decay_of[id(model.adapter.weight)] == 0.1
    for p in (model.adapter.bias, model.norm.weight, model.norm.bias):
        assert decay_of[id(p)] == 0.0


def test_config_values_reach_the_optimizer():
    cfg = OptimConfig(lr=3e-4, betas=[0.8, 0.95], eps=1e-6)
    group = build_optimizer(cfg, TwoLayers()).param_groups[0]
    assert group["lr"] == 3e-4 and tuple(group["betas"]) == (0.8, 0.95) and group["eps"] == 1e-6


def test_nothing_trainable_is_a_value_error():
    model = TwoLayers().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(OptimConfig(), model)


def test_warmup_ramps_up_to_the_peak():
    cfg = OptimConfig(warmup_steps=4, scheduler=Scheduler.cosine)
    warm = [lr_multiplier(s, cfg, total_steps=20) for s in range(4)]
    assert all(0 < a < b for a, b in itertools.pairwise(warm))
    assert warm[0] > 0  # the first step already learns something
    assert warm[-1] < 1.0
    assert lr_multiplier(4, cfg, total_steps=20) == pytest.approx(1.0)


@pytest.mark.parametrize("scheduler", [Scheduler.cosine, Scheduler.linear])
def test_decay_goes_from_peak_to_min_lr_ratio(scheduler):
    cfg = OptimConfig(warmup_steps=2, scheduler=scheduler, min_lr_ratio=0.1)
    values = [lr_multiplier(s, cfg, total_steps=12) for s in range(2, 13)]
    assert values[0] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(values))
    assert lr_multiplier(50, cfg, total_steps=12) == pytest.approx(0.1)  # never below the floor


def test_cosine_and_linear_shapes_at_midpoint():
    cosine = OptimConfig(scheduler=Scheduler.cosine, min_lr_ratio=0.0)
    linear = OptimConfig(scheduler=Scheduler.linear, min_lr_ratio=0.0)
    assert lr_multiplier(5, cosine, total_steps=10) == pytest.approx(0.5)
    assert lr_multiplier(2, cosine, total_steps=10) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_multiplier(2, linear, total_steps=10) == pytest.approx(0.8)
    assert lr_multiplier(10, linear, total_steps=10) == pytest.approx(0.0)


def test_constant_stays_at_peak_after_warmup():
    cfg = OptimConfig(warmup_steps=3, scheduler=Scheduler.constant, min_lr_ratio=0.1)
    assert lr_multiplier(0, cfg, total_steps=10) < 1.0
    assert [lr_multiplier(s, cfg, total_steps=10) for s in range(3, 30)] == [1.0] * 27


def test_scheduler_drives_the_optimizer_lr():
    cfg = OptimConfig(lr=1e-2, warmup_steps=1, scheduler=Scheduler.linear, min_lr_ratio=0.0)
    model = TwoLayers()
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, total_steps=5)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [1e-2 * lr_multiplier(s, cfg, 5) for s in range(6)]
    assert seen == pytest.approx(expected)
    assert seen[0] == pytest.approx(0.5e-2) and seen[-1] == pytest.approx(0.0)


def test_a_checkpoint_of_another_implementation_keeps_the_fused_step_that_drops_on_the_device():
    """A checkpoint saved by an optimizer that stepped another way (foreach, as ddptrain's CPU runs did) carries its
    ``fused`` flag: loaded, this optimizer stays fused, so a dropped update (``drop_update_if``) still leaves every
    weight, moment and step count as it was."""
    model = TwoLayers()
    groups = [[g for g in group["params"]] for group in build_optimizer(OptimConfig(lr=0.1), model).param_groups]
    old = torch.optim.AdamW([{"params": params} for params in groups], lr=0.1, foreach=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    old.step()  # moments and a step count of 1, as a checkpoint after one step holds them
    optimizer = build_optimizer(OptimConfig(lr=0.1), model)
    optimizer.load_state_dict(old.state_dict())
    assert all(group["fused"] for group in optimizer.param_groups)
    state = optimizer.state[model.adapter.weight]
    kept = {key: value.clone() for key, value in state.items()}
    model.adapter.weight.grad = torch.full_like(model.adapter.weight, math.nan)
    before = model.adapter.weight.detach().clone()
    with drop_update_if(optimizer, torch.tensor(1.0)):
        optimizer.step()
    assert torch.equal(model.adapter.weight, before)
    assert all(torch.equal(state[key], kept[key]) for key in kept) and int(state["step"]) == 1


def test_under_fp16_the_loss_scaler_drops_overflows_and_only_max_skipped_steps_in_a_row_stop_the_run():
    """trainer.precision=fp16: an overflowing step is the GradScaler's routine (it drops the update and halves its
    scale), so trainer.on_nonfinite=stop does not stop at the first one; trainer.max_skipped_steps of them in a row
    do, and the record offers bf16. The drop flag is the scaler's own (its scale went down), read on the device."""
    from ddptrain.config import OnNonFinite
    from ddptrain.observe.nonfinite import NonFiniteGuard, StepVerdict

    model = TwoLayers()
    optimizer = build_optimizer(OptimConfig(lr=0.1), model)
    scheduler = build_scheduler(OptimConfig(lr=0.1), optimizer, total_steps=10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(torch.ones(()))  # the scale exists from the first loss scaled on
    params = [p for p in model.parameters() if p.requires_grad]
    guard = NonFiniteGuard(OnNonFinite.stop, 2, scaler.is_enabled(), [], torch.device("cpu"))
    assert not guard.drops, "under fp16 the scaler drops the step, not the guard"
    in_a_row = []
    for gradient in (math.inf, 1.0, math.nan, math.nan):  # an overflow, a good step, two overflows in a row
        for p in params:
            p.grad = torch.full_like(p, gradient * scaler.get_scale())
        before = model.adapter.weight.detach().clone()
        _, nonfinite, dropped = optim.step_optimizer(optimizer, scaler, scheduler, params, OptimConfig(), guard.drops)
        assert bool(dropped) == bool(nonfinite) == (not math.isfinite(gradient))
        assert torch.equal(model.adapter.weight, before) == bool(dropped), "a dropped step changes nothing"
        in_a_row.append(int(guard.verdict_of(torch.zeros((), dtype=torch.float64), nonfinite, dropped)[2]))
    assert in_a_row == [1, 0, 1, 2]
    verdicts = [StepVerdict(step, 0.0, bool(n), n) for step, n in enumerate(in_a_row, 1)]
    assert [guard.stops(v) for v in verdicts] == [False, False, False, True]
    assert [lever["set"] for lever in guard.levers] == ["trainer.precision=bf16"]
