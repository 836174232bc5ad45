"""Optimizer over the trainable parameters and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from ddptrain.config import OptimConfig, Scheduler


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over parameters with ``requires_grad`` only (frozen base weights get no state).

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
    fused = all(p.is_cuda for p in trainable)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None
    )


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
    return torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or math.inf)
