"""The data side of a run: every ``data.*`` key is read here (and in ``sampler.py``).

``build_training_data`` is the one call the trainer makes: it loads, formats and tokenizes the
rows, plans this rank's micro-batches (``sampler.py``), and hands back the loader, the eval shard
and the data-order fingerprint that a resumed run must match.

Tokenization runs once per (file, tokenizer, settings) and is cached by ``datasets``;
local rank 0 does it while the other ranks wait, then they read the cache. The cached
dataset carries a ``length`` column so the sampler never re-tokenizes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from ddptrain import parallel, signals
from ddptrain.batch_cost import ceil_div, round_up
from ddptrain.config import Batching, DataConfig, RunConfig, Template
from ddptrain.metrics import RANK_ZERO_ONLY
from ddptrain.model import IGNORE_INDEX
from ddptrain.parallel import DistEnv
from ddptrain.sampler import BatchingSpec, DistributedBatchSampler
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


def load_rows(path: str, cache_dir: str | None, key: str = "data.path") -> datasets.Dataset:
    """Read a .json/.jsonl/.parquet file through ``datasets`` (cached as Arrow).

    Args:
        key: the config key that named the file (``data.path`` or ``data.eval_path``), for errors.

    Raises:
        ValueError: unknown extension, or a line that is not valid JSON (named by line number).
    """
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"{key}={path}: unsupported file type '{suffix}'; use .json, .jsonl or .parquet.")
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(FORMATS[suffix], data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as exc:  # datasets wraps parse errors several layers deep
        raise ValueError(f"{key}={_explain_load_error(path, exc)}") from exc


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
                    return (
                        f"{path}:{line_no}: each line must be a JSON object, got {type(row).__name__}. "
                        'Write one object per line, e.g. {"instruction": ..., "output": ...}.'
                    )
    return (
        f"{path}: could not be read as a dataset: {type(exc).__name__}: {exc}. It must be a .json list of "
        "objects, a .jsonl file with one object per line, or a .parquet table."
    )


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
    path: str, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_rows: int | None, key: str = "data.path"
) -> tuple[datasets.Dataset, dict[str, int]]:
    """Load and tokenize one file (cached). Returns the dataset and counts to report."""
    raw = load_rows(path, cfg.cache_dir, key)
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
        eval_set, eval_stats = tokenize_file(cfg.eval_path, cfg, tokenizer, None, "data.eval_path")
        stats.update({f"eval_{k}": v for k, v in eval_stats.items()})
    elif cfg.eval_fraction > 0:
        split = train.train_test_split(test_size=cfg.eval_fraction, seed=seed)
        train, eval_set = split["train"], split["test"]
    if len(train) == 0:
        raise ValueError(
            f"data.path={cfg.path}: no usable rows left after tokenization ({stats}). Check that data.template and "
            "the data.*_field keys match the file's fields, or raise data.max_length."
        )
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


# ----------------------------------------------------------------------------- the data side of a run


@dataclass
class TrainingData:
    """What the trainer gets from the data side: this rank's micro-batches and eval shard.

    ``sampler`` holds the data position (epoch, micro-steps consumed) that a checkpoint saves;
    ``fingerprint`` holds the settings that fix which samples each step sees, which a resumed run
    must share.
    """

    train: datasets.Dataset
    eval: datasets.Dataset | None
    sampler: DistributedBatchSampler
    loader: torch.utils.data.DataLoader
    fingerprint: DataOrder
    eval_collator: Collator
    eval_micro_batch_size: int
    env: DistEnv

    def optimizer_steps(self) -> Iterator[list[dict[str, Any]]]:
        """The rest of the epoch, ``grad_accum_steps`` micro-batches at a time (the last step may be short)."""
        step: list[dict[str, Any]] = []
        for batch in self.loader:
            step.append(batch)
            if len(step) == self.sampler.spec.grad_accum_steps:
                yield step
                step = []
        if step:
            yield step

    def steps_per_epochs(self, epochs: int) -> int:
        """Optimizer steps in the first ``epochs`` epochs (token_budget and packed plans vary by epoch)."""
        accum = self.sampler.spec.grad_accum_steps
        return sum(ceil_div(self.sampler.epoch_length(epoch), accum) for epoch in range(epochs))

    def eval_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's shard of the eval split (every row on exactly one rank), collated on the CPU."""
        assert self.eval is not None
        lengths = self.eval["length"]
        # Sorted by length: neighbours share a padded width, and every rank gets a similar mix.
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        shard = order[self.env.rank :: self.env.world_size]
        rows = RowsDataset(self.eval)
        size = self.eval_micro_batch_size
        for start in range(0, len(shard), size):
            yield self.eval_collator([rows[(i,)] for i in shard[start : start + size]])


