"""The metrics window: what each optimizer step leaves behind (``StepResult``), this rank's share of the steps
between two log lines (``Window``), and its reduction over all ranks into one metrics record, every rank calling the
same collectives and getting the same record. ``Stopwatch`` times the windows.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ddptrain import parallel


class Stopwatch:
    """Wall time since start and since the last lap (throughput windows)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


@dataclass
class StepResult:
    """What one optimizer step leaves behind (local to this rank until reduced); tensors stay on the device."""

    loss_sum: torch.Tensor  # the finite part (``local_loss`` whole): read only when logging, no wait on the GPU
    target_tokens: int | torch.Tensor  # the tokens behind loss_sum (a device value when a NaN loss may drop out)
    grad_norm: torch.Tensor
    overflowed: torch.Tensor | bool  # the update was dropped: fp16 overflow, or a non-finite gradient norm
    batch_tokens: list[tuple[int, int]]  # (real, padded) tokens of each micro-batch this rank trained on
    verdict: torch.Tensor  # [stop votes summed over ranks, non-finite flag, dropped in a row] (observe.nonfinite)
    flops: float = 0.0  # model FLOPs of this rank's micro-batches (ddptrain.observe.flops)
    local_loss: torch.Tensor | None = None  # this rank's loss sum as computed, NaN and all


@dataclass
class Window:
    """This rank's share of the steps between two log lines.

    A step's token counts travel with the step, measured from the tensors it trained on, so a
    window that spans an epoch boundary (or a resume) never looks anything up in a batch plan.
    Each rank keeps its own (a checkpoint saves every rank's, see ``checkpoint.Checkpointer``).
    """

    loss_sum: Any = 0.0  # a device tensor once a step is added: read only when logging
    target_tokens: Any = 0  # a device tensor once a step that may drop its loss is added
    batch_tokens: list[tuple[int, int]] = field(default_factory=list)
    overflowed_steps: Any = 0  # fp16 steps the GradScaler did not take; a device tensor once added
    steps: int = 0
    flops: float = 0.0

    def add(self, result: Any) -> None:
        """Add one ``StepResult``."""
        self.loss_sum = self.loss_sum + result.loss_sum.double()
        self.target_tokens += result.target_tokens
        self.batch_tokens += result.batch_tokens
        self.overflowed_steps = self.overflowed_steps + result.overflowed
        self.steps += 1
        self.flops += result.flops

    def close(
        self, *, step: int, epoch: int, lr: float, grad_norm: Any, watch: Stopwatch, comm: dict[str, int] | None
    ) -> dict:
        """The window over all ranks as one metrics record, then an empty window (in place: the checkpointer
        holds this object). Every rank calls it (it runs collectives) and gets the same record.

        Args:
            comm: the calls, syncs and bytes of the window's collectives by name (``parallel.CommCounter.take``:
                all-reduce, or FSDP2's reduce-scatter and all-gather), or None when DDP's built-in all-reduce ran
                uncounted (trainer.timing=false).
        """
        record = self._reduce(step, epoch, lr, float(grad_norm), watch, comm)
        self.load_state_dict(asdict(Window()))
        return record

    def _reduce(
        self, step: int, epoch: int, lr: float, grad_norm: float, watch: Stopwatch, comm: dict[str, int] | None
    ) -> dict:
        local = torch.tensor([float(self.loss_sum), float(self.target_tokens)], dtype=torch.float64)
        totals = parallel.all_reduce_sum(local)
        seconds = watch.lap()  # after the reduction: every rank's steps of the window are done
        real, padded, imbalance, peak = batch_stats(parallel.all_gather_tensor(torch.tensor(self.batch_tokens)))
        uncounted = dict.fromkeys(("allreduce_calls", "allreduce_syncs", "allreduce_bytes"))  # DDP's own all-reduce
        per_step = {f"{k}_per_step": None if n is None else n / self.steps for k, n in (comm or uncounted).items()}
        return {
            "step": step,
            "epoch": epoch,
            "loss": float(totals[0] / totals[1]) if totals[1] > 0 else None,  # None: no finite loss to average
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": real,
            "target_tokens": int(totals[1]),
            "tokens_per_s": real / max(seconds, 1e-9),
            "padding_fraction": 1.0 - real / max(padded, 1),
            "rank_imbalance": imbalance,
            "peak_rank_tokens": peak,
            "skipped_steps": int(self.overflowed_steps),
            # Per optimizer step and rank, as the collectives saw them: DDP's all-reduce, FSDP2's reduce-scatter
            # (calls, syncs: the steps' ends, bytes handed to it) and all-gather (calls, bytes received).
            **per_step,
            "elapsed_s": watch.elapsed(),
            "window_steps": self.steps,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers (the sums are read off the device): one rank's partial window for a checkpoint."""
        counts = {"target_tokens": int(self.target_tokens), "overflowed_steps": int(self.overflowed_steps)}
        return {**asdict(self), "loss_sum": float(self.loss_sum), **counts}

    def load_saved_ranks(self, states: list[dict[str, Any]], rank: int, world_size: int) -> None:
        """This rank's window on resume from the windows of a run on another number of processes: the saved ranks'
        micro-steps dealt to ``world_size`` ranks as the plan is (``data.plan.relayout``), so every rank holds as
        many, and the sums of the saved ranks it stands for (saved rank ``r`` goes to rank ``r mod world_size``;
        none on more processes), so the first record after the resume still adds up every saved rank's steps."""
        mine = states[rank::world_size]
        micro_steps = [entry for column in zip(*(s["batch_tokens"] for s in states), strict=True) for entry in column]
        micro_steps = micro_steps[: len(micro_steps) - len(micro_steps) % world_size]  # a short step left out
        self.load_state_dict({
            "loss_sum": sum(s["loss_sum"] for s in mine),
            "target_tokens": sum(s["target_tokens"] for s in mine),
            "flops": sum(s["flops"] for s in mine),
            "batch_tokens": micro_steps[rank::world_size],
            "overflowed_steps": states[0]["overflowed_steps"],  # steps, not ranks: the same on every rank
            "steps": states[0]["steps"],
        })  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum = float(state["loss_sum"])
        self.target_tokens = int(state["target_tokens"])
        self.batch_tokens = [(int(real), int(padded)) for real, padded in state["batch_tokens"]]
        self.overflowed_steps = int(state["overflowed_steps"])  # older formats: checkpoint.format reads them
        self.steps = int(state["steps"])
        self.flops = float(state["flops"])


def batch_stats(tokens: torch.Tensor) -> tuple[int, int, float, int]:
    """Figures of a log window from every rank's measured ``(real, padded)`` tokens per micro-step.

    Args:
        tokens: ``[world_size, micro_steps, 2]`` integers, as gathered from the ranks.

    Returns:
        Real and padded tokens over all ranks, the worst micro-step's rank imbalance (largest padded
        micro-batch / mean over ranks) and the largest padded micro-batch of any rank.
    """
    real, padded = int(tokens[..., 0].sum()), int(tokens[..., 1].sum())
    per_rank = tokens[..., 1].double()  # [world, micro_steps]
    imbalance = float((per_rank.max(dim=0).values / per_rank.mean(dim=0).clamp(min=1e-9)).max())
    return real, padded, max(imbalance, 1.0), int(per_rank.max())
