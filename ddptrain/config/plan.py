"""The ``plan`` group's schema: what the memory plan (``python -m ddptrain.plan``) plans for, and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class PlanConfig:
    device_memory_gb: Optional[float] = None
    """Memory of each rank's device in GiB, what the plan must fit in; null = the GPU's own (trainer.device=cuda,
    or auto with a GPU visible); on a CPU with null there is no verdict, only the breakdown."""
    at_start: Optional[bool] = None
    """Plan every rank's memory when a run starts, after tokenizing and before any weight loads: the plan is logged,
    and report.json / report.md carry it beside the measured peak; null = on CUDA runs, and wherever
    plan.device_memory_gb is set."""
    stop_if_no_fit: bool = True
    """A run whose plan does not fit stops before loading weights, every rank, naming the fix; false = log the plan
    and start anyway (the plan can be wrong where a GPU was not measured, see bench/README.md)."""
    max_epochs: int = 20
    """Epochs whose batch plans are searched for the costliest micro-batch (a run's later epochs repeat the
    pattern); 0 = every epoch of the run."""


def _check_plan(p: PlanConfig) -> list[str]:
    problems = []
    if p.device_memory_gb is not None and p.device_memory_gb <= 0:
        problems.append(
            f"plan.device_memory_gb={p.device_memory_gb} must be positive (GiB per device), or null for the GPU's own."
        )
    if p.max_epochs < 0:
        problems.append(f"plan.max_epochs={p.max_epochs} must be 0 (every epoch) or more.")
    return problems
