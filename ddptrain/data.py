"""Loading, formatting and tokenizing rows; the collator that turns micro-batches into tensors.

Tokenization runs once per (file, tokenizer, settings) and is cached by ``datasets``;
local rank 0 does it while the other ranks wait, then they read the cache. The cached
dataset carries a ``length`` column so the sampler never re-tokenizes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from ddptrain.config import DataConfig, Template
from ddptrain.metrics import RANK_ZERO_ONLY
from ddptrain.model import IGNORE_INDEX
from ddptrain.templates import RowError, format_alpaca, format_chat

log = logging.getLogger(__name__)

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
CACHE_VERSION = "1"  # bump when encoding changes, so old caches are not reused


@dataclass
class TokenizedData:
    """Tokenized train (and eval) sets with columns input_ids, labels, length."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    stats: dict[str, int]


# ----------------------------------------------------------------------------- loading


def load_rows(path: str, cache_dir: str | None) -> datasets.Dataset:
    """Read a .json/.jsonl/.parquet file through ``datasets`` (cached as Arrow).

    Raises:
        ValueError: unknown extension, or a line that is not valid JSON (named by line number).
    """
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"data.path={path}: unsupported file type '{suffix}'; use .json, .jsonl or .parquet.")
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(FORMATS[suffix], data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as exc:  # datasets wraps parse errors several layers deep
        raise ValueError(_explain_load_error(path, exc)) from exc


def _explain_load_error(path: str, exc: Exception) -> str:
    if Path(path).suffix.lower() == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    return f"{path}:{line_no}: not valid JSON ({err.msg}). Fix or remove that line."
                if not isinstance(row, dict):
                    return f"{path}:{line_no}: each line must be a JSON object, got {type(row).__name__}."
    return f"{path}: could not be read as a dataset: {type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------- encoding


class RowEncoder:
    """Turns raw rows into input_ids / labels, masking the prompt out of the loss."""

    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id

    def turns(self, row: dict[str, Any]) -> list[tuple[str, str]]:
        if self.cfg.template == Template.chat:
            return format_chat(row, self.cfg.messages_field)
        return [format_alpaca(row, self.cfg.instruction_field, self.cfg.input_field, self.cfg.output_field)]

    def encode_turns(self, turns_per_row: list[list[tuple[str, str]]]) -> list[tuple[list[int], list[int], bool]]:
        """(input_ids, labels, truncated) per row; EOS appended after the last response."""
        flat = [turn for turns in turns_per_row for turn in turns]
        if not flat:  # every row of this batch was malformed and skipped
            return []
        # One tokenizer call per batch for prompts and one for responses: ~10x faster than per row.
        prompts = self.tokenizer([p for p, _ in flat], add_special_tokens=False).input_ids
        responses = self.tokenizer([r for _, r in flat], add_special_tokens=False).input_ids
        encoded = []
        k = 0
        for turns in turns_per_row:
            input_ids: list[int] = []
            labels: list[int] = []
            for prompt_ids, response_ids in zip(prompts[k : k + len(turns)], responses[k : k + len(turns)]):
                input_ids += prompt_ids + response_ids
                labels += [IGNORE_INDEX] * len(prompt_ids) + response_ids
            k += len(turns)
            input_ids.append(self.eos_id)
            labels.append(self.eos_id)
            truncated = len(input_ids) > self.cfg.max_length
            encoded.append((input_ids[: self.cfg.max_length], labels[: self.cfg.max_length], truncated))
        return encoded

    def __call__(self, batch: dict[str, list], indices: list[int], source: str) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        turns_per_row: list[list[tuple[str, str]] | None] = []
        for index, row in zip(indices, rows):
            try:
                turns_per_row.append(self.turns(row))
            except RowError as err:
                if not self.cfg.skip_bad_rows:
                    raise ValueError(
                        f"{_locate(source, index)}: {err}. Fix the row, set the data.*_field keys to "
                        "your field names, or set data.skip_bad_rows=true to skip such rows."
                    ) from None
                turns_per_row.append(None)
        encoded = iter(self.encode_turns([t for t in turns_per_row if t is not None]))
        out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "length", "truncated", "bad", "no_target")}
        for turns in turns_per_row:
            input_ids, labels, truncated = next(encoded) if turns is not None else ([], [], False)
            out["input_ids"].append(input_ids)
            out["labels"].append(labels)
            out["length"].append(len(input_ids))
            out["truncated"].append(truncated)
            out["bad"].append(turns is None)
            out["no_target"].append(turns is not None and _no_target(labels))
        return out


def _locate(source: str, index: int) -> str:
    """``path:line`` of row ``index`` in a .jsonl file (blank lines are not rows), else ``path, row N``."""
    if Path(source).suffix.lower() == ".jsonl":
        with open(source, encoding="utf-8") as f:
            rows_seen = -1
            for line_no, line in enumerate(f, start=1):
                rows_seen += bool(line.strip())
                if rows_seen == index:
                    return f"{source}:{line_no}"
    return f"{source}, row {index + 1}"


