"""One rank's micro-batches for the DataLoader: the epoch plan (``plan.py``) read at this rank's column.

``DistributedBatchSampler`` holds the data position (epoch, micro-steps consumed) that a checkpoint saves
and a resumed run restores; a weighted mixture gives it the rows each epoch draws (``EpochRows``). A run resumed on
another number of processes trains the plan its checkpoint was made for, dealt to its own ranks (``Layout``).
Pure Python and numpy: no torch, no communication.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ddptrain.data.batch_cost import ceil_div
from ddptrain.data.plan import BatchingSpec, MicroBatch, check_lengths, plan_epoch, relayout

log = logging.getLogger(__package__)

EpochRows = Callable[[int], Sequence[int]]
"""The dataset indices an epoch draws from (``data.sources`` with weights draws anew each epoch)."""


@dataclass(frozen=True)
class Layout:
    """How a run trains the plan: its processes and the micro-steps each optimizer step accumulates. A run's own
    plan is made for its layout; one resumed on another number of processes trains its checkpoint's plan, whose
    ``world_size * grad_accum_steps`` micro-batches per step it shares (``plan.relayout``)."""

    world_size: int
    grad_accum_steps: int

    @classmethod
    def of(cls, spec: BatchingSpec) -> Layout:
        """The layout a plan is made for."""
        return cls(spec.world_size, spec.grad_accum_steps)

    @property
    def micro_batches_per_step(self) -> int:
        return self.world_size * self.grad_accum_steps


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


class DistributedBatchSampler:
    """One rank's micro-batches, for ``DataLoader(dataset, batch_sampler=...)``.

    Iterating does not move ``position``: a DataLoader with workers reads the sampler ahead of
    training, so only the trainer knows how many micro-steps were consumed. It reports them through
    ``skip`` or ``load_state_dict``, and ``state_dict`` gives them back for a checkpoint.
    """

    def __init__(
        self,
        lengths,
        spec: BatchingSpec,
        rank: int,
        epoch_rows: EpochRows | None = None,
        layout: Layout | None = None,
    ):
        """Plan epoch 0.

        Args:
            lengths: token length of every sample (1-D integers).
            spec: batching spec, equal on every rank: what the plan is made for.
            rank: this process's rank, ``0 <= rank < layout.world_size``.
            epoch_rows: the samples each epoch draws from (a weighted mixture draws anew every epoch);
                None = every sample, every epoch.
            layout: the run's processes and micro-steps per optimizer step, when they are not the plan's (a run
                resumed on another number of processes); None: the spec's.

        Raises:
            ValueError: rank out of range, a layout with other micro-batches per step than the plan's, or the data
                cannot fill one micro-step (see ``plan_epoch``).
        """
        layout = layout or Layout.of(spec)
        if layout.micro_batches_per_step != Layout.of(spec).micro_batches_per_step:
            raise ValueError(f"{layout} does not train a plan of {Layout.of(spec)}: it steps on other micro-batches")
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank {rank} is outside 0..{layout.world_size - 1} for world_size {layout.world_size}")
        self.spec = spec
        self.layout = layout
        self.rank = rank
        self._lengths = check_lengths(lengths, spec)
        self._epoch_rows = epoch_rows
        self._epoch = 0
        self._position = 0
        self._plan = self._plan_of(0)

    def _plan_of(self, epoch: int, strict: bool = True) -> list[list[MicroBatch]]:
        """The epoch's plan over the samples it draws, in dataset indices, dealt to the run's ranks.

        Raises:
            ValueError: (``strict``) the run trains a checkpoint's plan on another number of processes and the
                epoch's last, short optimizer step cannot be shared out among them: it would lose micro-batches,
                and an epochs-based run its step count and LR schedule. Not strict (an epoch entered mid-run, whose
                step count the run no longer depends on): they are left out, with a warning.
        """
        if self._epoch_rows is None:
            plan = plan_epoch(self._lengths, self.spec, epoch)
        else:
            rows = np.asarray(self._epoch_rows(epoch), dtype=np.int64)
            plan = plan_epoch(self._lengths[rows], self.spec, epoch)
            plan = [[[tuple(int(rows[i]) for i in row) for row in batch] for batch in step] for step in plan]
        if self.layout == Layout.of(self.spec):
            return plan
        plan, left_out = relayout(plan, self.layout.world_size)
        if left_out:
            saved, now = _processes(self.spec.world_size), _processes(self.layout.world_size)
            why = (
                f"epoch {epoch}'s last, short optimizer step leaves {left_out} micro-batch(es) that {now} cannot "
                f"share (its plan was made for {saved} x optim.grad_accum_steps={self.spec.grad_accum_steps})"
            )
            if strict:
                raise ValueError(
                    f"resuming on {now}: {why}. Resume on {saved}, or on a number of processes that divides the "
                    "micro-batches of every step."
                )
            log.warning("%s: they are left out", why)
        return plan

    @property
    def epoch_rows(self) -> EpochRows | None:
        """The samples each epoch draws from (None: every sample, every epoch)."""
        return self._epoch_rows

    @property
    def epoch(self) -> int:
        """The epoch whose plan is loaded."""
        return self._epoch

    @property
    def position(self) -> int:
        """Micro-steps of the current epoch already consumed."""
        return self._position

    @property
    def dropped(self) -> int:
        """Samples of the epoch's draw left out of it (see the tail rule in ``plan.py``'s docstring)."""
        used = sum(len(row) for step in self._plan for batch in step for row in batch)
        drawn = len(self._lengths) if self._epoch_rows is None else len(self._epoch_rows(self._epoch))
        return drawn - used

    def set_epoch(self, epoch: int) -> None:
        """Load ``epoch``'s plan (recomputed only when the epoch changes) and rewind to its start."""
        if epoch != self._epoch:
            self._plan = self._plan_of(epoch, strict=False)
            self._epoch = epoch
        self._position = 0

    def skip(self, n_micro_steps: int = 1) -> None:
        """Record that the trainer consumed ``n_micro_steps`` more micro-steps.

        Raises:
            ValueError: the position would leave ``0..len(self)``.
        """
        self._set_position(self._position + n_micro_steps)

    def __iter__(self) -> Iterator[MicroBatch]:
        """This rank's micro-batches from ``position`` to the end of the epoch."""
        return iter([step[self.rank] for step in self._plan[self._position :]])

    def __len__(self) -> int:
        """Micro-batches per rank in the whole current epoch (equal on every rank)."""
        return len(self._plan)

    def epoch_length(self, epoch: int) -> int:
        """Micro-batches per rank in ``epoch`` (token_budget and packed plans vary a little by epoch)."""
        return len(self._plan) if epoch == self._epoch else len(self._plan_of(epoch))

    def row_lengths(self) -> list[list[int]]:
        """The sample lengths of every row this rank trains on in the current epoch: one per row when padded,
        several in a packed row (what attention's cost depends on)."""
        return [[int(self._lengths[i]) for i in row] for step in self._plan for row in step[self.rank]]

    def state_dict(self) -> dict:
        """``{"epoch": int, "position": int, "world_size": int}``: enough to resume mid-epoch, on any number of
        processes that shares the plan's micro-batches per step (the position counts micro-steps of
        ``world_size`` micro-batches)."""
        return {"epoch": self._epoch, "position": self._position, "world_size": self.layout.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore epoch and position, so iterating yields exactly the rest of that epoch; a position saved by a
        run on another number of processes is taken at the same micro-batch of the plan (a step's end: the first
        of the next step).

        Raises:
            ValueError: the position lies outside the epoch.
        """
        self.set_epoch(int(state["epoch"]))
        position, saved_world = int(state["position"]), int(state["world_size"])
        if saved_world != self.layout.world_size:  # at the same micro-batch of the plan (left out at its end: past it)
            position = min(ceil_div(position * saved_world, self.layout.world_size), len(self._plan))
        self._set_position(position)

    def _set_position(self, position: int) -> None:
        if not 0 <= position <= len(self._plan):
            raise ValueError(
                f"position {position} is outside epoch {self._epoch}'s 0..{len(self._plan)} micro-steps. From a "
                "checkpoint: it was saved with another batch plan; resume with its data.* settings and number of "
                "processes, or set trainer.resume=none."
            )
        self._position = position
