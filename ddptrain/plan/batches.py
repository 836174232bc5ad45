"""The micro-batches that cost the most memory: found in the run's own batch plans, not assumed.

The training set's plans come from ``data.plan.plan_epoch``, the function every rank's sampler calls, for each epoch
the run trains (up to ``plan.max_epochs``); the eval set is cut as ``TrainingData.eval_batches`` cuts it. What a
micro-batch costs in memory grows with its padded tokens (every layer's activations) and with its width (a padding
or packing mask is rows x width x width), so both the micro-batch with the most padded tokens and the widest one
are candidates; the simulation decides between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddptrain.config import Batching
from ddptrain.data.encode import IGNORE_INDEX
from ddptrain.data.plan import BatchingSpec, MicroBatch, eval_batch_plan, plan_epoch
from ddptrain.data.tokenized import TokenizedData
from ddptrain.plan.simulate import BatchShape


@dataclass(frozen=True)
class Candidate:
    """One micro-batch of a plan and the shape the model sees."""

    rank: int
    where: str  # "epoch 0, micro-step 12" or "eval"
    samples: tuple[int, ...]  # dataset indices, in row order
    shape: BatchShape


def training_candidates(
    data: TokenizedData, spec: BatchingSpec, epochs: int, max_length: int | None = None
) -> list[Candidate]:
    """Each rank's costliest micro-batch (most padded tokens, then widest) over ``epochs`` epochs of the plan, and
    the widest micro-batch of all (most width, then padded tokens) where it is another one. ``max_length``: plan
    the rows as if cut to that length (a shorter ``data.max_length``)."""
    lengths = np.asarray(data.train["length"], dtype=np.int64)
    if max_length is not None:
        lengths = np.minimum(lengths, max_length)
    best: dict[object, tuple[tuple[int, int], int, str, MicroBatch]] = {}
    for epoch in range(epochs):
        rows = None if data.epoch_rows is None else np.asarray(data.epoch_rows(epoch), dtype=np.int64)
        plan = plan_epoch(lengths if rows is None else lengths[rows], spec, epoch)
        for step, micro_batches in enumerate(plan):
            for rank, batch in enumerate(micro_batches):
                if rows is not None:
                    batch = [tuple(int(rows[i]) for i in row) for row in batch]
                padded = spec.cost([int(lengths[i]) for row in batch for i in row])
                width = _width(batch, lengths, spec)
                entry = (rank, f"epoch {epoch}, micro-step {step}", batch)
                for kind, key in ((rank, (padded, width)), ("widest", (width, padded))):
                    if kind not in best or key > best[kind][0]:
                        best[kind] = (key, *entry)
    chosen = {(rank, where): batch for _, rank, where, batch in best.values()}
    return [
        _candidate(rank, where, b, data.train, lengths, spec, max_length) for (rank, where), b in sorted(chosen.items())
    ]


def eval_candidate(data: TokenizedData, micro_batch_size: int, world_size: int, spec: BatchingSpec) -> Candidate | None:
    """The eval micro-batch with the most padded tokens, cut as ``TrainingData.eval_batches`` cuts the eval set."""
    if data.eval is None or len(data.eval) == 0:
        return None
    lengths = np.asarray(data.eval["length"], dtype=np.int64)
    padded_spec = BatchingSpec(Batching.random, 1, 1, 1, pad_to_multiple_of=spec.pad_to_multiple_of)
    best = None
    for rank, batches in enumerate(eval_batch_plan(data.eval["length"], micro_batch_size, world_size)):
        for rows in batches:
            batch = [(i,) for i in rows]
            cost = padded_spec.cost([int(lengths[i]) for i in rows])
            if best is None or cost > best[0]:
                best = (cost, rank, batch)
    _, rank, batch = best
    return _candidate(rank, "eval", batch, data.eval, lengths, padded_spec)


def _width(batch: MicroBatch, lengths: np.ndarray, spec: BatchingSpec) -> int:
    """The collated width: a packed row's tokens, else the longest row rounded up to the padding multiple."""
    if spec.mode is Batching.packed:
        return sum(int(lengths[i]) for i in batch[0])
    return spec.cost([max(int(lengths[i]) for row in batch for i in row)])


def _candidate(
    rank: int,
    where: str,
    batch: MicroBatch,
    rows,
    lengths: np.ndarray,
    spec: BatchingSpec,
    max_length: int | None = None,
) -> Candidate:
    samples = tuple(i for row in batch for i in row)
    labels = rows.select(samples)["labels"]
    targets = sum(_targets(sample_labels[:max_length]) for sample_labels in labels)
    sizes = [int(lengths[i]) for i in samples]
    width = _width(batch, lengths, spec)
    packed = spec.mode is Batching.packed
    shape = BatchShape(
        rows=len(batch),
        width=width,
        targets=targets,
        padded=not packed and any(size < width for size in sizes),
        packed=packed and len(samples) > 1,
    )
    return Candidate(rank, where, samples, shape)


def _targets(labels: Sequence[int]) -> int:
    """Positions of a sample whose next label is trained on (the collator's ``target_index``)."""
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)
