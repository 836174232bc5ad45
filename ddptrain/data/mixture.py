"""The run's training and eval sets: one source with its eval share held out, or ``data.sources`` mixed.

``build_datasets`` is the stage after encoding: each source is tokenized (``tokenized.py``), its eval rows
held out, and what was read is logged. With weights, each epoch draws its own mixture
(``mixture_indices``), fixed by ``(seed, epoch)``, so every rank draws the same rows without communicating.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import TYPE_CHECKING

import datasets
import numpy as np

from ddptrain.config import DataConfig, SourceConfig
from ddptrain.data.encode import RANK_ZERO_ONLY, log_chat_format
from ddptrain.data.tokenized import TokenizedData, tokenize_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__package__)  # "ddptrain.data": the data side's modules log under one name, as before the split


def build_datasets(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> TokenizedData:
    """Tokenized train and eval sets, with counts of truncated / skipped rows logged.

    Raises:
        ValueError: unreadable file or malformed row (naming file and line), or an empty result.
    """
    if cfg.sources:
        return build_mixture(cfg, tokenizer, seed)
    log_chat_format(cfg, tokenizer)
    train, stats = tokenize_file(cfg.path, cfg, tokenizer, cfg.max_rows)
    eval_set = None
    if cfg.eval_path is not None or cfg.eval_split is not None:
        eval_set, stats = _read_eval_set(cfg, tokenizer, stats)
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


def _read_eval_set(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, stats: dict[str, int]
) -> tuple[datasets.Dataset, dict[str, int]]:
    """The eval set read on its own: data.eval_path (its data.eval_split, else data.split), or data.path's
    data.eval_split; its counts join ``stats`` as eval_*."""
    path, key = (cfg.eval_path, "data.eval_path") if cfg.eval_path is not None else (cfg.path, "data.path")
    split, split_key = (cfg.eval_split, "data.eval_split") if cfg.eval_split is not None else (cfg.split, "data.split")
    eval_set, eval_stats = tokenize_file(path, cfg, tokenizer, None, key, split, split_key)
    return eval_set, {**stats, **{f"eval_{k}": v for k, v in eval_stats.items()}}


def _report(cfg: DataConfig, stats: dict[str, int], n_train: int, eval_set: datasets.Dataset | None) -> None:
    origin = cfg.path if not cfg.sources else f"{len(cfg.sources)} sources (data.sources)"
    log.info("data: %d training rows, %d eval rows from %s", n_train, len(eval_set or []), origin)
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
            "data: dropped %d rows with nothing to train on: a prompt that fills data.max_length=%d, or only empty "
            "replies",
            stats["no_target"],
            cfg.max_length,
            extra=RANK_ZERO_ONLY,
        )


def build_mixture(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> TokenizedData:
    """``data.sources``: each source read and tokenized with its own settings and its eval share held out on
    its own; the training set holds every source's rows (with a ``source`` column), and with weights each
    epoch draws its mixture from them anew (``mixture_indices``).

    Raises:
        ValueError: a source that cannot be read, or that has no usable row (naming data.sources[k]).
    """
    trains, evals, stats = [], [], {}
    for k, source in enumerate(cfg.sources):
        source_cfg = source_data_config(cfg, source)
        log_chat_format(source_cfg, tokenizer)
        key = f"data.sources[{k}].path"
        data, source_stats = tokenize_file(source_cfg.path, source_cfg, tokenizer, source_cfg.max_rows, key)
        if len(data) == 0:
            raise ValueError(
                f"{key}={source.path}: no usable rows left after tokenization ({source_stats}). Check its template "
                f"and field names (data.sources[{k}].template, data.sources[{k}].*_field), or raise data.max_length."
            )
        if cfg.eval_path is None and source_cfg.eval_split is not None:
            held_out, held_stats = tokenize_file(
                source_cfg.path,
                source_cfg,
                tokenizer,
                None,
                key,
                source_cfg.eval_split,
                f"data.sources[{k}].eval_split",
            )
            evals.append(held_out.add_column("source", [k] * len(held_out)))
            source_stats = {**source_stats, **{f"eval_{name}": n for name, n in held_stats.items()}}
        elif cfg.eval_path is None and source_cfg.eval_fraction > 0:
            split = data.train_test_split(test_size=source_cfg.eval_fraction, seed=seed)
            data, held_out = split["train"], split["test"]
            evals.append(held_out.add_column("source", [k] * len(held_out)))
        trains.append(data.add_column("source", [k] * len(data)))
        stats = {name: stats.get(name, 0) + source_stats.get(name, 0) for name in {**stats, **source_stats}}
    train = datasets.concatenate_datasets(trains)
    sizes, weights = [len(t) for t in trains], [s.weight for s in cfg.sources]
    epoch_rows = None if all(w is None for w in weights) else partial(mixture_rows, sizes, weights, seed)
    eval_set = datasets.concatenate_datasets(evals) if evals else None
    if cfg.eval_path is not None:
        eval_set, stats = _read_eval_set(cfg, tokenizer, stats)
    drawn = [len(p) for p in mixture_indices(sizes, weights, seed, epoch=0)]
    for k, source in enumerate(cfg.sources):
        log.info(
            "data: source %d (%s): %d of its %d training rows per epoch (weight %s)",
            k,
            source.path,
            drawn[k],
            sizes[k],
            source.weight,
            extra=RANK_ZERO_ONLY,
        )
    _report(cfg, stats, len(train), eval_set)
    return TokenizedData(train, eval_set, stats, epoch_rows)


def source_data_config(cfg: DataConfig, source: SourceConfig) -> DataConfig:
    """The data settings one source is read with: its own keys, and data.<key> for those it leaves null."""
    own = {name: value for name, value in vars(source).items() if value is not None and name != "weight"}
    return dataclasses.replace(cfg, **{"max_rows": None, **own, "sources": []})


def mixture_indices(sizes: list[int], weights: list[float | None], seed: int, epoch: int = 0) -> list[np.ndarray]:
    """Which rows of each source an epoch's mixture holds, fixed by ``(seed, epoch)``.

    Without weights every row of every source, once. With weights the mixture keeps the sources' total
    row count and gives source k the share weight_k / sum(weights) of it (largest remainders): a source
    with fewer rows than its share is repeated whole and topped up with a random part of itself, one
    with more is subsampled, with another part every epoch.
    """
    if all(w is None for w in weights):
        return [np.arange(n) for n in sizes]
    total = sum(sizes)
    exact = np.array(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]] += 1
    picks = []
    for k, (n, count) in enumerate(zip(sizes, counts.tolist())):
        rng = np.random.default_rng([seed, epoch, k])
        whole, rest = divmod(count, n)
        picks.append(np.concatenate([*(rng.permutation(n) for _ in range(whole)), rng.permutation(n)[:rest]]))
    return picks


def mixture_rows(sizes: list[int], weights: list[float | None], seed: int, epoch: int) -> np.ndarray:
    """``mixture_indices`` as indices into the concatenation of the sources (the training set)."""
    offsets = np.cumsum([0, *sizes[:-1]])
    return np.concatenate([offset + p for offset, p in zip(offsets, mixture_indices(sizes, weights, seed, epoch))])
