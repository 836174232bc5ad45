"""One source tokenized: its rows read (``load.py``), encoded (``encode.py``) and cached by ``datasets``.

Tokenization runs once per (rows, tokenizer, settings): the cache key (``_fingerprint``) holds all three,
so an edited file or a changed setting is tokenized again. The dataset carries a ``length`` column so the
sampler never re-tokenizes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import datasets

from ddptrain.config import DataConfig, Template
from ddptrain.data.encode import RowEncoder
from ddptrain.data.load import load_rows
from ddptrain.data.preference import PairEncoder
from ddptrain.data.sampler import EpochRows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_VERSION = "2"  # bump when encoding changes, so old caches are not reused (2: every reply's end-of-turn)


@dataclass
class TokenizedData:
    """Tokenized train (and eval) sets with columns input_ids, labels, length."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    stats: dict[str, int]
    epoch_rows: EpochRows | None = None  # a weighted mixture: the rows of ``train`` each epoch draws


def _fingerprint(raw: datasets.Dataset, cfg: DataConfig, encoder: RowEncoder | PairEncoder) -> str:
    """Cache key: the rows read, the tokenizer's vocabulary and every encoding setting.

    ``raw._fingerprint`` stands for the rows: datasets derives it from the data files it read (their paths
    and modification times, every file of a glob or folder), so an edited file is tokenized again.
    """
    tokenizer = encoder.rows.tokenizer if isinstance(encoder, PairEncoder) else encoder.tokenizer
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
        cfg.prompt_field,
        cfg.chosen_field,
        cfg.rejected_field,
        str(cfg.pad_to_multiple_of),  # a preference pair's length holds it
        str(encoder.chat_template),
    ]
    return hashlib.sha256("\x00".join(settings).encode()).hexdigest()[:32]


def tokenize_file(
    path: str,
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_rows: int | None,
    key: str = "data.path",
    split: str | None = None,
    split_key: str | None = None,
) -> tuple[datasets.Dataset, dict[str, int]]:
    """Load and tokenize one source (cached). Returns the dataset and counts to report.

    ``split`` (named by ``split_key`` in errors): the split to read, null = ``cfg.split``. ``data.revision``
    applies to ``data.path`` (and a mixture's sources), not to ``data.eval_path``, which names its own revision
    after ``@``.
    """
    revision = None if key == "data.eval_path" else cfg.revision
    raw = load_rows(path, cfg.cache_dir, key, cfg.subset, split or cfg.split, revision, split_key)
    if max_rows is not None and max_rows < len(raw):
        raw = raw.select(range(max_rows))
    encoder = PairEncoder(cfg, tokenizer) if cfg.template == Template.preference else RowEncoder(cfg, tokenizer)
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
