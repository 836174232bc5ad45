"""The data side of a run: every ``data.*`` key is read here (and in ``sampler.py``).

``build_training_data`` is the one call the trainer makes: it loads, formats and tokenizes the
rows, plans this rank's micro-batches (``sampler.py``), and hands back the loader, the eval shard
and the data-order fingerprint that a resumed run must match.

Where the rows come from (a file, a glob, a folder or a Hub dataset id) is decided in ``sources.py``;
``load_rows`` reads them. Tokenization runs once per (rows, tokenizer, settings) and is cached by ``datasets``;
local rank 0 does it while the other ranks wait, then they read the cache. The cached
dataset carries a ``length`` column so the sampler never re-tokenizes.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import datasets
import huggingface_hub
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ddptrain import hangs, parallel, signals
from ddptrain.batch_cost import ceil_div, round_up
from ddptrain.config import Batching, DataConfig, RunConfig, SourceConfig, Template, is_jinja
from ddptrain.metrics import RANK_ZERO_ONLY
from ddptrain.model import IGNORE_INDEX
from ddptrain.parallel import DistEnv
from ddptrain.sampler import BatchingSpec, DistributedBatchSampler, EpochRows
from ddptrain.sources import Source, SourceKind, resolve_source
from ddptrain.templates import (
    RowError,
    chat_messages,
    chatml_turns,
    format_alpaca,
    format_text,
    render_chat,
    sharegpt_messages,
)

log = logging.getLogger(__name__)

CACHE_VERSION = "1"  # bump when encoding changes, so old caches are not reused


@dataclass
class TokenizedData:
    """Tokenized train (and eval) sets with columns input_ids, labels, length."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    stats: dict[str, int]
    epoch_rows: EpochRows | None = None  # a weighted mixture: the rows of ``train`` each epoch draws


# ----------------------------------------------------------------------------- loading


def load_rows(
    path: str, cache_dir: str | None, key: str = "data.path", subset: str | None = None, split: str = "train"
) -> datasets.Dataset:
    """Read a file, glob, folder or Hub dataset id (``sources.resolve_source``) through ``datasets``.

    Files and globs are read whole; a folder or Hub id gives its ``split`` of config ``subset``, as
    ``datasets.load_dataset`` reads a Hub repository. Offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE),
    a Hub id is read from the Hub cache (``hf download``) or from datasets' cache of an earlier load.

    Args:
        path: the value of ``key`` as the user typed it.
        cache_dir: ``data.cache_dir``; null = the datasets default.
        key: the config key that named the source (``data.path`` or ``data.eval_path``), for errors.
        subset: ``data.subset`` (folders and Hub ids).
        split: ``data.split`` (folders and Hub ids).

    Returns:
        The rows, cached as Arrow by ``datasets``.

    Raises:
        ValueError: naming ``key`` and the fix: an unsupported file type, a local path or glob that
            matches nothing, a line that is not valid JSON (by file and line), a Hub dataset that cannot
            be found or reached, or a split or subset that the dataset lacks.
    """
    source = resolve_source(path, key)
    offline = _hub_offline()
    datasets.disable_progress_bars()
    try:
        if not source.has_splits:  # data files: datasets names their rows the 'train' split
            files = list(source.files)
            read_as = _csv_as_text(files[0]) if source.builder == "csv" else {}
            return datasets.load_dataset(
                source.builder, data_files=files, split="train", cache_dir=cache_dir, **read_as
            )
        with _offline_mode(offline):
            return datasets.load_dataset(_local_copy(source, offline), name=subset, split=split, cache_dir=cache_dir)
    except Exception as exc:  # datasets wraps parse errors several layers deep
        raise ValueError(f"{key}={_explain_load_error(source, key, offline, exc)}") from exc


