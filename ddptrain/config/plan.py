"""The ``plan`` group's schema: what the memory plan (``ddptrain plan``) plans for, and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class PlanConfig:
    device_memory_gb: Optional[float] = None
    """What each rank may hold in GiB, the limit the plan must fit in; null = measured on the GPU (trainer.device=cuda,
    or auto with a GPU visible): what ``torch.cuda.mem_get_info`` says is free to this process (other processes on
    the device and the driver's share left out), plus the CUDA context the plan counts (plan.cuda_context_gb), which
    that figure has already lost. On a CPU, the host memory a rank may use, as given; with null there is no verdict,
    only the breakdown. Planning for a GPU from elsewhere, give what a process can allocate, not the card's label:
    ``torch.cuda.mem_get_info()[0]`` on the node."""
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
    cuda_context_gb: float = 0.5
    """GiB each GPU process holds outside torch's caching allocator: the CUDA context and the kernels torch loads.
    An estimate (no GPU has measured it for this project); on your node, nvidia-smi's figure for a process that has
    run a step, less its ``torch.cuda.memory_reserved()``."""
    nccl_gb: float = 0.25
    """GiB of NCCL's buffers in each GPU process of a multi-rank run (one communicator); an estimate. NVLS buffers
    on NVSwitch nodes (H100/H200 SXM) take 1 GiB or more: set plan.nccl_gb=1.5 there, or run with
    NCCL_NVLS_ENABLE=0."""
    allocator_slack: float = 0.05
    """On a GPU, what torch's caching allocator reserves beyond the peak allocated (fragmentation), as a share of it;
    an estimate. On your node: ``max_memory_reserved / max_memory_allocated - 1`` of a run (report.json has both)."""
    cpu_returns_freed_memory: bool = False
    """On a CPU run, hand every freed block of 64 KiB or more back to the system from the start of each rank
    (glibc's ``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_=65536`` does: ``process.memory``), so that
    the resident peak the report measures follows the tensors alive, the quantity the plan predicts. Off, glibc keeps
    freed blocks for reuse, 30-80% above the tensors' peak where activations dominate (bench/README.md), and the
    report says that its resident peak holds them. On, every step pays for the memory handed back and faulted in
    again: about 25% slower on a 4-layer model of width 512, 1.5 to 2.4 times as long on the bundled tiny one, whose
    steps are mostly allocation (bench/README.md). So never on unless asked: a run that plans at start keeps its
    speed."""
    resident_baseline_gb: Optional[float] = None
    """On a CPU, GiB a rank's process holds besides the tensors the plan counts: the interpreter, the libraries and
    the tokenized data. The report measures the process's resident peak, which holds them; null = measured where
    the plan runs (each rank of a starting run, before its weights load; ``ddptrain plan``, its own
    process); 0 = plan the tensors alone."""


def _check_plan(p: PlanConfig) -> list[str]:
    problems = []
    if p.device_memory_gb is not None and p.device_memory_gb <= 0:
        problems.append(
            f"plan.device_memory_gb={p.device_memory_gb} must be positive (GiB per device), or null for the GPU's own."
        )
    if p.max_epochs < 0:
        problems.append(f"plan.max_epochs={p.max_epochs} must be 0 (every epoch) or more.")
    for key in ("cuda_context_gb", "nccl_gb", "allocator_slack"):
        if getattr(p, key) < 0:
            problems.append(f"plan.{key}={getattr(p, key)} must be 0 or more (0 leaves the cost out).")
    if p.allocator_slack >= 1:
        problems.append(
            f"plan.allocator_slack={p.allocator_slack} is a share of the peak allocated: give it as 0.05 for 5%."
        )
    if p.resident_baseline_gb is not None and p.resident_baseline_gb < 0:
        problems.append(f"plan.resident_baseline_gb={p.resident_baseline_gb} must be 0 or more, or null to measure it.")
    return problems
