"""Saving: global rank 0 writes, atomically; the other ranks hold a writer that does nothing.

A save goes to ``<target>.tmp-<pid>``, is flushed, then renamed into place, so a crash
mid-save never leaves a half-written folder under the final name. State dicts come from
the unwrapped model (no DDP ``module.`` prefix); the callers put a barrier after saving.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from torch import nn
from transformers import PreTrainedTokenizerBase

from ddptrain.config import ModelConfig, ModelInit
from ddptrain.model import point_adapter_at_base, save_random_base

log = logging.getLogger(__name__)


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def atomic_save_dir(target: Path, write) -> None:
    """Call ``write(tmp_dir)``, fsync, then rename tmp_dir to ``target`` (replacing an older one)."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        _fsync_tree(tmp)
        if target.exists():
            old = target.with_name(f"{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class CheckpointWriter:
    """Writes adapters (and, for random-init bases, the base) from global rank 0."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def save_adapter(self, model: nn.Module, target: Path) -> None:
        """peft ``save_pretrained`` (safetensors) of the trainable weights, or the full model."""
        atomic_save_dir(target, lambda tmp: model.save_pretrained(tmp, safe_serialization=True))
        log.info("saved %s", target)

    def save_final(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, model_cfg: ModelConfig, seed: int
    ) -> None:
        """``<run>/adapter`` with the tokenizer; a random-init base goes to ``<run>/base`` so the adapter loads."""
        target = self.run_dir / "adapter"

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if model_cfg.init == ModelInit.random and model_cfg.lora:
                point_adapter_at_base(tmp, str(self.run_dir / "base"))

        if model_cfg.init == ModelInit.random and model_cfg.lora:
            atomic_save_dir(self.run_dir / "base", lambda tmp: save_random_base(model_cfg, seed, tokenizer, tmp))
        atomic_save_dir(target, write)
        log.info("saved the final weights to %s", target)


class NullCheckpointWriter:
    def save_adapter(self, model: nn.Module, target: Path) -> None:
        pass

    def save_final(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, model_cfg: ModelConfig, seed: int
    ) -> None:
        pass


def build_writer(is_rank_zero: bool, run_dir: Path) -> CheckpointWriter | NullCheckpointWriter:
    return CheckpointWriter(run_dir) if is_rank_zero else NullCheckpointWriter()