def _hub_offline() -> bool:
    """Whether the Hub is off limits, decided as datasets does (HF_DATASETS_OFFLINE, else HF_HUB_OFFLINE).

    datasets and huggingface_hub read the variables once, at import; reading them again here honours a
    value set later (a notebook, a test's monkeypatch).
    """
    value = os.environ.get("HF_DATASETS_OFFLINE")
    if value is None:
        value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return datasets.config.HF_HUB_OFFLINE or (value or "").upper() in datasets.config.ENV_VARS_TRUE_VALUES


@contextlib.contextmanager
def _offline_mode(offline: bool) -> Iterator[None]:
    """Keep datasets and huggingface_hub off the network for one load when ``offline`` (see _hub_offline)."""
    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def _local_copy(source: Source, offline: bool) -> str:
    """What datasets loads: the folder; offline, a Hub id's snapshot in the Hub cache; else the id itself."""
    if source.kind == SourceKind.folder:
        return os.path.expanduser(source.path)
    if offline:
        # datasets, offline, looks only in its own cache of an earlier load, not in the Hub cache
        # that `hf download` fills; look there first (local_files_only: no network).
        with contextlib.suppress(huggingface_hub.errors.LocalEntryNotFoundError):
            return huggingface_hub.snapshot_download(source.path, repo_type="dataset", local_files_only=True)
    return source.path


def _group(key: str) -> str:
    """Where a source's keys live: ``data`` for data.path / data.eval_path, ``data.sources[k]`` in a mixture."""
    return key.removesuffix(".path") if key.startswith("data.sources[") else "data"