def _fingerprint(raw: datasets.Dataset, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """Cache key: the file's contents, the tokenizer's vocabulary and every encoding setting."""
    tok = getattr(tokenizer, "backend_tokenizer", None)
    vocab_id = tok.to_str() if tok is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    settings = [
        CACHE_VERSION,
        raw._fingerprint,
        vocab_id,
        str(tokenizer.eos_token_id),
        cfg.template.value,
        cfg.instruction_field,
        cfg.input_field,
        cfg.output_field,
        cfg.messages_field,
        str(cfg.max_length),
        str(cfg.skip_bad_rows),
    ]
    return hashlib.sha256("\x00".join(settings).encode()).hexdigest()[:32]


def tokenize_file(
    path: str, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_rows: int | None
) -> tuple[datasets.Dataset, dict[str, int]]:
    """Load and tokenize one file (cached). Returns the dataset and counts to report."""
    raw = load_rows(path, cfg.cache_dir)
    if max_rows is not None and max_rows < len(raw):
        raw = raw.select(range(max_rows))
    encoder = RowEncoder(cfg, tokenizer)
    encoded = raw.map(
        encoder,
        batched=True,
        with_indices=True,
        fn_kwargs={"source": path},
        remove_columns=raw.column_names,
        new_fingerprint=_fingerprint(raw, cfg, tokenizer),
        desc=f"tokenizing {Path(path).name}",
    )
    stats = {
        "rows": len(raw),
        "truncated": int(sum(encoded["truncated"])),
        "skipped_bad": int(sum(encoded["bad"])),
        "no_target": int(sum(encoded["no_target"])),
    }
    if stats["skipped_bad"] or stats["no_target"]:
        drop = [bad or empty for bad, empty in zip(encoded["bad"], encoded["no_target"])]
        encoded = encoded.select([i for i, dropped in enumerate(drop) if not dropped])
    return encoded.remove_columns(["truncated", "bad", "no_target"]), stats


def _no_target(labels: Sequence[int]) -> bool:
    # Position 0 is never predicted, so a row needs a target after it.
    return all(label == IGNORE_INDEX for label in labels[1:])


def build_datasets(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> TokenizedData:
    """Tokenized train and eval sets, with counts of truncated / skipped rows logged.

    Raises:
        ValueError: unreadable file or malformed row (naming file and line), or an empty result.
    """
    train, stats = tokenize_file(cfg.path, cfg, tokenizer, cfg.max_rows)
    eval_set = None
    if cfg.eval_path is not None:
        eval_set, eval_stats = tokenize_file(cfg.eval_path, cfg, tokenizer, None)
        stats.update({f"eval_{k}": v for k, v in eval_stats.items()})
    elif cfg.eval_fraction > 0:
        split = train.train_test_split(test_size=cfg.eval_fraction, seed=seed)
        train, eval_set = split["train"], split["test"]
    if len(train) == 0:
        raise ValueError(f"data.path={cfg.path}: no usable rows left after tokenization ({stats}).")
    _report(cfg, stats, len(train), eval_set)
    return TokenizedData(train, eval_set, stats)


def _report(cfg: DataConfig, stats: dict[str, int], n_train: int, eval_set: datasets.Dataset | None) -> None:
    log.info("data: %d training rows, %d eval rows from %s", n_train, len(eval_set or []), cfg.path)
    if stats["truncated"]:
        log.warning(
            "data: %d of %d rows were longer than data.max_length=%d and were truncated",
            stats["truncated"],
            stats["rows"],
            cfg.max_length,
            extra=RANK_ZERO_ONLY,
        )
    if stats["skipped_bad"]:
        log.warning(
            "data: skipped %d malformed rows (data.skip_bad_rows=true)", stats["skipped_bad"], extra=RANK_ZERO_ONLY
        )
    if stats["no_target"]:
        log.warning(
            "data: dropped %d rows whose prompt fills data.max_length=%d (nothing left to train on)",
            stats["no_target"],
            cfg.max_length,
            extra=RANK_ZERO_ONLY,
        )


# ----------------------------------------------------------------------------- collate


def batch_token_counts(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(real, padded)`` tokens of a collated micro-batch, counted on its tensors.

    Padded rows carry an attention mask (1 = real token); a packed row has none and no padding.
    """
    padded = batch["input_ids"].numel()
    mask = batch.get("attention_mask")
    return (int(mask.sum()) if mask is not None else padded), padded


class RowsDataset(torch.utils.data.Dataset):
    """Indexable by a row: a tuple of sample indices (several when packed)."""

    def __init__(self, data: datasets.Dataset):
        self.data = data.with_format(None, columns=["input_ids", "labels"])

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
        longest = max(len(s["input_ids"]) for s in samples)
        width = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
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
