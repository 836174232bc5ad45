"""The memory plan: each rank's predicted peak, broken down, against its device; what fits; the levers.

Per rank, a training step's peak is the memory held all run long (the weights by dtype; the trainable parameters'
gradients, which live in DDP's buckets; AdamW's two states per trainable parameter; a CUDA process's fixed costs)
plus what the rank's costliest micro-batch needs on top: the activations kept for backward and the transients of
its forward and backward (the LM head's logits chunk, a checkpointed layer recomputed, gradients in flight), both
simulated (``simulate.py``) on the micro-batches the run's own plan gives that rank (``batches.py``). Evaluation
runs with the same weights, buckets and states, and a forward pass of the costliest eval micro-batch.

The fixed costs of a CUDA process are estimates until a GPU calibrates them (none has been lent to the project's
CPU-only sessions yet): see ``CUDA_CONTEXT_GIB``, ``NCCL_GIB`` and ``ALLOCATOR_SLACK``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ddptrain.config import Batching, DType, RunConfig, SaveCheckMode
from ddptrain.plan.batches import Candidate
from ddptrain.plan.simulate import BatchShape, FakeModel

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5
"""The CUDA context and the kernels torch loads (lazily) in each GPU process: outside the caching allocator."""
NCCL_GIB = 0.25
"""NCCL's buffers for one communicator in each GPU process of a multi-process run."""
ALLOCATOR_SLACK = 0.05
"""What the caching allocator reserves beyond the peak allocated (fragmentation), as a share of that peak."""


@dataclass(frozen=True)
class StepPeak:
    """A rank's costliest micro-batch and what it adds to the memory held all run long."""

    candidate: Candidate
    activations: int  # kept for backward
    transient: int  # beyond them, at the step's fullest moment


@dataclass(frozen=True)
class Lever:
    overrides: str  # what to type
    peak: int  # the fullest rank's predicted peak with it
    note: str = ""


@dataclass
class MemoryPlan:
    """Bytes per rank. ``device_bytes`` is None where the device's memory is unknown (CPU without
    ``plan.device_memory_gb``)."""

    device: str
    device_bytes: int | None
    world_size: int
    weights: dict[str, int]  # by dtype
    trainable: int  # parameters
    gradients: int
    optimizer: int
    fixed: dict[str, int]
    ranks: list[StepPeak]
    eval: StepPeak | None = None
    save_check: int = 0  # bytes on rank 0's device while a save is checked (save_check_bytes)
    levers: list[Lever] = dataclasses.field(default_factory=list)
    largest: str | None = None  # the largest batch setting that fits

    @property
    def held(self) -> int:
        """Held all run long: weights, gradients, optimizer states and fixed costs."""
        return sum(self.weights.values()) + self.gradients + self.optimizer + sum(self.fixed.values())

    def slack(self, allocated: int) -> int:
        return int(ALLOCATOR_SLACK * allocated) if self.device == "cuda" else 0

    def peak(self, step: StepPeak) -> int:
        """A rank's peak with ``step`` (a training micro-step, or an eval forward pass)."""
        allocated = self.held + step.activations + step.transient
        return allocated + self.slack(allocated - sum(self.fixed.values()))

    def allocated(self, step: StepPeak) -> int:
        """A rank's peak as the caching allocator counts it (``max_memory_allocated``): no fixed costs, no slack."""
        return self.held - sum(self.fixed.values()) + step.activations + step.transient

    @property
    def fullest(self) -> StepPeak:
        return max(self.ranks, key=self.peak)

    @property
    def check_peak(self) -> int:
        """Rank 0's peak while it checks a save: what it holds, a second copy of the base, the probe's logits."""
        if not self.save_check:
            return 0
        allocated = self.held + self.save_check
        return allocated + self.slack(allocated - sum(self.fixed.values()))

    @property
    def worst(self) -> int:
        """The plan's highest peak: training on the fullest rank, evaluation, or rank 0's save check."""
        return max(self.peak(self.fullest), self.peak(self.eval) if self.eval else 0, self.check_peak)

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.worst <= self.device_bytes


def held_memory(model: FakeModel, cfg: RunConfig, world_size: int) -> tuple[dict[str, int], int, int, int]:
    """(weights by dtype, trainable parameters, gradient bytes, optimizer-state bytes) of one rank."""
    trainable, grad_bytes = model.trainable_parameters()
    # DDP's buckets hold the gradients; without gradient_as_bucket_view each gradient is a second copy.
    copies = 2 if world_size > 1 and not cfg.parallel.gradient_as_bucket_view else 1
    optimizer = 2 * grad_bytes  # AdamW: exp_avg and exp_avg_sq, in each parameter's dtype
    return model.parameter_bytes(), trainable, copies * grad_bytes, optimizer


def fixed_costs(device: str, world_size: int) -> dict[str, int]:
    """What a CUDA process holds outside the caching allocator (none on CPU), by name."""
    if device != "cuda":
        return {}
    costs = {"CUDA context": int(CUDA_CONTEXT_GIB * GIB)}
    if world_size > 1:
        costs["NCCL buffers"] = int(NCCL_GIB * GIB)
    return costs


PROBE_ROWS, PROBE_TOKENS = 2, 32  # evaluation.save_check.Probe: two training rows, cut to 32 tokens


