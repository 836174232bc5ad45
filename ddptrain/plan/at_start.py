"""The memory plan of a starting run: after tokenizing, before any weight loads, on every rank.

Each rank simulates its own costliest micro-batches (``make_plan`` with ``only_ranks``), one gather gives every rank
all the predictions, and every rank reaches the same verdict from them: a run that would not fit stops on every rank
at once, before minutes of loading weights, with the plan in the log and the fix in the error. Where it fits the plan
is logged, and the trainer hands the per-rank predictions to the report, beside the measured peaks.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ddptrain import parallel
from ddptrain.config import RunConfig
from ddptrain.data.tokenized import TokenizedData
from ddptrain.observe.console import RANK_ZERO_ONLY
from ddptrain.plan.budget import GIB, RESIDENT_AT_START, MemoryPlan, planned_device
from ddptrain.plan.planner import make_plan
from ddptrain.plan.render import render_plan
from ddptrain.process import hangs
from ddptrain.process.memory import return_freed_memory

log = logging.getLogger(__name__)


class RunDoesNotFit(RuntimeError):
    """The plan predicts a peak beyond the device's memory (plan.stop_if_no_fit=true)."""


@dataclass(frozen=True)
class Prediction:
    """What the report carries: each rank's predicted peak of training and of evaluation, GiB."""

    train_gb: list[float]  # empty: the run did not plan (plan.at_start)
    measured_gb: list[float] = dataclasses.field(default_factory=list)  # as the report measures it (as_measured)
    eval_gb: float | None = None
    device_gb: float | None = None
    freed_kept: bool = False  # CPU: glibc keeps freed blocks (plan.cpu_returns_freed_memory=false), in the peak

    def as_record(self, step: int) -> dict[str, object]:
        """The metrics record the report reads (``diagnose.runs``): per rank, the training step's predicted peak in
        the terms of the figure the report sets it beside (``MemoryPlan.as_measured``: on a GPU as the allocator
        counts it, no CUDA context, NCCL buffers or slack; on a CPU a resident set, the resident set at start
        included). That figure is the rank's peak up to its last logged step, so it also holds the weights' loading
        and any evaluation or save check before that step (README, "Memory plan"). ``mem_plan_freed_kept``: glibc
        kept freed blocks for reuse (plan.cpu_returns_freed_memory=false), which the measured resident peak holds and
        the plan does not. Empty (nothing is logged) when the run did not plan."""
        if not self.train_gb:
            return {}
        record = {"step": step, "mem_predicted_gb_by_rank": self.measured_gb, "mem_plan_device_gb": self.device_gb}
        return record | ({"mem_plan_freed_kept": True} if self.freed_kept else {})


def wanted(cfg: RunConfig) -> bool:
    """plan.at_start, where null means: on CUDA runs, and wherever plan.device_memory_gb is set."""
    if cfg.plan.at_start is not None:
        return cfg.plan.at_start
    return planned_device(cfg) == "cuda" or cfg.plan.device_memory_gb is not None


def plan_at_start(cfg: RunConfig, data: TokenizedData, rank: int, world_size: int) -> Prediction:
    """Plan this rank, gather every rank's plan, log it and decide (the same on every rank): after tokenizing,
    before any weight loads (``data``: the run's, ``TrainingData.tokenized``).

    Raises:
        RunDoesNotFit: the fullest rank's predicted peak exceeds the device and plan.stop_if_no_fit is true; the
            message (one line) names the peak, the device, the levers that would make it fit and the override.
    """
    cpu = planned_device(cfg) == "cpu"
    returned = cpu and cfg.plan.cpu_returns_freed_memory and return_freed_memory()
    if cpu and cfg.plan.cpu_returns_freed_memory and not returned:
        log.warning(
            "plan.cpu_returns_freed_memory=true: this C library has no glibc mallopt; the resident peaks the report "
            "measures also hold the freed memory it keeps for reuse",
            extra=RANK_ZERO_ONLY,
        )
    if not wanted(cfg):
        return Prediction([])
    try:
        return _plan_and_decide(cfg, data, rank, world_size, freed_kept=cpu and not returned)
    finally:
        hangs.board.enter("build_model")  # what the trainer does next: weights load (a hang report names it)


