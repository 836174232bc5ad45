"""The ``optim`` group's schema (``conf/optim/``): optimizer, learning-rate schedule, accumulation or a global batch
size, clipping, and their checks (a global batch counts samples, so it depends on ``data.batching``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from ddptrain.config.checks import _positive
from ddptrain.config.data import Batching, DataConfig


class Scheduler(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    scheduler: Scheduler = Scheduler.cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of optim.lr (cosine and linear)."""
    grad_accum_steps: int = 1
    """Micro-steps per optimizer step; gradients sync once per optimizer step."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all ranks; when set, optim.grad_accum_steps is derived from it, the
    number of processes and data.micro_batch_size (random and length_grouped batching only)."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm; null = no clipping."""


def _check_optim(o: OptimConfig, d: DataConfig) -> list[str]:
    problems = _positive({"optim.grad_accum_steps": o.grad_accum_steps, "optim.global_batch_size": o.global_batch_size})
    if o.global_batch_size is not None and d.batching in (Batching.token_budget, Batching.packed):
        problems.append(
            f"optim.global_batch_size={o.global_batch_size} counts samples, but data.batching={d.batching.value} "
            "puts a varying number of samples in each micro-batch: set optim.global_batch_size=null and use "
            "optim.grad_accum_steps (a step then holds up to processes × grad_accum_steps × "
            "data.max_tokens_per_batch tokens), or data.batching=length_grouped."
        )
    if o.name != "adamw":
        problems.append(f"optim.name={o.name} is not available: use optim=adamw.")
    if o.lr <= 0:
        problems.append(f"optim.lr={o.lr} must be positive.")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        problems.append(f"optim.betas={o.betas} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.999].")
    if o.warmup_steps < 0:
        problems.append(f"optim.warmup_steps={o.warmup_steps} must be 0 or more.")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        problems.append(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1].")
    if o.max_grad_norm is not None and o.max_grad_norm <= 0:
        problems.append(f"optim.max_grad_norm={o.max_grad_norm} must be positive, or null to disable clipping.")
    return problems
