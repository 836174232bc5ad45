"""The micro-batches that cost the most memory: found in the run's own batch plans, not assumed.

The training set's plans come from ``data.plan.plan_epoch``, the function every rank's sampler calls, for each epoch
the run trains (up to ``plan.max_epochs``); the eval set is cut as ``TrainingData.eval_batches`` cuts it. What a
micro-batch costs in memory grows with its padded tokens (every layer's activations) and with its width (a padding
or packing mask is rows x width x width), so both the micro-batch with the most padded tokens and the widest one
are candidates; the simulation decides between them. For the largest sizes that fit, ``worst_case_shape`` and
``CostliestRows`` give the costliest micro-batch of a size: any data's, and this data's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ddptrain.config import Batching, DataConfig
from ddptrain.data.encode import IGNORE_INDEX
from ddptrain.data.plan import BatchingSpec, MicroBatch, eval_batch_plan, plan_epoch
from ddptrain.data.tokenized import TokenizedData
from ddptrain.plan.simulate import BatchShape

PAIRED_LABELS = "rejected_labels"  # preference pairs (objective=dpo): a row holds two sequences


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


def worst_case_shape(d: DataConfig, pairs: bool = False) -> Callable[[int], BatchShape]:
    """The costliest micro-batch any data could give at ``n`` (``data.micro_batch_size``, or
    ``data.max_tokens_per_batch`` for token_budget and packed): every row at data.max_length, every position
    trained (a packed row of ``n`` tokens). ``pairs`` (preference pairs, their rows ``PAIRED_LABELS``): both
    sequences of every pair at data.max_length."""
    packed = d.batching == Batching.packed
    per_row = 2 if pairs else 1  # a pair is two sequences

    def shape(n: int) -> BatchShape:
        rows, width = (1, n) if packed else (n, d.max_length)
        if d.batching == Batching.token_budget:
            rows = max(n // (per_row * d.max_length), 1)
        pairs = rows if per_row == 2 else 0
        rows *= per_row
        return BatchShape(rows, width, rows * width, padded=not packed, packed=packed, pairs=pairs)

    return shape


class CostliestRows:
    """The costliest micro-batch this data can give at ``n``, whatever rows the sampler draws: rows as wide as its
    longest (padded, with the mask padding brings, where any row is shorter), training as many positions as its
    most-trained rows. ``n`` rows (random, length_grouped); as many such rows as ``n`` padded tokens hold
    (token_budget); packed, one row of up to ``n`` tokens filled with its most-trained rows, each one that still fits
    added (the packer fills a row the same way). ``most``: the training rows there are, the most rows one
    micro-batch can have; ``whole``: the least ``n`` whose micro-batch is all of them (rows; padded tokens; tokens
    packed), beyond which it stops growing."""

    def __init__(self, data: TokenizedData, spec: BatchingSpec):
        lengths = np.asarray(data.train["length"], dtype=np.int64)
        trained = trained_per_row(data.train)
        order = np.argsort(-trained, kind="stable")  # the most-trained rows first
        self.trained, self.lengths = trained[order], lengths[order]
        self.most_trained = np.cumsum(self.trained)
        self.longest, self.shortest = int(lengths.max()), int(lengths.min())
        self.spec, self.most = spec, len(lengths)
        self.pairs = PAIRED_LABELS in data.train.column_names
        if spec.mode is Batching.packed:
            self.whole = int(lengths.sum())
        elif spec.mode is Batching.token_budget:
            self.whole = self.most * spec.cost([self.longest])
        else:
            self.whole = self.most

    def __call__(self, n: int) -> BatchShape:
        if self.spec.mode is Batching.packed:
            room, width, targets, samples = n, 0, 0, 0
            for length, trained in zip(self.lengths.tolist(), self.trained.tolist()):
                if length <= room:
                    room, width, targets, samples = room - length, width + length, targets + trained, samples + 1
                if room < self.shortest:
                    break
            return BatchShape(1, width, targets, padded=False, packed=samples > 1)
        width = self.spec.cost([self.longest])
        rows = min(n, self.most) if self.spec.mode is not Batching.token_budget else max(min(n // width, self.most), 1)
        targets = int(self.most_trained[rows - 1])
        if self.pairs:  # each pair's two sequences, padded to half its length (padding assumed: the costlier)
            return BatchShape(2 * rows, width // 2, targets, padded=True, pairs=rows)
        return BatchShape(rows, width, targets, padded=self.shortest < width)


def trained_per_row(rows) -> np.ndarray:
    """Each row's trained positions (``_targets``: its labels after the first that are not ``IGNORE_INDEX``; a
    preference pair's, both sequences'), counted in arrow, not in Python lists: 0.6 s for Alpaca's 51,481 rows where
    the lists take several."""
    trained = _trained_in(rows, "labels")
    return trained + _trained_in(rows, PAIRED_LABELS) if PAIRED_LABELS in rows.column_names else trained


def _trained_in(rows, column: str) -> np.ndarray:
    labels = rows.with_format("arrow")[column]
    if isinstance(labels, pa.ChunkedArray):
        labels = labels.combine_chunks()
    trained = pc.not_equal(pc.list_flatten(labels), IGNORE_INDEX)
    parents = np.asarray(pc.list_parent_indices(labels))
    per_row = np.bincount(parents[np.asarray(trained)], minlength=len(labels))
    first_trained = np.asarray(pc.not_equal(pc.list_element(labels, 0), IGNORE_INDEX), dtype=np.int64)
    return per_row - first_trained


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
    selected = rows.select(samples)
    targets = sum(_targets(sample_labels[:max_length]) for sample_labels in selected["labels"])
    sizes = [int(lengths[i]) for i in samples]
    width = _width(batch, lengths, spec)
    if PAIRED_LABELS in rows.column_names:  # the collator's rows: every chosen sequence, then every rejected one
        targets += sum(_targets(sample_labels) for sample_labels in selected[PAIRED_LABELS])
        sequences = [len(ids) for column in ("input_ids", "rejected_input_ids") for ids in selected[column]]
        shape = BatchShape(
            2 * len(samples), width // 2, targets, padded=min(sequences) < width // 2, pairs=len(samples)
        )
        return Candidate(rank, where, samples, shape)
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