def _csv_as_text(first_file: str) -> dict[str, Any]:
    """Read every CSV column as text: pandas would make an answer column of digits integers (a row error),
    infer types chunk by chunk (a column empty for 10k rows, then filled, fails to load) and turn
    empty cells into NaN."""
    with open(first_file, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return {
        "features": datasets.Features({name: datasets.Value("string") for name in header}),
        "keep_default_na": False,
    }


def _explain_load_error(source: Source, key: str, offline: bool, exc: Exception) -> str:
    """Why ``source`` could not be read, and the fix: the text after ``<key>=``."""
    path, text = source.path, str(exc)
    if source.kind == SourceKind.hub and isinstance(exc, (ConnectionError, datasets.exceptions.DatasetNotFoundError)):
        if offline:
            why = "offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and no local cache holds it"
        elif isinstance(exc, ConnectionError):
            why = f"the Hugging Face Hub could not be reached ({text})"
        else:
            why = f"the Hub has no dataset by that name that you can read ({text}); check the id and your login"
        return (
            f"{path}: no such local file or folder, so it was read as a Hub dataset id, but {why}. Run "
            f"`hf download --repo-type dataset {path}` on a machine with network (into the Hub cache this machine "
            f"reads), or download it to a folder (--local-dir) and point {key} at that folder."
        )
    if "Unknown split" in text:
        return f"{path}: {text} Set {_group(key)}.split to one of them."
    if "BuilderConfig" in text:
        return f"{path}: {text} Set {_group(key)}.subset to one of them (the dataset's configs)."
    for file in _jsonl_files(source):
        if (bad_line := _first_bad_line(file)) is not None:
            return bad_line if source.kind == SourceKind.file else f"{path}: {bad_line}"
    return (
        f"{path}: could not be read as a dataset: {type(exc).__name__}: {exc}. Data files must be .json lists of "
        "objects, .jsonl files with one object per line, .parquet tables or .csv tables with a header row."
    )


def _jsonl_files(source: Source) -> list[str]:
    """The .jsonl files a source reads (for a folder: every .jsonl file under it), in order."""
    if source.kind == SourceKind.folder:
        return sorted(str(p) for p in Path(source.path).expanduser().rglob("*.jsonl"))
    return [f for f in source.files if f.lower().endswith(".jsonl")]


def _first_bad_line(path: str) -> str | None:
    """``path:line`` and the fix for the first line of a .jsonl file that is not a JSON object."""
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
    return None


# ----------------------------------------------------------------------------- encoding


class RowEncoder:
    """Turns raw rows into input_ids / labels, masking out of the loss what is not trained on.

    Alpaca rows, and chat rows for a tokenizer without a chat template (ChatML), are (prompt,
    response) pieces, tokenized piece by piece with EOS appended. Chat rows under the model's own
    chat template, and plain text, are tokenized as one text exactly as the template writes it; the
    tokens that overlap a span to train on (an assistant reply with its end-of-turn token, or the
    whole text) are labelled.
    """

    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.chat_template = resolve_chat_template(cfg, tokenizer)
        self.whole_text = cfg.template == Template.text or self.chat_template is not None
        if self.whole_text and not tokenizer.is_fast:
            # The trained spans are found through the fast tokenizers' character offsets.
            raise ValueError(
                f"data.template={cfg.template.value} needs a fast tokenizer (character offsets), but "
                f"{type(tokenizer).__name__} is not one: point model.tokenizer at a folder with a tokenizer.json, "
                "or for chat rows set data.chat_template=chatml."
            )

    def turns(self, row: dict[str, Any]) -> Any:
        """Pieces (alpaca, ChatML) or ``(text, spans to train on, append EOS)``.

        Raises:
            RowError: the row lacks what the template needs.
        """
        c = self.cfg
        if c.template == Template.alpaca:
            return [format_alpaca(row, c.instruction_field, c.input_field, c.output_field)]
        if c.template == Template.text:
            text = format_text(row, c.text_field)
            return text, [(0, len(text))], True
        if c.template == Template.chat:
            messages, field = chat_messages(row, c.messages_field), c.messages_field
        else:
            messages = sharegpt_messages(row, c.conversations_field, c.role_field, c.content_field)
            field = c.conversations_field
        if self.chat_template is None:
            return chatml_turns(messages, field)
        text, spans = render_chat(messages, self.render, self.tokenizer.eos_token)
        return text, spans, False

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, parsed: list[Any]) -> list[tuple[list[int], list[int], bool]]:
        """(input_ids, labels, truncated) per parsed row."""
        if not parsed:  # every row of this batch was malformed and skipped
            return []
        return self.encode_texts(parsed) if self.whole_text else self.encode_turns(parsed)

    def encode_turns(self, turns_per_row: list[list[tuple[str, str]]]) -> list[tuple[list[int], list[int], bool]]:
        """Pieces tokenized one by one, prompts masked; EOS appended after the last response."""
        flat = [turn for turns in turns_per_row for turn in turns]
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
            encoded.append(self._truncate([*input_ids, self.eos_id], [*labels, self.eos_id]))
        return encoded

    def encode_texts(
        self, items: list[tuple[str, list[tuple[int, int]], bool]]
    ) -> list[tuple[list[int], list[int], bool]]:
        """Whole texts tokenized at once; a token is a target when its characters overlap a span."""
        tokenized = self.tokenizer(
            [text for text, _, _ in items], add_special_tokens=False, return_offsets_mapping=True
        )
        encoded = []
        for (_, spans, append_eos), ids, offsets in zip(items, tokenized.input_ids, tokenized.offset_mapping):
            labels = [
                token if any(start < end_s and start_s < end for start_s, end_s in spans) else IGNORE_INDEX
                for token, (start, end) in zip(ids, offsets)
            ]
            if append_eos:
                ids, labels = [*ids, self.eos_id], [*labels, self.eos_id]
            encoded.append(self._truncate(list(ids), labels))
        return encoded

    def _truncate(self, input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int], bool]:
        limit = self.cfg.max_length
        return input_ids[:limit], labels[:limit], len(input_ids) > limit

    def __call__(
        self, batch: dict[str, list], indices: list[int], source: str, key: str = "data.path"
    ) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        turns_per_row: list[Any] = []
        for index, row in zip(indices, rows):
            try:
                turns_per_row.append(self.turns(row))
            except RowError as err:
                if not self.cfg.skip_bad_rows:
                    raise ValueError(
                        f"{_locate(source, index)}: {err}. Fix the row, set the {_group(key)}.*_field keys to "
                        "your field names, or set data.skip_bad_rows=true to skip such rows."
                    ) from None
                turns_per_row.append(None)
        encoded = iter(self.encode([t for t in turns_per_row if t is not None]))
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