def save_check_bytes(model: FakeModel, cfg: RunConfig, vocab_size: int, device: str) -> int:
    """What rank 0 adds on its device while it checks a save, beyond what it holds: for LoRA
    (``evaluation.save_check``) the base loaded again (the weights without the adapters) and the probe's fp32
    logits, three of them (the training model's, the loaded adapter's, the merged model's); for a full fine-tune
    (``evaluation.full_check``) the whole model loaded again, compared tensor by tensor (no logits). 0 when there is
    no check (trainer.save_check=off) and on CUDA, where the check loads its copy on the host."""
    if cfg.trainer.save_check == SaveCheckMode.off or device == "cuda":
        return 0
    weights = sum(model.parameter_bytes().values())
    if not cfg.model.lora:
        return weights
    base = weights - model.trainable_parameters()[1]
    return base + 3 * PROBE_ROWS * PROBE_TOKENS * vocab_size * 4


def step_peak(model: FakeModel, candidate: Candidate) -> StepPeak:
    """A training micro-step of ``candidate`` simulated: what it keeps for backward, and its transients beyond."""
    step = model.step(candidate.shape)
    return StepPeak(candidate, step.saved, step.peak - step.saved)


def eval_peak(model: FakeModel, candidate: Candidate) -> StepPeak:
    """An eval forward pass of ``candidate`` simulated: nothing kept, its peak as transient."""
    return StepPeak(candidate, 0, model.forward_peak(candidate.shape))


def largest_fitting(plan: MemoryPlan, model: FakeModel, cfg: RunConfig, targets_per_token: float) -> str | None:
    """The largest batch setting whose worst micro-batch fits the device: ``data.micro_batch_size`` with every row
    at ``data.max_length`` (random, length_grouped), else ``data.max_tokens_per_batch`` (token_budget, packed)."""
    if plan.device_bytes is None:
        return None
    d = cfg.data
    packed = d.batching == Batching.packed
    by_rows = d.batching in (Batching.random, Batching.length_grouped)
    step_of = 1 if by_rows else d.max_length

    def shape(n: int) -> BatchShape:
        rows, width = (n, d.max_length) if by_rows or not packed else (1, n)
        if d.batching == Batching.token_budget:
            rows, width = max(n // d.max_length, 1), d.max_length
        return BatchShape(rows, width, int(rows * width * targets_per_token), padded=not packed, packed=packed)

    def need(n: int) -> int:
        allocated = plan.held + model.step(shape(n)).peak
        return allocated + plan.slack(allocated - sum(plan.fixed.values()))

    best = _largest(need, plan.device_bytes, step_of)
    if best is None:
        return "nothing fits: not even one row of data.max_length" if by_rows else "nothing fits"
    key = "data.micro_batch_size" if by_rows else "data.max_tokens_per_batch"
    return f"{key}={best}" + (f" at data.max_length={d.max_length}" if by_rows else "")


def _largest(need: Callable[[int], int], budget: int, unit: int) -> int | None:
    """The largest multiple of ``unit`` whose ``need`` is within ``budget``.

    What a micro-batch needs is a quadratic in its rows or tokens (activations grow with tokens, a mask with the
    square of a packed row's width), so three probes (1, 2 and 4 units) fix the curve; the multiple it predicts is
    then checked and stepped down until it fits (a handful of probes in all, not a bisection's dozen).
    """
    xs = [unit, 2 * unit, 4 * unit]
    ys = [need(x) for x in xs]
    if ys[0] > budget:
        return None
    fits = [x for x, y in zip(xs, ys) if y <= budget]
    if len(fits) < len(xs):  # 2 or 4 units already too much
        return _bisect(need, budget, unit, max(fits), min(x for x in xs if x not in fits))
    a, b, c = np.polyfit(xs, ys, 2)
    roots = [r.real for r in np.roots([a, b, c - budget]) if abs(r.imag) < 1e-9 and r.real >= unit]
    guess = max(xs[-1], int(min(roots, default=xs[-1] * 64)) // unit * unit)
    # The guess and the next multiple decide it; where the curve misjudged, bisect between what fits and what not.
    if need(guess) <= budget:
        return guess if need(guess + unit) > budget else _bisect(need, budget, unit, guess + unit, None)
    return _bisect(need, budget, unit, xs[-1], guess)


def _bisect(need: Callable[[int], int], budget: int, unit: int, low: int, high: int | None, probes: int = 12) -> int:
    """The largest multiple of ``unit`` from ``low`` (which fits) below ``high`` (which does not; None: unknown, so
    double until something does not fit), in at most ``probes`` simulations."""
    while high is None and probes > 0:
        probes -= 1
        if need(low * 2) <= budget:
            low *= 2
        else:
            high = low * 2
    while high is not None and high - low > unit and probes > 0:
        probes -= 1
        middle = (low + high) // (2 * unit) * unit
        low, high = (middle, high) if need(middle) <= budget else (low, middle)
    return low


def precision_of(cfg: RunConfig, device: str) -> DType:
    """trainer.precision on the planned device (auto: bf16 on CUDA, taken to be Ampere or newer; fp32 on CPU)."""
    from ddptrain.config import resolve_precision

    return resolve_precision(cfg.trainer.precision, device, bf16_supported=True)


def planned_device(cfg: RunConfig) -> str:
    """trainer.device as the workers will resolve it."""
    device = cfg.trainer.device.value
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def device_bytes(cfg: RunConfig, device: str) -> int | None:
    """plan.device_memory_gb, else the GPU's own memory (the smallest visible), else None."""
    if cfg.plan.device_memory_gb is not None:
        return int(cfg.plan.device_memory_gb * GIB)
    if device == "cuda" and torch.cuda.is_available():
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return None
