"""Rank 0's writer: a checkpoint folder written atomically (weights, trainer state, manifest last), checked
before it is put in place (``trainer.save_check``), ``latest`` pointed at it, ``best/`` copied from it, the old ones
pruned; the final weights (``adapter/``). Ranks other than 0 hold ``NullCheckpointWriter``, which does nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddptrain.checkpoint.files import (
    BEST,
    BEST_FILE,
    MANIFEST,
    SHARDED,
    STATE,
    STEP_DIR,
    WEIGHTS,
    AdapterFiles,
    CheckpointError,
    _write_manifest,
    atomic_save_dir,
    best_step_in,
    read_manifest,
    what_it_holds,
)
from ddptrain.process.rng import rng_untouched

if TYPE_CHECKING:  # the save check imports the checkpoint's files: imported where it is used, not at import time
    from ddptrain.evaluation.best import BestRule
    from ddptrain.evaluation.save_check import SaveChecks

log = logging.getLogger("ddptrain.checkpoint")


class CheckpointWriter:
    """Writes checkpoints, ``best/`` and the final weights (``adapter/``); used on global rank 0 only.

    Args:
        run_dir: the run directory.
        keep_last_n: ``trainer.keep_last_n``: the newest checkpoints kept.
        files: the tokenizer and base an adapter carries (None: the weights alone, for tests of the format).
        rule: ``trainer.keep_best_n`` checkpoints kept besides, ranked by their manifest's eval metrics.
        check: proves the weights it saves load as trained, as ``trainer.save_check`` says; None: no check.
    """

    def __init__(
        self,
        run_dir: Path,
        keep_last_n: int,
        *,
        files: AdapterFiles | None = None,
        rule: BestRule | None = None,
        check: SaveChecks | None = None,
    ):
        self.run_dir = run_dir
        self.folder = run_dir / "checkpoints"
        self.keep_last_n = keep_last_n
        self.files, self.rule, self.check = files, rule, check
        self.checked: dict[str, Any] = {}
        """The record of the last save's check (``evaluation.save_check``): empty when none ran."""

    def save(
        self,
        model: nn.Module,
        state: dict[str, Any],
        meta: dict[str, Any],
        final: bool = False,
        whole: dict[str, torch.Tensor] | None = None,
        sharded: Path | None = None,
    ) -> Path:
        """Write ``checkpoints/step-N`` (weights, trainer state, manifest last), point ``latest`` at it, copy its
        weights to ``best/`` when ``meta`` says it is the best, prune; ``checked`` holds the check's record
        (``final``: the run's last save). A sharded model's (FSDP2): ``whole``, its trainable tensors gathered whole
        (written to ``weights/`` and checked), and ``sharded``, the folder every rank wrote its shards of the
        trainable weights and the optimizer to (``parallel.fsdp.save_shards``), moved in as ``sharded/``.

        Returns:
            The checkpoint folder.

        Raises:
            Exception: whatever the write or the check raised; the previous checkpoints are untouched.
        """
        with rng_untouched():  # the check draws as it builds models: the run goes on as without it
            return self._save(model, state, meta, final, whole, sharded)

    def check_saved(self, step: int, whole: dict[str, torch.Tensor] | None = None) -> None:
        """The final save's check of ``checkpoints/step-N``, written before (``Checkpointer.check_last``)."""
        self.checked, weights = {}, self.folder / f"step-{step:08d}" / WEIGHTS
        if self.check is not None:
            with rng_untouched():
                self.checked = self.check.written(weights, weights, final=True, whole=whole)

    def _save(
        self,
        model: nn.Module,
        state: dict[str, Any],
        meta: dict[str, Any],
        final: bool,
        whole: dict[str, torch.Tensor] | None,
        sharded: Path | None,
    ) -> Path:
        target = self.folder / f"step-{meta['step']:08d}"
        self.checked = checked = {}
        if self.files is not None:
            self.files.ensure_base(self.run_dir)

        best = bool(meta.get("best")) and self.rule is not None and self.rule.keep_best_n > 0  # copied to best/

        def write(tmp: Path) -> None:
            self._write_weights(model, tmp / WEIGHTS, with_tokenizer=False, whole=whole)
            if self.check is not None:
                checked.update(self.check.written(tmp / WEIGHTS, target / WEIGHTS, final, best, whole=whole))
            if sharded is not None:
                sharded.rename(tmp / SHARDED)
            torch.save(state, tmp / STATE)
            _write_manifest(tmp, meta)

        atomic_save_dir(target, write)
        latest_tmp = self.folder / ".latest.tmp"
        latest_tmp.write_text(target.name + "\n")
        latest_tmp.replace(self.folder / "latest")
        log.info("saved checkpoint %s", target)
        if best:
            from ddptrain.evaluation.save_check import merge_records  # it imports the checkpoint's files

            self.checked = merge_records(checked, self._save_best(target, meta))
        self._prune()
        return target

    def _write_weights(
        self, model: nn.Module, folder: Path, with_tokenizer: bool, whole: dict[str, torch.Tensor] | None = None
    ) -> None:
        if self.files is None:
            model.save_pretrained(folder, safe_serialization=True, state_dict=None if whole is None else dict(whole))
        else:
            self.files.write(model, folder, self.run_dir, with_tokenizer, whole)

    def _save_best(self, checkpoint: Path, meta: dict[str, Any]) -> dict[str, Any]:
        """``<run>/best``: the checkpoint's weights (a copy verified against its manifest, not checked again), the
        tokenizer and ``best.json`` (its step and metrics)."""
        best, checked = self.run_dir / BEST, {}

        def write(tmp: Path) -> None:
            for file in (checkpoint / WEIGHTS).iterdir():
                shutil.copy2(file, tmp / file.name)
            if self.files is not None:
                self.files.tokenizer.save_pretrained(tmp)
            about = {**meta["eval"], "step": meta["step"], "metric": self.rule.metric, "checkpoint": str(checkpoint)}
            (tmp / BEST_FILE).write_text(json.dumps(about, indent=2) + "\n")
            if self.check is not None:
                checked.update(self.check.copied(checkpoint, tmp, best))

        atomic_save_dir(best, write)
        value = meta["eval"].get(self.rule.metric, math.nan)
        its = {"adapter": "adapter is", "weights": "weights are"}[what_it_holds(best)]
        log.info("step %d is the best so far (%s %.4f): its %s in %s", meta["step"], self.rule.metric, value, its, best)
        return checked

    def adopt_best(self, source_run: Path, best_step: int | None) -> None:
        """Make ``best/`` hold the best step the resumed checkpoint's tracker names: from the resumed run's ``best/``
        when it holds that step (a run resumed into a new folder), else from that run's checkpoint of the step (a save
        cut short between the checkpoint and ``best/``); else leave it, and say so."""
        if best_step is None or self.rule is None or self.rule.keep_best_n == 0:
            return
        target, source = self.run_dir / BEST, source_run / BEST
        kept = source_run / "checkpoints" / f"step-{best_step:08d}"
        if best_step_in(self.run_dir) == best_step:
            return
        if best_step_in(source_run) == best_step:

            def carry(tmp: Path) -> None:  # verified against the checkpoint it was copied from, where that is kept
                shutil.copytree(source, tmp, dirs_exist_ok=True)
                if self.check is not None and (kept / MANIFEST).is_file():
                    self.check.copied(kept, tmp, target)
                elif self.check is not None:  # keep_best_n keeps it: removed by hand, or another tool's folder
                    log.warning("%s is gone: %s carried over from %s unverified", kept, target, source)

            atomic_save_dir(target, carry)
        elif (kept / MANIFEST).is_file():
            self._save_best(kept, {"step": best_step, "eval": read_manifest(kept).get("eval") or {}})
        else:
            log.warning(
                "neither %s nor %s holds the best step %d: best/ waits for the next best", source, kept, best_step
            )
            return
        log.info("the best so far (step %d) is in %s, as when the run stopped", best_step, target)

    def _prune(self) -> None:
        """Keep the newest ``keep_last_n`` checkpoints and the best ``keep_best_n`` (by their manifests)."""
        complete = sorted(p for p in self.folder.iterdir() if STEP_DIR.match(p.name))
        keep = set(complete[max(0, len(complete) - self.keep_last_n) :]) | set(self._best(complete))
        for old in complete:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def _best(self, complete: list[Path]) -> list[Path]:
        if self.rule is None or self.rule.keep_best_n == 0:
            return []
        scored = []
        for folder in complete:
            with contextlib.suppress(CheckpointError, OSError, ValueError):
                evaluated = read_manifest(folder).get("eval") or {}
                if self.rule.metric in evaluated:
                    scored.append((float(evaluated[self.rule.metric]), folder))
        return self.rule.best_first(scored)[: self.rule.keep_best_n]

    def save_final(self, model: nn.Module, whole: dict[str, torch.Tensor] | None = None) -> None:
        """``<run>/adapter``: the final weights, the tokenizer (and a random-init LoRA base in ``<run>/base``), checked
        as the run's last save (``checked`` holds the record); ``whole``: a sharded model's, gathered (``save``)."""
        assert self.files is not None, "the final weights carry the tokenizer: build the writer with files"
        with rng_untouched():
            self._save_final(model, whole)

    def _save_final(self, model: nn.Module, whole: dict[str, torch.Tensor] | None) -> None:
        self.files.ensure_base(self.run_dir)
        adapter = self.run_dir / "adapter"
        self.checked = checked = {}

        def write(tmp: Path) -> None:
            self._write_weights(model, tmp, with_tokenizer=True, whole=whole)
            if self.check is not None:
                checked.update(self.check.written(tmp, adapter, final=True, whole=whole))

        atomic_save_dir(adapter, write)
        log.info("saved the final weights to %s", adapter)


class NullCheckpointWriter:
    """What ranks other than 0 hold: every method does nothing."""

    checked: dict[str, Any] = {}  # noqa: RUF012 (never written: rank 0 checks)

    def save(self, model: nn.Module, state: dict[str, Any], meta: dict[str, Any], **kwargs: Any) -> None:
        """Rank 0 writes the checkpoint; this rank waits for it (``parallel.after_rank_zero``)."""

    def save_final(self, model: nn.Module, whole: Any = None) -> None:
        """Rank 0 writes the final weights; this rank waits for it (``parallel.after_rank_zero``)."""

    def adopt_best(self, source_run: Path, best_step: int | None) -> None:
        """Rank 0 carries ``best/`` over."""

    def check_saved(self, step: int, whole: Any = None) -> None:
        """Rank 0 checks the checkpoint of ``step``."""


def build_writer(
    is_rank_zero: bool, run_dir: Path, keep_last_n: int, **kwargs: Any
) -> CheckpointWriter | NullCheckpointWriter:
    """Rank 0's writer (``kwargs``: ``CheckpointWriter``'s), elsewhere a null one."""
    return CheckpointWriter(run_dir, keep_last_n, **kwargs) if is_rank_zero else NullCheckpointWriter()