def _plan_and_decide(cfg: RunConfig, data: TokenizedData, rank: int, world_size: int, freed_kept: bool) -> Prediction:
    hangs.board.enter("memory_plan")  # one gather of every rank's prediction
    # A GPU rank's limit is its own GPU's free memory: asking another GPU would put a CUDA context on it.
    gpus = [torch.cuda.current_device()] if planned_device(cfg) == "cuda" and torch.cuda.is_available() else None
    mine = make_plan(cfg, data, world_size, with_levers=False, only_ranks={rank}, gpus=gpus)
    # Each rank's peak, its peak as the report measures it, and its limit: the smallest limit decides for all, so
    # that every rank reaches the same verdict.
    step = mine.ranks[0]
    gathered = parallel.all_gather_object((mine.peak(step), mine.as_measured(step), mine.device_bytes))
    peaks = [peak for peak, _, _ in gathered]
    devices = [device for _, _, device in gathered if device is not None]
    mine.device_bytes = min(devices) if devices else None
    prediction = Prediction(
        train_gb=[p / GIB for p in peaks],
        measured_gb=[measured / GIB for _, measured, _ in gathered],
        eval_gb=mine.peak(mine.eval) / GIB if mine.eval else None,
        device_gb=None if mine.device_bytes is None else mine.device_bytes / GIB,
        freed_kept=freed_kept,
    )
    worst = max([*peaks, mine.peak(mine.eval) if mine.eval else 0, mine.check_peak])
    if mine.device_bytes is None or worst <= mine.device_bytes:
        resident = mine.fixed.get(RESIDENT_AT_START)
        # On a CPU the report sets the plan beside each process's resident peak: say what the plan holds of it.
        at_start = f"its rank's resident set at start (rank 0: {resident / GIB:.2f} GiB)" if resident else ""
        baseline = f"; resident peaks, each with {at_start}" if resident else ""
        if freed_kept:
            baseline += (
                "; the measured peaks will also hold the freed memory glibc keeps for reuse "
                "(plan.cpu_returns_freed_memory=true hands it back, steps slower)"
            )
        log.info("memory plan: %s%s", _summary(prediction), baseline, extra=RANK_ZERO_ONLY)
        return prediction
    # The fullest rank plans itself whole (stopping: with the levers) and sends every rank the same words.
    fullest = max(range(world_size), key=peaks.__getitem__)
    stop = cfg.plan.stop_if_no_fit
    words = None
    if rank == fullest:
        # Against the limit the verdict used (the least over the ranks), its own GPU alone asked again.
        full = make_plan(
            cfg, data, world_size, with_levers=stop, only_ranks={fullest}, gpus=gpus, limit=mine.device_bytes
        )
        words = (render_plan(full, f"memory plan: {_summary(prediction)}"), _one_line(full) if stop else "")
    text, refusal = parallel.broadcast_object(words, src=fullest)
    if not stop:
        log.warning("%s\nstarting anyway: plan.stop_if_no_fit=false", text, extra=RANK_ZERO_ONLY)
        return prediction
    log.error("%s", text, extra=RANK_ZERO_ONLY)
    parallel.barrier()  # rank 0 has logged the plan: the first rank to fail would end the others' processes
    raise RunDoesNotFit(refusal)


def _summary(p: Prediction) -> str:
    ranks = ", ".join(f"{gb:.2f}" for gb in p.train_gb)
    evaluation = f"; evaluation {p.eval_gb:.2f}" if p.eval_gb is not None else ""
    device = f" of {p.device_gb:.2f} GiB per device" if p.device_gb is not None else " (no device size to compare with)"
    return f"predicted peak per rank {ranks} GiB{evaluation}{device}"


def _one_line(plan: MemoryPlan) -> str:
    """The refusal as one line (the launcher reports each rank's last line): the overflow, the fix, the override."""
    over = (plan.worst - plan.device_bytes) / GIB
    evaluation = plan.peak(plan.eval) if plan.eval else 0  # most levers re-plan training only
    fixes = [
        f"{lever.overrides} ({lever.peak / GIB:.2f} GiB)"
        for lever in sorted(plan.levers, key=lambda lever: lever.peak)
        if max(lever.peak, evaluation if lever.eval_peak is None else lever.eval_peak) <= plan.device_bytes
    ]
    largest = plan.largest_on_data
    if largest and not largest.startswith("nothing") and evaluation <= plan.device_bytes:
        fixes.append(f"{largest.split(' (')[0]} (the largest that fits this data)")
    if fixes:
        advice = "predicted to fit with " + "; or ".join(fixes[:3])
    else:
        advice = "no single setting makes it fit: combine the levers of the plan logged above, or use larger devices"
    return (
        f"the run does not fit: predicted peak {plan.worst / GIB:.2f} GiB, {over:.2f} GiB over the device's "
        f"{plan.device_bytes / GIB:.2f} GiB ({plan.limit_source or 'plan.device_memory_gb'}); {advice}. Nothing was "
        "loaded. To start anyway: plan.stop_if_no_fit=false."
    )