def build_training_data(
    run_cfg: RunConfig,
    tokenizer: PreTrainedTokenizerBase,
    env: DistEnv,
    *,
    seed: int,
    grad_accum_steps: int,
    flash_varlen: bool,
) -> TrainingData:
    """Tokenize (local rank 0 first, the others read its cache), plan the batches, build the loader.

    Args:
        run_cfg: the run config; only its ``data`` group is read here (the values other groups
            decide arrive as the arguments below), so a reader finds every ``data.*`` key on this side.
        tokenizer: the model's tokenizer.
        env: this rank's place in the process group.
        seed: ``trainer.seed`` (the shuffle, the eval split and the loader's workers).
        grad_accum_steps: ``optim.grad_accum_steps`` (micro-batches per optimizer step).
        flash_varlen: the model runs flash-attention's varlen kernel
            (``model.attn_implementation=flash_attention_2``): packed rows carry their sample lengths.

    Raises:
        ValueError: unreadable data, or too little of it for one micro-step (naming the key).
    """
    cfg = run_cfg.data
    with parallel.local_rank_zero_first(env, cfg.prepare_timeout_s, "tokenizing the dataset"):
        data = build_datasets(cfg, tokenizer, seed)
    spec = build_batching_spec(cfg, env.world_size, grad_accum_steps, seed)
    sampler = DistributedBatchSampler(data.train["length"], spec, env.rank)
    parallel.check_same_on_all_ranks(
        len(sampler), "micro-batches per epoch", "Every rank must build the same batch plan; this is a bug."
    )
    log.info(
        "batches: %d micro-batches per rank per epoch (data.batching=%s), %d per optimizer step",
        len(sampler),
        cfg.batching.value,
        grad_accum_steps,
    )
    collator = build_collator(cfg, tokenizer.pad_token_id, flash_varlen)
    loader = torch.utils.data.DataLoader(
        RowsDataset(data.train),
        batch_sampler=sampler,
        collate_fn=collator,
        num_workers=cfg.num_workers,
        pin_memory=env.device.type == "cuda",
        persistent_workers=False,
        # Its own generator: otherwise every new iterator draws its base seed from the global RNG,
        # and a run resumed mid-epoch would draw at another point than the uninterrupted run did,
        # shifting every dropout mask after it.
        generator=torch.Generator().manual_seed(seed),
        # A terminal's Ctrl-C or a scheduler's SIGTERM reaches every process of the job: the
        # loader's workers leave the stop to the training process, which shuts them down.
        worker_init_fn=signals.ignore_stop_signals,
    )
    fingerprint = DataOrder(
        {
            "world_size": env.world_size,
            "seed": seed,
            "grad_accum_steps": grad_accum_steps,
            "path": cfg.path,
            "max_rows": cfg.max_rows,
            "eval_fraction": cfg.eval_fraction,
            "max_length": cfg.max_length,
            "batching": cfg.batching.value,
            "micro_batch_size": cfg.micro_batch_size,
            "max_tokens_per_batch": cfg.max_tokens_per_batch,
            "pad_to_multiple_of": cfg.pad_to_multiple_of,
            "dataset_rows": len(data.train),
        }
    )
    eval_collator = Collator(tokenizer.pad_token_id, cfg.pad_to_multiple_of)
    return TrainingData(data.train, data.eval, sampler, loader, fingerprint, eval_collator, cfg.micro_batch_size, env)


@dataclass(frozen=True)
class DataOrder:
    """The settings that fix which samples each step sees: a resumed run must share every one.

    ``values`` go into each checkpoint's manifest (``data_order``) under these short names.
    """

    values: dict[str, Any]

    # How the user sets each value; the others are data.<name>.
    SET_BY: ClassVar[dict[str, str]] = {
        "world_size": "number of processes",
        "seed": "trainer.seed",
        "grad_accum_steps": "optim.grad_accum_steps",
        "dataset_rows": "rows left after tokenizing data.path",
    }

    def changes_from(self, saved: dict[str, Any]) -> list[str]:
        """``"<key as the user sets it>: <saved> -> <now>"`` for every value that differs from ``saved``."""
        return [
            f"{self.SET_BY.get(name, f'data.{name}')}: {saved.get(name)} -> {value}"
            for name, value in sorted(self.values.items())
            if saved.get(name) != value
        ]


def build_batching_spec(cfg: DataConfig, world_size: int, grad_accum_steps: int, seed: int) -> BatchingSpec:
    """The sampler's spec from the ``data`` group, with the values other groups own passed in."""
    return BatchingSpec(
        mode=cfg.batching,
        world_size=world_size,
        micro_batch_size=cfg.micro_batch_size,
        max_tokens_per_batch=cfg.max_tokens_per_batch,
        grad_accum_steps=grad_accum_steps,
        pad_to_multiple_of=cfg.pad_to_multiple_of,
        seed=seed,
        costliest_first=cfg.costliest_first,
    )


def build_collator(cfg: DataConfig, pad_id: int, flash_varlen: bool = False) -> Collator:
    """The training collator: padded rows, or one packed row (with flash-attention's lengths if asked)."""
    return Collator(pad_id, cfg.pad_to_multiple_of, packed=cfg.batching == Batching.packed, flash_varlen=flash_varlen)
