"""A step whose numbers are not finite (``trainer.on_nonfinite``): the flag each step leaves on the device, the verdict
every rank reads late beside the stop votes, and the record a diverged run ends with.

Why one flag serves every rank without a collective of its own: a NaN or infinite loss comes of NaN or infinite
logits, whose backward makes that rank's gradients NaN; DDP's all-reduce carries them into every rank's gradients,
and the norm of the reduced gradients (which clipping computes anyway) is then the same, non-finite, on every rank.
Every rank computes the same flag from the same numbers, drops the same update on the device
(``optim.drop_update_if``), and reads the same verdict one step later with the stop votes (``parallel.LateRead``):
no host sync is added to a step.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddptrain import parallel
from ddptrain.config import OnNonFinite, TrainerConfig
from ddptrain.process.signals import DIVERGED_EXIT_CODE

log = logging.getLogger("ddptrain.trainer")

DIVERGED = "diverged"
"""The key of the divergence record in ``metrics.jsonl`` and in ``fit``'s result."""


class Diverged(Exception):
    """Raised inside ``Trainer.fit`` on every rank at the same step: training stops there (caught in ``fit``)."""

    def __init__(self, verdict: StepVerdict):
        super().__init__(f"step {verdict.step} diverged")
        self.verdict = verdict


@dataclass(frozen=True)
class StepVerdict:
    """What a step's late read says, the same on every rank."""

    step: int
    stop_votes: float  # ranks that asked to stop (SIGTERM, Ctrl-C)
    nonfinite: bool  # the step's gradient norm was NaN or infinite
    dropped_in_a_row: int  # updates dropped in a row, this step's included


