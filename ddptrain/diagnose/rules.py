"""The verdict rules: each turns the run's summary into a finding (the time per step it loses, the rule as text
with its threshold from ``trainer.diagnose.*``, and the numbers behind it) when it crosses its threshold.
``apply_rules`` lists every rule that fires, the verdict first: memory whenever it fires, then the others by the time
they lose; when none fires the run is compute-bound.
"""

from __future__ import annotations

from typing import Any

from ddptrain.config import DiagnoseConfig
from ddptrain.diagnose.runs import MIB, StepSplit, fullest_memory, step_split

VERDICTS = ("compute", "communication", "data", "imbalance", "straggler", "memory", "diverged")


# ----------------------------------------------------------------------------- verdict rules


def _finding(verdict: str, lost_s: float, step: float, rule: str, why: str, **evidence: Any) -> dict:
    return {
        "verdict": verdict,
        "lost_s": lost_s,
        "share": lost_s / step if step else None,
        "rule": rule,
        "why": why,
        "evidence": evidence,
    }


def _data_finding(s: dict, split: StepSplit, th: DiagnoseConfig) -> dict | None:
    share = split.data / s["step_time_s"]
    if share < th.data_share:
        return None
    rule = f"time_data_s / step_time_s = {share:.0%} ≥ trainer.diagnose.data_share = {th.data_share:.0%}"
    why = f"each rank waits {split.data:.3f} s per step for its data loader ({share:.0%} of the step)"
    return _finding("data", split.data, s["step_time_s"], rule, why, time_data_s=split.data)


def _comm_finding(s: dict, split: StepSplit, th: DiagnoseConfig) -> dict | None:
    share = split.comm_wire / s["step_time_s"]
    if share < th.comm_share:
        return None
    rule = f"exposed all-reduce / step_time_s = {share:.0%} ≥ trainer.diagnose.comm_share = {th.comm_share:.0%}"
    sent = s.get("allreduce_bytes_per_step")
    bytes_text = f" for {sent / MIB:.1f} MiB of gradients per rank" if sent else ""
    why = (
        f"{split.comm_wire:.3f} s of each {s['step_time_s']:.3f} s step is all-reduce that backward did not hide"
        f"{bytes_text} ({share:.0%})"
    )
    return _finding(
        "communication", split.comm_wire, s["step_time_s"], rule, why, exposed_comm_s=split.comm_wire,
        allreduce_bytes_per_step=sent, allreduce_calls_per_step=s.get("allreduce_calls_per_step"),
    )  # fmt: skip


def _balance_finding(s: dict, split: StepSplit, th: DiagnoseConfig) -> dict | None:
    """imbalance (the batch plan gave one rank more work) or straggler (the rank itself is slow)."""
    measured, planned = s.get("rank_time_imbalance"), s.get("rank_imbalance") or 1.0
    # measured ≤ 1: no rank is busier than the mean, so nobody waits (and the planned share below is undefined).
    if measured is None or measured < th.rank_time_imbalance or measured <= 1.0:
        return None
    lost = s.get("busy_excess_s") or (measured - 1.0) * (s["step_time_s"] - split.comm_wire - split.comm_wait)
    planned_part = (planned - 1.0) / (measured - 1.0)
    rule = (
        f"rank_time_imbalance = {measured:.2f} ≥ trainer.diagnose.rank_time_imbalance = {th.rank_time_imbalance:.2f}; "
        f"planned excess {planned - 1:.2f} is {planned_part:.0%} of the measured {measured - 1:.2f} "
        f"({'≥' if planned_part >= th.planned_share else '<'} trainer.diagnose.planned_share = {th.planned_share:.0%})"
    )
    evidence = {"rank_time_imbalance": measured, "rank_imbalance": planned, "slowest_rank": s.get("slowest_rank")}
    if planned_part >= th.planned_share:
        why = (
            f"the batch plan gives the busiest rank {planned:.2f}× the mean tokens; the others wait {lost:.3f} s a step"
        )
        return _finding("imbalance", lost, s["step_time_s"], rule, why, **evidence)
    why = (
        f"rank {s.get('slowest_rank')} is busy {measured:.2f}× the mean although the plan gives it {planned:.2f}×: "
        f"the rank itself is slow, and every other rank waits {lost:.3f} s per step for it"
    )
    return _finding("straggler", lost, s["step_time_s"], rule, why, **evidence)