def resolve_chat_template(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The Jinja chat template that renders chat rows, or None for ChatML pieces (``format_chat``).

    ``data.chat_template``: null = the tokenizer's own (None when it has none), ``chatml``, a path to
    a template file, or the template itself.
    """
    if cfg.template not in (Template.chat, Template.sharegpt) or cfg.chat_template == "chatml":
        return None
    if cfg.chat_template is None:
        own = tokenizer.chat_template
        return own.get("default") if isinstance(own, dict) else own
    if is_jinja(cfg.chat_template):
        return cfg.chat_template
    return Path(cfg.chat_template).expanduser().read_text()  # the config check found the file


def _log_chat_format(cfg: DataConfig, chat_template: str | None) -> None:
    if cfg.template not in (Template.chat, Template.sharegpt):
        return
    if chat_template is not None:
        where = "data.chat_template" if cfg.chat_template else "the tokenizer's own chat template"
        log.info("data: conversations rendered with %s", where, extra=RANK_ZERO_ONLY)
    elif cfg.chat_template != "chatml":
        log.warning(
            "data: model.tokenizer has no chat template, so conversations use ChatML (Qwen's format). For "
            "another model family set data.chat_template to its template (a Jinja string or a file).",
            extra=RANK_ZERO_ONLY,
        )


def _locate(source: str, index: int) -> str:
    """``file:line`` of row ``index`` when ``source`` is .jsonl files (one file or a glob, read in order;
    blank lines are not rows), else ``source, row N`` (other file types, folders, Hub ids)."""
    try:
        files = resolve_source(source, "data.path").files
    except ValueError:  # gone since it was read: the row number still says which row
        files = ()
    if files and all(f.lower().endswith(".jsonl") for f in files):
        line = next(itertools.islice(_jsonl_row_lines(files), index, None), None)
        if line is not None:
            return line
    return f"{source}, row {index + 1}"


def _jsonl_row_lines(files: Sequence[str]) -> Iterator[str]:
    """``file:line`` of every row of .jsonl files, in order."""
    for file in files:
        with open(file, encoding="utf-8") as f:
            yield from (f"{file}:{line_no}" for line_no, line in enumerate(f, start=1) if line.strip())


def _fingerprint(raw: datasets.Dataset, cfg: DataConfig, encoder: RowEncoder) -> str:
    """Cache key: the rows read, the tokenizer's vocabulary and every encoding setting.

    ``raw._fingerprint`` stands for the rows: datasets derives it from the data files it read (their paths
    and modification times, every file of a glob or folder), so an edited file is tokenized again.
    """
    tokenizer = encoder.tokenizer
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
        # Conversations and plain text: the fields read and the chat template that renders them.
        cfg.conversations_field,
        cfg.role_field,
        cfg.content_field,
        cfg.text_field,
        str(encoder.chat_template),
    ]
    return hashlib.sha256("\x00".join(settings).encode()).hexdigest()[:32]


def tokenize_file(
    path: str, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_rows: int | None, key: str = "data.path"
) -> tuple[datasets.Dataset, dict[str, int]]:
    """Load and tokenize one file (cached). Returns the dataset and counts to report."""
    raw = load_rows(path, cfg.cache_dir, key, cfg.subset, cfg.split)
    if max_rows is not None and max_rows < len(raw):
        raw = raw.select(range(max_rows))
    encoder = RowEncoder(cfg, tokenizer)
    encoded = raw.map(
        encoder,
        batched=True,
        with_indices=True,
        fn_kwargs={"source": path, "key": key},
        remove_columns=raw.column_names,
        new_fingerprint=_fingerprint(raw, cfg, encoder),
        desc=f"tokenizing {Path(path).name}",
        num_proc=cfg.num_proc if cfg.num_proc and cfg.num_proc > 1 and len(raw) > cfg.num_proc else None,
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
    if cfg.sources:
        return build_mixture(cfg, tokenizer, seed)
    _log_chat_format(cfg, resolve_chat_template(cfg, tokenizer))
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
            "data: dropped %d rows whose prompt fills data.max_length=%d (nothing left to train on)",
            stats["no_target"],
            cfg.max_length,
            extra=RANK_ZERO_ONLY,
        )


# ----------------------------------------------------------------------------- mixtures


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
        _log_chat_format(source_cfg, resolve_chat_template(source_cfg, tokenizer))
        key = f"data.sources[{k}].path"
        data, source_stats = tokenize_file(source_cfg.path, source_cfg, tokenizer, source_cfg.max_rows, key)
        if len(data) == 0:
            raise ValueError(
                f"{key}={source.path}: no usable rows left after tokenization ({source_stats}). Check its template "
                f"and field names (data.sources[{k}].template, data.sources[{k}].*_field), or raise data.max_length."
            )
        if cfg.eval_path is None and source_cfg.eval_fraction > 0:
            split = data.train_test_split(test_size=source_cfg.eval_fraction, seed=seed)
            data, held_out = split["train"], split["test"]
            evals.append(held_out.add_column("source", [k] * len(held_out)))
        trains.append(data.add_column("source", [k] * len(data)))
        stats = {name: stats.get(name, 0) + count for name, count in source_stats.items()}
    train = datasets.concatenate_datasets(trains)
    sizes, weights = [len(t) for t in trains], [s.weight for s in cfg.sources]
    epoch_rows = None if all(w is None for w in weights) else partial(mixture_rows, sizes, weights, seed)
    eval_set = datasets.concatenate_datasets(evals) if evals else None
    if cfg.eval_path is not None:
        eval_set, eval_stats = tokenize_file(cfg.eval_path, cfg, tokenizer, None, "data.eval_path")
        stats.update({f"eval_{k}": v for k, v in eval_stats.items()})
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


def _loader_start_method(num_workers: int) -> str | None:
    """How the loader's workers start: ``fork`` on Linux, whatever started this rank.

    The self-launcher spawns its ranks, and a spawned process makes ``spawn`` its default: each loader worker would
    then import torch, transformers and ddptrain afresh, measured 4.4 s at every epoch's start (tiny model, this
    machine), which ``fork`` makes a fraction of a second. A forked worker only reads rows and collates them on the
    CPU; it is what torchrun's ranks (started with ``subprocess``) get anyway. Elsewhere Python's default stays.
    """
    if num_workers == 0 or sys.platform != "linux":
        return None
    return "fork"


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
    hangs.board.enter("tokenize")  # every rank: local rank 0 tokenizes, the others wait, then read its cache
    with parallel.local_rank_zero_first(env, cfg.prepare_timeout_s, "tokenizing the dataset"):
        data = build_datasets(cfg, tokenizer, seed)
    hangs.board.enter("plan_batches")  # back under parallel.timeout_s: the plan check below is a collective
    spec = build_batching_spec(cfg, env.world_size, grad_accum_steps, seed)
    sampler = DistributedBatchSampler(data.train["length"], spec, env.rank, data.epoch_rows)
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
        multiprocessing_context=_loader_start_method(cfg.num_workers),
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
    if cfg.sources:  # only then: checkpoints saved before mixtures existed keep resuming
        fingerprint.values["sources"] = [json.dumps(dataclasses.asdict(s), default=str) for s in cfg.sources]
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
