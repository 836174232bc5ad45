"""Optimizer over the trainable parameters and the learning-rate schedule."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ddptrain.config import OptimConfig, Scheduler


class AdamW(torch.optim.AdamW):
    """torch's fused AdamW, which can drop a step on the device: with ``found_inf`` set to 1 it leaves the weights,
    the moments and the step count as they were, without the host reading anything (``drop_update_if``).

    A checkpoint's parameter groups carry the ``fused`` and ``foreach`` flags of the optimizer that saved them;
    loading one keeps this optimizer's, so a checkpoint from a run that stepped another way still drops on the device.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        how = [{key: group[key] for key in ("fused", "foreach")} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, kept in zip(self.param_groups, how):
            group.update(kept)


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over parameters with ``requires_grad`` only (frozen base weights get no state), fused on every device
    (one kernel per parameter group; the only implementation that drops a step without a host sync).

    Matrices get weight decay; biases and norm weights (1-D) do not.

    Raises:
        ValueError: the model has no trainable parameter.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters: set model.lora=true or unfreeze some weights.")
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """LR at optimizer step ``step`` (0-based) as a fraction of optim.lr: linear warmup, then decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.scheduler == Scheduler.constant:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.scheduler == Scheduler.cosine else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(
    cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine/linear/constant schedule over ``total_steps`` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))


def clip_gradients(params: list[torch.Tensor], cfg: OptimConfig) -> torch.Tensor:
    """Clip the (already unscaled) gradients to ``optim.max_grad_norm`` (null: measure only).

    Returns:
        The total gradient norm before clipping, on the device (reading it would wait for the step).
    """
    norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or math.inf)
    # FSDP2's sharded gradients give a replicated DTensor: every rank holds the whole norm, read as it is.
    return norm.to_local() if isinstance(norm, DTensor) else norm


@contextlib.contextmanager
def drop_update_if(optimizer: torch.optim.Optimizer, flag: torch.Tensor | None) -> Iterator[None]:
    """Within the block, ``optimizer.step()`` leaves everything as it was where ``flag`` (a 0-d float32 tensor on the
    parameters' device) is 1, and steps as usual where it is 0: the fused kernel reads the flag on the device, so
    nothing waits for the step to finish. None: step as usual. (fp16's GradScaler hands the fused optimizer its own
    flag the same way, inside ``scaler.step``; this block is for the steps it does not scale.)
    """
    if flag is None:
        yield
        return
    optimizer.found_inf = flag  # type: ignore[attr-defined]  # read by torch's fused AdamW in step()
    try:
        yield
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


def step_optimizer(
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    params: list[torch.Tensor],
    cfg: OptimConfig,
    drop_nonfinite: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | bool]:
    """Unscale, clip, step and schedule. The update is dropped on the device when the gradient norm is not finite
    and ``drop_nonfinite`` (trainer.on_nonfinite); under fp16 the GradScaler drops overflowing steps itself.

    Returns:
        The gradient norm, whether it is NaN or infinite (1.0, else 0.0), and whether the update was dropped: device
        values, unread (nothing here waits for the step to finish).
    """
    assert not (drop_nonfinite and scaler.is_enabled()), "under fp16 the GradScaler drops an overflowing step itself"
    scaler.unscale_(optimizer)
    grad_norm = clip_gradients(params, cfg)
    nonfinite = (~torch.isfinite(grad_norm)).float()  # a 0-d float32: the form the fused optimizer reads
    # GradScaler lowers its scale (a device tensor, updated in place) exactly when it skips a step;
    # get_scale() would copy it to the host and wait for the step to finish.
    scale_before = scaler._scale.clone() if scaler.is_enabled() else None
    with drop_update_if(optimizer, nonfinite if drop_nonfinite else None):
        scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    if scale_before is not None:
        return grad_norm, nonfinite, scaler._scale < scale_before
    return grad_norm, nonfinite, nonfinite if drop_nonfinite else False


def divergence_levers(cfg: OptimConfig) -> list[dict[str, Any]]:
    """The optim.* settings that calm a diverging run: ``{key, value, set, why}`` as the run report's levers are."""
    levers = [_lever("optim.lr", float(f"{cfg.lr / 2:.3g}"), "half the learning rate")]
    levers.append(_lever("optim.warmup_steps", max(2 * cfg.warmup_steps, 100), "a longer warmup"))
    if cfg.max_grad_norm is None or cfg.max_grad_norm > 1.0:
        now = "off" if cfg.max_grad_norm is None else f"at {cfg.max_grad_norm:g}"
        levers.append(_lever("optim.max_grad_norm", 1.0, f"clipping is {now}"))
    return levers


def _lever(key: str, value: Any, why: str) -> dict[str, Any]:
    return {"key": key, "value": value, "set": f"{key}={value}", "why": why}
