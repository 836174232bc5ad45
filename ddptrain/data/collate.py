"""Collating: a micro-batch's rows become tensors, padded to a common width or packed into one row.

``RowsDataset`` hands the loader a row's samples, ``Collator`` turns them into the batch the model takes,
and ``batch_token_counts`` counts a batch's real and padded tokens on its tensors. Padding uses the same
``round_up`` as the sampler's cost rule (``batch_cost.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ddptrain.config import Batching, DataConfig
from ddptrain.data.batch_cost import round_up
from ddptrain.data.encode import IGNORE_INDEX

if TYPE_CHECKING:
    import datasets


def batch_token_counts(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(real, padded)`` tokens of a collated micro-batch, counted on its tensors.

    Padded rows carry an attention mask (1 = real token); a packed row has none and no padding.
    """
    padded = batch["input_ids"].numel()
    mask = batch.get("attention_mask")
    return (int(mask.sum()) if mask is not None else padded), padded


# A preference pair's reference log-probabilities, chosen then rejected (objective.reference=precomputed).
REFERENCE_COLUMN = "reference_logps"
PAIR_COLUMNS = ("rejected_input_ids", "rejected_labels", REFERENCE_COLUMN)


class RowsDataset(torch.utils.data.Dataset):
    """Indexable by a row: a tuple of sample indices (several when packed)."""

    def __init__(self, data: datasets.Dataset):
        self.read(data)

    def read(self, data: datasets.Dataset) -> None:
        """Read rows from ``data`` from now on (the same rows with a column added: the loader's workers, which
        start with each epoch, see it)."""
        pairs = [column for column in PAIR_COLUMNS if column in data.column_names]
        self.data = data.with_format(None, columns=["input_ids", "labels", *pairs])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, row: tuple[int, ...]) -> list[dict[str, list[int]]]:
        return [self.data[int(i)] for i in row]


@dataclass
class Collator:
    """Pads rows to a common length, or concatenates a packed row with restarting position_ids.

    Packed rows get no attention mask: transformers then separates the samples by their
    position_ids, so attention never crosses a sample boundary. With ``flash_varlen`` a packed
    row also carries the cumulative sample lengths and the longest sample, which
    flash-attention's varlen kernel takes; otherwise transformers derives them from the
    position ids in every layer, each time waiting on the GPU.

    Every batch carries ``target_index``: the flat positions (row × width + column) whose next
    token is a target, found here on the CPU so that the loss never waits on the GPU for them.
    """

    pad_id: int
    pad_to_multiple_of: int = 8
    packed: bool = False
    flash_varlen: bool = False

    def __call__(self, rows: list[list[dict[str, list[int]]]]) -> dict[str, Any]:
        batch = self._pack(rows) if self.packed else self._pad(rows)
        next_is_target = batch["labels"][:, 1:] != IGNORE_INDEX
        row, column = next_is_target.nonzero(as_tuple=True)
        batch["target_index"] = row * batch["labels"].shape[1] + column
        return batch

    def _pad(self, rows: list[list[dict[str, list[int]]]]) -> dict[str, torch.Tensor]:
        samples = [row[0] for row in rows]
        if "rejected_input_ids" in samples[0]:  # preference pairs: the chosen sequences, then the rejected ones
            chosen = [[{"input_ids": s["input_ids"], "labels": s["labels"]}] for s in samples]
            rejected = [[{"input_ids": s["rejected_input_ids"], "labels": s["rejected_labels"]}] for s in samples]
            batch = {**self._pad(chosen + rejected), "pairs": torch.tensor(len(samples))}
            if REFERENCE_COLUMN in samples[0]:  # the same order as the rows: chosen, then rejected
                logps = [s[REFERENCE_COLUMN][0] for s in samples] + [s[REFERENCE_COLUMN][1] for s in samples]
                batch[REFERENCE_COLUMN] = torch.tensor(logps, dtype=torch.float32)  # computed in fp32: exact
            return batch
        longest = max(len(s["input_ids"]) for s in samples)
        width = round_up(longest, self.pad_to_multiple_of)
        input_ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            input_ids[i, :n] = torch.tensor(s["input_ids"])
            labels[i, :n] = torch.tensor(s["labels"])
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}

    def _pack(self, rows: list[list[dict[str, list[int]]]]) -> dict[str, Any]:
        assert len(rows) == 1, "a packed micro-batch is one row"
        input_ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for s in rows[0]:
            input_ids += s["input_ids"]
            # The first token of a sample must not be predicted from the previous sample.
            labels += [IGNORE_INDEX, *s["labels"][1:]]
            positions += range(len(s["input_ids"]))
        batch: dict[str, Any] = {
            "input_ids": torch.tensor([input_ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]),
        }
        if self.flash_varlen:
            lengths = [len(s["input_ids"]) for s in rows[0]]
            starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            longest = max(lengths)
            batch.update(cu_seq_lens_q=starts, cu_seq_lens_k=starts, max_length_q=longest, max_length_k=longest)
        return batch


def loss_units(batch: dict[str, Any]) -> int:
    """What a micro-batch's loss is a sum over, counted on its CPU tensors: its preference pairs, or its target
    tokens. The step divides the summed loss by their total over the global batch."""
    return int(batch["pairs"]) if "pairs" in batch else batch["target_index"].numel()


def build_collator(cfg: DataConfig, pad_id: int, flash_varlen: bool = False) -> Collator:
    """The training collator: padded rows, or one packed row (with flash-attention's lengths if asked)."""
    return Collator(pad_id, cfg.pad_to_multiple_of, packed=cfg.batching == Batching.packed, flash_varlen=flash_varlen)