def _memory_finding(s: dict, by_rank: list[dict], th: DiagnoseConfig) -> dict | None:
    """A rank near its device's capacity, or an allocator that had to free its cache to find memory."""
    total, retries = s.get("mem_total_gb"), s.get("alloc_retries") or 0
    fullest, rank, measure = fullest_memory(s, by_rank)
    fullest = fullest or 0.0
    fraction = fullest / total if total else None
    predicted = _predicted_fullest(s, by_rank)
    measured_room = fraction is None or fraction < th.memory_fraction
    if predicted is not None and measured_room and predicted[0] / predicted[2] >= th.memory_fraction:
        # The memory plan's prediction flags what one run's measured peak may not have met yet (a longer batch).
        fullest, rank, total = predicted
        measure, fraction = "is predicted to need", fullest / total
    if not retries and (fraction is None or fraction < th.memory_fraction):
        return None
    who = "the fullest rank" if rank is None else f"rank {rank}"
    rule = (
        f"{who} {measure} {fullest:.1f} of {total:.1f} GiB = {fraction:.0%} "
        f"(trainer.diagnose.memory_fraction = {th.memory_fraction:.0%}); allocator retries: {retries}"
        if total
        else f"allocator retries: {retries}"
    )
    why = f"{who} runs at the edge of its memory: the next longer batch may run out, and retries stall every rank"
    step = s.get("step_time_s") or 0.0
    return _finding(
        "memory", 0.0, step, rule, why, rank=rank, mem_gb=fullest, mem_total_gb=total, alloc_retries=retries
    )


def _predicted_fullest(s: dict, by_rank: list[dict]) -> tuple[float, int | None, float] | None:
    """The memory plan's fullest rank (GiB, rank, device GiB), where the run planned at start and a device size is
    known (the measured device total, else the plan's)."""
    device = s.get("mem_total_gb") or s.get("mem_plan_device_gb")
    predicted = [(r["mem_predicted_gb"], r["rank"]) for r in by_rank if r.get("mem_predicted_gb") is not None]
    if not device or not predicted:
        return None
    gb, rank = max(predicted, key=lambda pair: (pair[0], -pair[1]))
    return gb, rank, device


def _compute_finding(s: dict, split: StepSplit) -> dict:
    step = s["step_time_s"]
    share = split.compute / step
    mfu = s.get("mfu")
    hardware = f"; MFU {mfu:.0%} of {s['peak_tflops']:.0f} TFLOP/s" if mfu is not None and s.get("peak_tflops") else ""
    rule = "no other rule crossed its threshold"
    why = f"forward and backward take {split.compute:.3f} s of a {step:.3f} s step ({share:.0%}){hardware}"
    return _finding("compute", split.compute, step, rule, why, compute_share=share, mfu=mfu, tflops=s.get("tflops"))


def apply_rules(s: dict, by_rank: list[dict], th: DiagnoseConfig) -> list[dict]:
    """Every rule that fires, the verdict first.

    memory comes first whenever it fires (an out-of-memory error ends the run, retries stall every rank); the others
    are ordered by the time per step they lose. When none fires the run is compute-bound.
    """
    split = step_split(s)
    if split is None or not s.get("step_time_s"):
        return []
    memory = _memory_finding(s, by_rank, th)
    timed = [_data_finding(s, split, th), _comm_finding(s, split, th), _balance_finding(s, split, th)]
    timed = sorted((f for f in timed if f), key=lambda f: -f["lost_s"])
    return ([memory] if memory else []) + (timed or [_compute_finding(s, split)])
