"""The memory plan: each rank's predicted peak, broken down, against its device; what fits; the levers.

Per rank, a training step's peak is the memory held all run long (under DDP the weights by dtype, the trainable
parameters' gradients, which live in DDP's buckets, and AdamW's two states per trainable parameter; under FSDP2 this
rank's shards of them and the layers it gathers (``strategy.py``); a CUDA process's fixed costs)
plus what the rank's costliest micro-batch needs on top: the activations kept for backward and the transients of
its forward and backward (the LM head's logits chunk, a checkpointed layer recomputed, gradients in flight), both
simulated (``simulate.py``) on the micro-batches the run's own plan gives that rank (``batches.py``). Evaluation
runs with the same weights, buckets and states, and a forward pass of the costliest eval micro-batch.

What a process holds besides those tensors is a fixed cost, each named with the ``plan.*`` key that sets it
(``fixed_costs``): on a GPU the CUDA context, NCCL's buffers and the caching allocator's slack, estimates until a GPU
calibrates them (none has been lent to the project's CPU-only sessions yet); on a CPU the process's resident set
before the weights load (the interpreter, the libraries, the tokenized data), measured where the plan runs, so that
the plan predicts the resident peak the report measures. The limit is what a process may hold (``device_limit``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ddptrain.config import DType, PlanConfig, RunConfig, SaveCheckMode
from ddptrain.plan.batches import Candidate
from ddptrain.plan.simulate import BatchShape, FakeModel

GIB = 2**30
CUDA_CONTEXT = "CUDA context (plan.cuda_context_gb)"
NCCL_BUFFERS = "NCCL buffers (plan.nccl_gb)"
RESIDENT_AT_START = "resident at start (plan.resident_baseline_gb)"
"""The fixed costs' names: the rows of the printed plan, each naming the key that overrides it."""


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
    eval_peak: int | None = None  # the evaluation peak with it, where it changes what a rank holds; None: the plan's


@dataclass
class MemoryPlan:
    """Bytes per rank. ``device_bytes`` is None where the device's memory is unknown (CPU without
    ``plan.device_memory_gb``)."""

    device: str
    device_bytes: int | None
    world_size: int
    weights: dict[str, int]  # by dtype (parallel.strategy=fsdp2: this rank's shards)
    trainable: int  # parameters
    gradients: int
    optimizer: int
    fixed: dict[str, int]  # by name (fixed_costs)
    ranks: list[StepPeak]
    strategy: str = "ddp"  # parallel.strategy
    sharding: dict[str, int] = dataclasses.field(default_factory=dict)  # fsdp2's rows beyond the shards (strategy.py)
    host: int = 0  # bytes in host memory instead of the device (parallel.cpu_offload=true)
    slack_share: float = 0.0  # the caching allocator's, on a GPU (plan.allocator_slack)
    limit_source: str = ""  # where device_bytes comes from, in words
    eval: StepPeak | None = None
    save_check: int = 0  # bytes on rank 0's device while a save is checked (save_check_bytes)
    levers: list[Lever] = dataclasses.field(default_factory=list)
    largest: str | None = None  # the largest batch setting that fits the worst case: every row at data.max_length
    largest_on_data: str | None = None  # the largest whose costliest micro-batch of this data fits

    @property
    def held(self) -> int:
        """Held all run long: weights, gradients, optimizer states, fsdp2's gathered layers and buffers, fixed costs."""
        tensors = sum(self.weights.values()) + self.gradients + self.optimizer + sum(self.sharding.values())
        return tensors + sum(self.fixed.values())

    def slack(self, allocated: int) -> int:
        return int(self.slack_share * allocated)

    def peak(self, step: StepPeak) -> int:
        """A rank's peak with ``step`` (a training micro-step, or an eval forward pass)."""
        allocated = self.held + step.activations + step.transient
        return allocated + self.slack(allocated - sum(self.fixed.values()))

    def allocated(self, step: StepPeak) -> int:
        """A rank's peak as the caching allocator counts it (``max_memory_allocated``): no fixed costs, no slack."""
        return self.held - sum(self.fixed.values()) + step.activations + step.transient

    def as_measured(self, step: StepPeak) -> int:
        """A rank's peak as the run's report measures it: on a GPU the peak allocated (``max_memory_allocated``), on
        a CPU the process's peak resident set, the whole peak (the resident set at start included)."""
        return self.allocated(step) if self.device == "cuda" else self.peak(step)

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


def fixed_costs(cfg: PlanConfig, device: str, world_size: int) -> dict[str, int]:
    """What a process holds besides the tensors the plan simulates, by name: on a GPU outside the caching allocator
    (the CUDA context; NCCL's buffers with more than one rank), on a CPU its resident set before the weights load
    (``resident_at_start``; none where it is 0)."""
    if device != "cuda":
        resident = resident_at_start(cfg)
        return {RESIDENT_AT_START: resident} if resident else {}
    costs = {CUDA_CONTEXT: int(cfg.cuda_context_gb * GIB)}
    if world_size > 1:
        costs[NCCL_BUFFERS] = int(cfg.nccl_gb * GIB)
    return costs


