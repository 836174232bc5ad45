"""Where each optimizer step's time and memory go, per rank (trainer.timing).

The loop says which phase it enters (``StepClock.enter``); the time since the previous phase change is
booked to that phase's column:

    data       waiting on the data loader for the step's micro-batches
    compute    forward and backward, minus the communication left exposed (below)
    comm       communication nobody could hide: the token-count all-reduce at the start of a step (it
               waits for the slowest rank), and the part of the gradient all-reduce that backward did not
               overlap
    optimizer  unscale, clip, optimizer.step, scheduler
    other      host-to-device copies, token and FLOP counts, zero_grad, bookkeeping between the phases above

Logging, evaluation and checkpoints are not step time: their phases are booked to no column.

Exposed communication. DDP hands each gradient bucket to the comm hook as soon as its gradients are
computed, and backward returns only when every bucket's all-reduce has finished. On the CPU (gloo) the
hook runs on the autograd thread, so the time inside the hook is time that thread could not compute, and
after the last bucket is launched, the rest of backward is waiting: exposed = Σ (time inside the hook) +
(end of backward − exit from the last hook call). On CUDA the host runs ahead of the device, so the same
quantity is read on the device's timeline instead: exposed = elapsed(event recorded when the last bucket
is launched, event at the end of backward), both on the compute stream. Either way it is moved from the
compute column to the comm column.

FSDP2 (``parallel.strategy=fsdp2``) on the CPU calls its all-gathers (forward and backward) and reduce-scatters
synchronously: the time inside them (``parallel.fsdp``) is what the rank waited, moved to the comm column. On CUDA
they run on side streams and are not timed: the compute column holds the wait for them.

On CUDA every mark is a CUDA event; they are read once per log window (``close_window``), so timing adds
no host synchronisation per micro-step.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddptrain import parallel
from ddptrain.process import hangs
from ddptrain.process.memory import proc_bytes

COLUMNS = ("data", "compute", "comm", "optimizer", "other")
# The column each phase's time is booked to; None: not part of a step (and not in step_time_s).
COLUMN_OF: dict[str, str | None] = {
    "start": None,
    "wrap_model": None,
    "resume": None,
    "data": "data",
    "sync": "comm",
    "to_device": "other",
    "forward": "compute",
    "backward": "compute",
    "optimizer": "optimizer",
    "other": "other",
    "log": None,
    "eval": None,
    "samples": None,
    "save": None,
    "finish": None,
    "profile": None,
}
GIB = 1024**3
# Figures gathered from every rank once per window, in this order.
PER_RANK = ("step_time_s", *(f"time_{c}_s" for c in COLUMNS), "mem_peak_gb", "mem_reserved_gb", "alloc_retries")


class StepClock:
    """Books this rank's time to the columns above and reads its memory, one log window at a time.

    Args:
        device: the rank's device (CUDA: events and the caching allocator's statistics; CPU: the clock
            and the process's peak resident memory).
        comm: the counter DDP's comm hook writes its times into (``parallel.CommCounter`` with timed=True).
        now: the host clock (the comm hook reads ``time.perf_counter`` too).
    """

    def __init__(self, device: torch.device, comm: parallel.CommCounter, now: Callable[[], float] = time.perf_counter):
        self.now = now
        self.cuda = device.type == "cuda"
        self.device = device
        self.comm = comm
        self.phase = "start"
        self.steps = 0  # optimizer steps timed in this window (each enters "optimizer" once)
        # (column or None, start mark, end mark, sign): read at close_window, when CUDA events have completed.
        self.intervals: list[tuple[str | None, Any, Any, int]] = []
        self.retries_before = self._alloc_retries()
        self.window_start = self.last = self._mark()

    def enter(self, phase: str, step: int | None = None, micro_step: int | None = None) -> None:
        """Book the time since the last phase change to the phase being left; ``phase`` starts now."""
        hangs.board.enter(phase, step, micro_step)
        now = self._mark()
        self.intervals.append((COLUMN_OF[self.phase], self.last, now, 1))
        if self.phase == "backward":
            self._book_exposed_comm(now)
        elif COLUMN_OF[self.phase] is None:  # an evaluation's all-gathers (FSDP2) are no step's communication
            self.comm.take_times()
        self.steps += phase == "optimizer"
        self.phase, self.last = phase, now

    def close_window(self, flops_per_step: float, peak_tflops: float | None) -> dict[str, Any]:
        """This window's figures over all ranks (every rank calls it: one gather), then a new window.

        Args:
            flops_per_step: model FLOPs this rank computed per optimizer step in the window (``flops.ModelFlops``).
            peak_tflops: the device's peak for mfu, or None.
        """
        # The steps timed here: a window resumed from a checkpoint holds steps from before the restart.
        steps = max(self.steps, 1)
        now = self._mark()
        self.intervals.append((COLUMN_OF[self.phase], self.last, now, 1))
        if self.cuda:
            now.synchronize()
        mine = self._rank_figures(steps, now)
        self.intervals, self.window_start, self.last, self.steps = [], now, now, 0
        self.retries_before = self._alloc_retries()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        local = torch.tensor([*mine.values(), flops_per_step], dtype=torch.float64)
        gathered = parallel.all_gather_tensor(local).tolist()  # [world, len(PER_RANK) + 1]
        ranks = [dict(zip(PER_RANK, row)) for row in gathered]
        return window_record(ranks, sum(row[-1] for row in gathered), peak_tflops, self._total_memory_gb())

    # ------------------------------------------------------------------ internals

    def _mark(self) -> Any:
        if not self.cuda:
            return self.now()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start

    def _book_exposed_comm(self, backward_end: Any) -> None:
        """Move the gradient all-reduce's exposed part from compute to comm (see the module docstring); under FSDP2,
        on the CPU, the time inside its all-gathers and reduce-scatters of the micro-step."""
        host_intervals, last_launch = self.comm.take_times()
        if self.cuda:
            pieces = [(last_launch, backward_end)] if last_launch is not None else []
        else:
            pieces = list(host_intervals)
            if host_intervals and not self.comm.sharded:  # DDP's backward waits for its last bucket from there
                pieces.append((host_intervals[-1][1], backward_end))
        for start, end in pieces:
            self.intervals += [("comm", start, end, 1), ("compute", start, end, -1)]

    def _rank_figures(self, steps: int, window_end: Any) -> dict[str, float]:
        seconds = dict.fromkeys((*COLUMNS, None), 0.0)
        for column, start, end, sign in self.intervals:
            seconds[column] += sign * self._seconds(start, end)
        # The step time is the window's wall time less logging, evaluation and saving; the columns are
        # booked separately, so a phase booked twice or missed shows as columns that do not add up.
        step_time = self._seconds(self.window_start, window_end) - seconds.pop(None)
        peak_gb, reserved_gb = self._memory_gb()
        return {
            "step_time_s": step_time / steps,
            **{f"time_{c}_s": seconds[c] / steps for c in COLUMNS},
            "mem_peak_gb": peak_gb,
            "mem_reserved_gb": reserved_gb,
            "alloc_retries": float(self._alloc_retries() - self.retries_before),
        }

    def _memory_gb(self) -> tuple[float, float]:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / GIB, torch.cuda.max_memory_reserved(self.device) / GIB
        return peak_rss_bytes() / GIB, float("nan")

    def _alloc_retries(self) -> int:
        return torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0) if self.cuda else 0

    def _total_memory_gb(self) -> float | None:
        return torch.cuda.get_device_properties(self.device).total_memory / GIB if self.cuda else None


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far: Linux's ``VmHWM`` (this process's own address space), else
    ``ru_maxrss`` (macOS: bytes; Linux: KiB). Not ``ru_maxrss`` on Linux: the kernel carries the peak of the process
    that started this one across ``exec``, so a rank spawned by a launcher that held 800 MB reports 800 MB however
    little it held itself (measured: a spawned child's ``ru_maxrss`` 834 MB, its ``VmHWM`` 15 MB)."""
    hwm = proc_bytes(Path("/proc/self/status"), "VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def window_record(
    ranks: list[dict[str, float]], flops_per_step: float, peak_tflops: float | None, total_gb: float | None
) -> dict[str, Any]:
    """The metrics of one window from every rank's per-step figures (see docs/diagnostics.md for each key).

    Args:
        flops_per_step: model FLOPs of one optimizer step, all ranks together.
    """
    world = len(ranks)
    for rank, figures in enumerate(ranks):
        # Busy: everything but waiting on the other ranks. The slowest rank's busy time sets the pace.
        figures["busy_s"] = figures["step_time_s"] - figures["time_comm_s"]
        figures["rank"] = rank
    busy = [r["busy_s"] for r in ranks]
    step_time = max(r["step_time_s"] for r in ranks)
    # No FLOP count (a model flops.py cannot read): tflops and mfu are unknown, not zero.
    tflops = flops_per_step / world / max(step_time, 1e-12) / 1e12 if flops_per_step else None
    reserved = [r["mem_reserved_gb"] for r in ranks]
    return {
        "step_time_s": step_time,
        **{f"time_{c}_s": sum(r[f"time_{c}_s"] for r in ranks) / world for c in COLUMNS},
        "rank_time_imbalance": max(busy) / max(sum(busy) / world, 1e-12),
        "slowest_rank": max(range(world), key=busy.__getitem__),
        "model_flops_per_step": flops_per_step,
        "tflops": tflops,
        "mfu": tflops / peak_tflops if tflops is not None and peak_tflops else None,
        "peak_tflops": peak_tflops,
        "mem_peak_gb": max(r["mem_peak_gb"] for r in ranks),
        "mem_peak_gb_by_rank": [r["mem_peak_gb"] for r in ranks],
        "mem_reserved_gb_by_rank": None if total_gb is None else reserved,
        "mem_total_gb": total_gb,
        "alloc_retries": int(sum(r["alloc_retries"] for r in ranks)),
        "world_size": world,
        "by_rank": [
            {k: r[k] for k in ("rank", "step_time_s", *(f"time_{c}_s" for c in COLUMNS), "busy_s", "mem_peak_gb")}
            for r in ranks
        ],
    }


class NullClock:
    """trainer.timing=false: the phase still goes to the hang board (one assignment); nothing is timed."""

    def enter(self, phase: str, step: int | None = None, micro_step: int | None = None) -> None:
        hangs.board.enter(phase, step, micro_step)

    def close_window(self, flops_per_step: float, peak_tflops: float | None) -> dict[str, Any]:
        return {}


def build_clock(enabled: bool, device: torch.device, comm: parallel.CommCounter) -> StepClock | NullClock:
    """The step clock for trainer.timing; a timed clock makes DDP's hook record its times."""
    comm.timed = enabled
    return StepClock(device, comm) if enabled else NullClock()