class NonFiniteGuard:
    """Books each step's verdict on the device, reads it late, and says whether the run stops there.

    Args:
        policy: trainer.on_nonfinite.
        max_skipped_steps: trainer.max_skipped_steps: dropped updates in a row that stop the run.
        scaled: fp16 with a GradScaler, which drops overflowing steps itself (overflows are its routine, so only
            ``max_skipped_steps`` of them in a row stop the run).
        levers: the optim.* settings to offer (``optim.divergence_levers``); fp16's own is added here.
        device: where the step's tensors live.
    """

    def __init__(
        self, policy: OnNonFinite, max_skipped_steps: int, scaled: bool, levers: list[dict], device: torch.device
    ):
        self.policy, self.max_skipped_steps, self.scaled = policy, max_skipped_steps, scaled
        why = "fp16 overflows past 65,504; bf16 has fp32's range"
        fp16 = [{"key": "trainer.precision", "value": "bf16", "set": "trainer.precision=bf16", "why": why}]
        self.levers = [*levers, *(fp16 if scaled else [])]
        self.dropped_in_a_row = torch.zeros((), device=device)  # stays on the device: read with the verdict
        self.pending: tuple[parallel.LateRead, int, torch.Tensor] | None = None  # the last step's, unread

    @property
    def drops(self) -> bool:
        """Whether a non-finite step's update is dropped here (under fp16 the scaler drops it)."""
        return self.policy != OnNonFinite["continue"] and not self.scaled

    def verdict_of(
        self, stop_votes: torch.Tensor, nonfinite: torch.Tensor, dropped: torch.Tensor | bool
    ) -> torch.Tensor:
        """The step's verdict, on the device: ``[stop votes, non-finite flag, updates dropped in a row]``."""
        self.dropped_in_a_row = (self.dropped_in_a_row + 1) * torch.as_tensor(dropped, dtype=torch.float32)
        return torch.stack([stop_votes, nonfinite.double(), self.dropped_in_a_row.double()])

    def counted(self, loss_sum: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        """What the log window counts of a step's loss: one NaN would make the whole window's NaN, so only a finite
        loss and its tokens (device values, unread); a run that trains on through NaN (continue) logs it, as null."""
        if self.policy == OnNonFinite["continue"]:
            return loss_sum, tokens
        finite = torch.isfinite(loss_sum)
        return torch.where(finite, loss_sum, 0.0), tokens * finite

    def queue(self, verdict: torch.Tensor, step: int, local_loss: torch.Tensor) -> None:
        """Start copying step ``step``'s verdict to the host (no wait); keep its loss for the record."""
        self.pending = (parallel.LateRead(verdict, step), step, local_loss)

    def read(self) -> StepVerdict | None:
        """The verdict of the last step queued: one host read, of a copy queued with the step. The loop reads it a
        step late; logging, evaluating and saving, which wait for the device anyway, read it first.

        Raises:
            Diverged: the step stops the run; every rank reads the same verdict and raises at the same step.
        """
        if self.pending is None:
            return None
        late, step, _ = self.pending
        votes, nonfinite, in_a_row = late.values()
        verdict = StepVerdict(step=step, stop_votes=votes, nonfinite=nonfinite > 0, dropped_in_a_row=int(in_a_row))
        if self.stops(verdict):
            raise Diverged(verdict)
        return verdict

    def stops(self, verdict: StepVerdict) -> bool:
        """Whether the run stops at the verdict's step."""
        if self.policy == OnNonFinite["continue"]:
            return False
        if self.policy == OnNonFinite.skip or self.scaled:
            return verdict.dropped_in_a_row >= self.max_skipped_steps
        return verdict.nonfinite

    def record(self, verdict: StepVerdict, last_good: Path | None, metrics: Any) -> dict[str, Any]:
        """Every rank, at the step the run stops: which ranks' loss was not finite (one gather, on this path only),
        the record, logged to ``metrics`` (metrics.jsonl ends with it; the report's verdict reads it), one line in
        the log.

        Args:
            last_good: the newest checkpoint (written before the diverged step), or None.
            metrics: the run's metrics logger (a null one on ranks other than 0).

        Returns:
            The record: ``fit`` returns it under ``diverged``, and the launcher exits 65.
        """
        _, _, local_loss = self.pending
        nonfinite = parallel.all_gather_object(not bool(torch.isfinite(local_loss)))
        loss_ranks = [rank for rank, bad in enumerate(nonfinite) if bad]
        record = {
            "step": verdict.step,
            DIVERGED: True,
            "first_nonfinite": "loss" if loss_ranks else "grad_norm",
            "nonfinite_loss_ranks": loss_ranks,
            "dropped_in_a_row": verdict.dropped_in_a_row,
            "on_nonfinite": self.policy.value,
            "levers": self.levers,
            "last_good_checkpoint": str(last_good) if last_good is not None else None,
        }
        metrics.log(record)
        log.info("%s", divergence_message(record))  # in train.log; the launcher prints it on its way out
        return record


def build_nonfinite_guard(
    cfg: TrainerConfig, levers: list[dict], scaler: torch.amp.GradScaler, device: torch.device
) -> NonFiniteGuard:
    """The guard of trainer.on_nonfinite and trainer.max_skipped_steps; ``scaler`` enabled means fp16."""
    return NonFiniteGuard(cfg.on_nonfinite, cfg.max_skipped_steps, scaler.is_enabled(), levers, device)


def divergence_message(record: dict[str, Any]) -> str:
    """What a diverged run says on its way out: the step, what turned first, what stays, what to change."""
    step, ranks = record["step"], record["nonfinite_loss_ranks"]
    if record["first_nonfinite"] == "loss":
        first = f"the loss was NaN or infinite on rank(s) {', '.join(map(str, ranks))}"
    else:
        first = "the gradient norm was NaN or infinite (every rank's loss was finite)"
    streak = record["dropped_in_a_row"]
    how = f" after {streak} dropped update(s) in a row" if record["on_nonfinite"] != "stop" or streak > 1 else ""
    kept = record["last_good_checkpoint"] or "no checkpoint was saved before it"
    levers = "; or ".join(f"{lever['set']} ({lever['why']})" for lever in record["levers"])
    return (
        f"training diverged at step {step}{how}: {first}. Its update was dropped and nothing after it was saved; "
        f"the last good checkpoint: {kept}. Try {levers}."
    )


def refuse_to_replay_a_divergence(restart_count: int, run_dir: Path, console: Any) -> None:
    """A torchrun restart round (``restart_count`` > 0) of a run that diverged ends at once with exit code 65.

    torchrun restarts the group whenever a rank exits non-zero (``--max-restarts``), and a diverged run's ranks exit
    65: resumed from its last good checkpoint with the same settings, it would replay the same steps into the same
    divergence, once per restart allowed. The run diverged when its ``metrics.jsonl`` ends with a divergence record
    that no later training record follows. A new launch (round 0) trains as asked: changed levers may well help.

    Raises:
        SystemExit: with ``signals.DIVERGED_EXIT_CODE``, after one line saying why.
    """
    from ddptrain.diagnose.runs import divergence

    if restart_count == 0 or not (run_dir / "metrics.jsonl").is_file():
        return
    record = divergence(run_dir)
    if record is not None:
        console.say(f"ddptrain: not restarting: {divergence_message(record)}")
        sys.exit(DIVERGED_EXIT_CODE)