def resident_at_start(cfg: PlanConfig) -> int:
    """plan.resident_baseline_gb, else this process's resident set now (``/proc/self/statm``): called before any
    weight loads (a starting rank, after tokenizing; ``ddptrain plan``), it is what the process holds
    besides the tensors the plan counts: the interpreter, the libraries, the tokenized data. 0 where there is no
    /proc (the plan then counts the tensors alone)."""
    if cfg.resident_baseline_gb is not None:
        return int(cfg.resident_baseline_gb * GIB)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


PROBE_ROWS, PROBE_TOKENS = 2, 32  # evaluation.peft_check.Probe: two training rows, cut to 32 tokens


def save_check_bytes(model: FakeModel, cfg: RunConfig, vocab_size: int, device: str) -> int:
    """What rank 0 adds on its device while a save's round trip runs (``evaluation.save_check``: at the final save in
    every mode but off, at every save with trainer.save_check=full), beyond what it holds: for LoRA
    (``evaluation.peft_check``) the base loaded again (the weights without the adapters) and the probe's fp32
    logits, three of them (the training model's, the loaded adapter's, the merged model's); for a full fine-tune
    (``evaluation.full_check``) the whole model loaded again, compared tensor by tensor (no logits). The read-back
    of every other save holds one saved tensor at a time. 0 when there is no check (trainer.save_check=off) and on
    CUDA, where the check loads its copy on the host."""
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


def largest_fitting(
    plan: MemoryPlan, model: FakeModel, shape_of: Callable[[int], BatchShape], unit: int, most: int | None = None
) -> int | None:
    """The largest multiple of ``unit``, up to ``most``, whose micro-batch ``shape_of(n)`` fits the limit beside
    what the rank holds all run long (``batches.worst_case_shape``, ``batches.CostliestRows``); None where not
    even ``unit`` fits."""

    @functools.cache
    def need(n: int) -> int:
        allocated = plan.held + model.step(shape_of(n)).peak
        return allocated + plan.slack(allocated - sum(plan.fixed.values()))

    return _largest(need, plan.device_bytes, unit, most)


def _largest(need: Callable[[int], int], budget: int, unit: int, most: int | None = None) -> int | None:
    """The largest multiple of ``unit`` (up to ``most``) whose ``need`` is within ``budget``.

    What a micro-batch needs is a quadratic in its rows or tokens (activations grow with tokens, a mask with the
    square of a packed row's width), so three probes (1, 2 and 4 units) fix the curve; the multiple it predicts is
    then checked and stepped down until it fits (a handful of probes in all, not a bisection's dozen).
    """
    if need(unit) > budget:
        return None
    if most is not None and most <= 4 * unit:  # too few to fit a curve to: bisect, the top first
        return most if need(most) <= budget else _bisect(need, budget, unit, unit, most)
    xs = [unit, 2 * unit, 4 * unit]
    ys = [need(x) for x in xs]
    fits = [x for x, y in zip(xs, ys) if y <= budget]
    if len(fits) < len(xs):  # 2 or 4 units already too much
        return _bisect(need, budget, unit, max(fits), min(x for x in xs if x not in fits))
    a, b, c = np.polyfit(xs, ys, 2)
    roots = [r.real for r in np.roots([a, b, c - budget]) if abs(r.imag) < 1e-9 and r.real >= unit]
    guess = max(xs[-1], int(min(roots, default=xs[-1] * 64)) // unit * unit)
    if most is not None:
        guess = min(guess, most)
    # The guess and the next multiple decide it; where the curve misjudged, bisect between what fits and what not.
    if need(guess) <= budget:
        if guess == most or need(guess + unit) > budget:
            return guess
        return _bisect(need, budget, unit, guess + unit, None, most=most)
    return _bisect(need, budget, unit, xs[-1], guess)


def _bisect(
    need: Callable[[int], int],
    budget: int,
    unit: int,
    low: int,
    high: int | None,
    probes: int = 12,
    most: int | None = None,
) -> int:
    """The largest multiple of ``unit`` from ``low`` (which fits) below ``high`` (which does not; None: unknown, so
    double until something does not fit, or ``most`` does), in at most ``probes`` simulations."""
    while high is None and probes > 0:
        probes -= 1
        up = low * 2 if most is None else min(low * 2, most)
        if need(up) > budget:
            high = up
        elif up == most:
            return most
        else:
            low = up
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


def device_limit(cfg: PlanConfig, device: str, gpus: list[int] | None = None) -> tuple[int | None, str]:
    """What each rank may hold, and where that figure comes from: plan.device_memory_gb as given; else on a GPU what
    ``torch.cuda.mem_get_info`` says is free to this process (what other processes and the driver hold left out),
    the least over ``gpus`` (None: every visible GPU), plus the CUDA context the plan counts in the peak, which that
    figure has already lost (asking creates the context): the plan's estimate of it then cancels out of the verdict;
    else (a CPU without plan.device_memory_gb) None."""
    if cfg.device_memory_gb is not None:
        return int(cfg.device_memory_gb * GIB), "plan.device_memory_gb"
    if device == "cuda" and torch.cuda.is_available():
        indices = range(torch.cuda.device_count()) if gpus is None else gpus
        free = min(torch.cuda.mem_get_info(i)[0] for i in indices)
        return free + int(cfg.cuda_context_gb * GIB), "free on the GPU (torch.cuda.mem_get_info), its CUDA context back"
    return None, ""
