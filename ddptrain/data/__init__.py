"""The data side: every ``data.*`` key is read in this package, one module per pipeline stage.

    sources    where rows come from: a file, a glob, a folder or a Hub dataset id (standard library only)
    load       reading a source's rows through ``datasets``, with errors that name the key and the fix
    templates  what a row's text is and which of it is trained on (alpaca, chat, sharegpt, text)
    encode     rows to input_ids / labels; owns ``IGNORE_INDEX``
    tokenized  one source tokenized once and cached by ``datasets``
    mixture    the run's train and eval sets: one source, or ``data.sources`` mixed by weight
    plan       the epoch plan: which samples each rank trains on, micro-step by micro-step
    sampler    one rank's column of the plan, with the data position a checkpoint saves
    batch_cost what a micro-batch costs in padded tokens (shared with the config check)
    collate    rows to padded or packed tensors
    prompts    trainer.eval_prompts rendered in the run's template, for the samples at each evaluation
    loader     ``build_training_data``: the one call the trainer makes

Importing the package loads none of them: ``config`` imports ``sources`` and ``batch_cost`` (no torch, no
datasets) and must stay fast, so the names below are looked up in their module on first use
(``from ddptrain.data import Collator`` works as it always did).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module of this package that defines it
_HOMES = {
    "TrainingData": "loader",
    "DataOrder": "loader",
    "build_training_data": "loader",
    "build_batching_spec": "loader",
    "Collator": "collate",
    "RowsDataset": "collate",
    "batch_token_counts": "collate",
    "build_collator": "collate",
    "loss_units": "collate",
    "build_datasets": "mixture",
    "build_mixture": "mixture",
    "mixture_indices": "mixture",
    "mixture_rows": "mixture",
    "source_data_config": "mixture",
    "TokenizedData": "tokenized",
    "tokenize_file": "tokenized",
    "load_rows": "load",
    "IGNORE_INDEX": "encode",
    "PromptRenderer": "prompts",
    "read_prompts": "prompts",
    "RowEncoder": "encode",
    "resolve_chat_template": "encode",
}

__all__ = [
    "IGNORE_INDEX",
    "Collator",
    "DataOrder",
    "PromptRenderer",
    "RowEncoder",
    "RowsDataset",
    "TokenizedData",
    "TrainingData",
    "batch_token_counts",
    "build_batching_spec",
    "build_collator",
    "build_datasets",
    "build_mixture",
    "build_training_data",
    "load_rows",
    "loss_units",
    "mixture_indices",
    "mixture_rows",
    "read_prompts",
    "resolve_chat_template",
    "source_data_config",
    "tokenize_file",
]

if TYPE_CHECKING:
    from ddptrain.data.collate import Collator, RowsDataset, batch_token_counts, build_collator, loss_units
    from ddptrain.data.encode import IGNORE_INDEX, RowEncoder, resolve_chat_template
    from ddptrain.data.load import load_rows
    from ddptrain.data.loader import DataOrder, TrainingData, build_batching_spec, build_training_data
    from ddptrain.data.mixture import build_datasets, build_mixture, mixture_indices, mixture_rows, source_data_config
    from ddptrain.data.prompts import PromptRenderer, read_prompts
    from ddptrain.data.tokenized import TokenizedData, tokenize_file


def __getattr__(name: str) -> Any:
    """``ddptrain.data.<name>``: imported from its module on first use (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
