"""Checkpoints: written by global rank 0 atomically, found and verified on resume, loaded safely.

A checkpoint is a folder ``<run>/checkpoints/step-00000020/`` holding

- ``weights/``: the trainable weights as ``save_pretrained`` writes them (a peft adapter in safetensors, or the full
  model for a full fine-tune, a tied head left out as transformers does), from the unwrapped model;
- ``trainer_state.pt``: optimizer, LR schedule, GradScaler, step, data position, the partial logging window and the
  RNG states of every rank (plain tensors and numbers: it loads with ``torch.load(weights_only=True)``);
- ``manifest.json``, written last: step, epoch, data position, world size, the settings that
  fix the data order, the eval metrics when the step was evaluated, and every file with its size and SHA-256.

The folder is written under a temporary name, flushed, and renamed into place; a folder
without a complete, matching manifest is never loaded (``checkpoint_files``). ``latest`` names the newest one;
the last ``trainer.keep_last_n`` are kept, and besides them the best ``trainer.keep_best_n`` by
``trainer.best_metric`` as their manifests record it, so the choice survives a resume and a restart. The best
one's weights are also in ``<run>/best/`` with ``best.json`` (its step and metrics). Before saved weights are put
in place, ``trainer.save_check`` reads them back bit for bit and, at the end, proves plain peft loads an adapter as
trained, plain transformers a full fine-tune's model (``evaluation.save_check``); ``best/`` is a verified copy.

``Checkpointer`` decides what a checkpoint holds: the trainer hands it its stateful parts (each
with ``state_dict``/``load_state_dict``) and the data-order fingerprint; it gathers the per-rank
parts, has rank 0 write (ranks other than 0 hold a writer that does nothing) while the others wait for it
through the store, up to ``trainer.save_timeout_s`` (not a collective bounded by ``parallel.timeout_s``: a
save takes as long as the storage needs), and on resume checks that the checkpoint fits the run before
restoring every part.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ddptrain import parallel
from ddptrain.checkpoint_files import (
    BEST,
    BEST_FILE,
    KNOWN_PREFIXES,
    MANIFEST,
    STATE,
    STEP_DIR,
    WEIGHTS,
    AdapterFiles,
    CheckpointError,
    _write_manifest,
    atomic_save_dir,
    base_model_path,
    best_step_in,
    find_checkpoint,
    load_state,
    load_trainable_weights,
    newest_complete,
    read_manifest,
    read_weights,
    strip_known_prefixes,
    verify,
    what_it_holds,
)
from ddptrain.checkpoint_format import upgrade_state, version_of
from ddptrain.config import TrainerConfig
from ddptrain.evaluation.best import BestRule, BestTracker
from ddptrain.evaluation.save_check import SaveChecks, build_save_checks, merge_records
from ddptrain.parallel import DistEnv
from ddptrain.precision import TORCH_DTYPES
from ddptrain.rng import RNGState, rng_untouched

__all__ = [  # the files' names too: ``checkpoint.verify``, ``checkpoint.MANIFEST``, ... as callers know them
    "BEST",
    "BEST_FILE",
    "KNOWN_PREFIXES",
    "MANIFEST",
    "STATE",
    "STEP_DIR",
    "WEIGHTS",
    "AdapterFiles",
    "CheckpointError",
    "CheckpointWriter",
    "Checkpointer",
    "NullCheckpointWriter",
    "_write_manifest",
    "atomic_save_dir",
    "base_model_path",
    "best_step_in",
    "build_checkpointer",
    "build_writer",
    "check_same_data_order",
    "find_checkpoint",
    "load_state",
    "load_trainable_weights",
    "newest_complete",
    "read_manifest",
    "read_weights",
    "strip_known_prefixes",
    "verify",
]

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """A part of the training state: the optimizer, the LR schedule, the sampler, the log window, ..."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Fingerprint(Protocol):
    """The settings that fix the data order (``data.DataOrder``), as the checkpointer uses them."""

    values: dict[str, Any]

    def changes_from(self, saved: dict[str, Any]) -> list[str]: ...


# ----------------------------------------------------------------------------- what a checkpoint holds


class Checkpointer:
    """Saves and restores a run's state; every rank holds one and calls it at the same step.

    Args:
        env: this rank's place in the process group (rank 0 writes).
        run_dir: the run directory (checkpoints go to ``<run_dir>/checkpoints``).
        writer: what writes the files: rank 0's ``CheckpointWriter``, elsewhere a null one (``build_writer``).
        save_timeout_s: ``trainer.save_timeout_s``: how long the other ranks wait for rank 0 to write.
        weights: the model whose trainable weights are saved (the peft model, unwrapped).
        shared: parts equal on every rank (optimizer, scheduler, scaler, sampler, the best tracker), saved once.
        per_rank: parts that differ by rank (the log window); each rank's copy is saved and
            restored to the same rank. The RNG states are always added.
        fingerprint: the settings that fix which samples each step sees (``data.DataOrder``): its
            ``values`` go into the manifest, and ``changes_from(saved)`` names what a resume would change.
        best: the best evaluation so far (``evaluation.best.BestTracker``): a checkpoint of an evaluated step
            records its metrics, and the best one's weights are copied to ``<run>/best/``.
    """

    def __init__(
        self,
        env: DistEnv,
        run_dir: Path,
        writer: CheckpointWriter | NullCheckpointWriter,
        save_timeout_s: float,
        *,
        weights: nn.Module,
        shared: dict[str, Stateful],
        per_rank: dict[str, Stateful],
        fingerprint: Fingerprint,
        best: BestTracker,
    ):
        self.env, self.run_dir, self.weights, self.writer = env, run_dir, weights, writer
        self.save_timeout_s = save_timeout_s
        self.shared = {**shared, "best": best}
        self.per_rank = {**per_rank, "rng": RNGState()}
        self.fingerprint = fingerprint
        self.best = best
        self.saved_step: int | None = None
        """The step of this run's newest checkpoint (saved, or resumed from); None while it has none."""

    def save(self, step: int, final: bool = False) -> dict[str, Any]:
        """Every rank contributes its per-rank parts; rank 0 writes; the others wait for it (``after_rank_zero``).
        ``final``: the run's last save (no ``adapter/`` follows): ``trainer.save_check`` proves the round trip here.

        Returns:
            On rank 0, the save check's metrics record (``trainer.save_check``) when one ran; else empty.

        Raises:
            RuntimeError: the write or its check failed, on rank 0 or as rank 0 told the others (the previous
                checkpoint is intact and named), or took longer than ``trainer.save_timeout_s``.
        """
        gathered = {name: parallel.all_gather_object(part.state_dict()) for name, part in self.per_rank.items()}
        state = {"step": step, **{name: part.state_dict() for name, part in self.shared.items()}, **gathered}
        meta = {
            "step": step,
            **state["sampler"],
            "world_size": self.env.world_size,
            "data_order": self.fingerprint.values,
        }
        evaluated = self.best.evaluated_at(step)
        if evaluated is not None:  # the pruning ranks checkpoints by these
            meta |= {"eval": evaluated, "best": self.best.best_step == step}
        try:
            write = partial(self.writer.save, self.weights, state, meta, final=final)
            what = f"save the checkpoint of step {step}"
            parallel.after_rank_zero(write, what, self.save_timeout_s, "trainer.save_timeout_s")
            self.saved_step = step
            return {"step": step, **self.writer.checked} if self.writer.checked else {}
        except Exception as err:
            previous = newest_complete(self.run_dir / "checkpoints")
            fix = _fix_for(err, self.run_dir, "adapter" if hasattr(self.weights, "peft_config") else "weights")
            raise RuntimeError(
                f"saving the checkpoint of step {step} failed: {type(err).__name__}: {str(err).rstrip('.')}. "
                f"The previous checkpoint is intact: {previous or 'none yet'}. {fix}"
            ) from err

    def save_final(self, step: int) -> dict[str, Any]:
        """Rank 0 writes the final weights (``<run>/adapter``); the others wait for it, as for a checkpoint.

        Returns:
            On rank 0, the save check's metrics record (at ``step``) when one ran; else empty.

        Raises:
            RuntimeError: the write or its check failed, or took longer than ``trainer.save_timeout_s``.
        """
        write = partial(self.writer.save_final, self.weights)
        what = f"save the final weights to {self.run_dir / 'adapter'}"
        parallel.after_rank_zero(write, what, self.save_timeout_s, "trainer.save_timeout_s")
        return {"step": step, **self.writer.checked} if self.writer.checked else {}

    def resume(self, resume: str) -> int | None:
        """Restore every part from ``trainer.resume`` (auto: this run's newest checkpoint, if any).

        Returns:
            The step the checkpoint was saved at, or None when there is nothing to resume.

        Raises:
            CheckpointError: the checkpoint does not fit this run (world size, data order, model).
        """
        folder = find_checkpoint(resume, self.run_dir)
        if folder is None:
            return None
        check_same_data_order(folder, self.fingerprint)  # find_checkpoint verified every file's hash
        load_trainable_weights(self.weights, folder / WEIGHTS)
        fresh = {name: part.state_dict() for name, part in self.per_rank.items()}
        fresh_shared = {name: part.state_dict() for name, part in self.shared.items()}
        version = version_of(read_manifest(folder))
        state = upgrade_state(load_state(folder), version, fresh, self.env.world_size, fresh_shared)
        for name in state["missing"]:
            log.warning("%s keeps no %s: it starts afresh on resume", folder, name)
        for name, part in self.shared.items():
            part.load_state_dict(state[name])
        for name, part in self.per_rank.items():
            part.load_state_dict(state[name][self.env.rank])
        adopt = partial(self.writer.adopt_best, folder.parent.parent, self.best.best_step)
        parallel.after_rank_zero(adopt, "carry best/ over", self.save_timeout_s, "trainer.save_timeout_s")
        log.info("resumed from %s at step %d (epoch %d)", folder, state["step"], state["sampler"]["epoch"])
        self.saved_step = state["step"]
        return state["step"]


def _fix_for(err: BaseException, run_dir: Path, noun: str) -> str:
    """What to do about a failed save (``noun``: "adapter" or "weights"): a check that failed is not a full disk."""
    if "SaveCheckError" in f"{type(err).__name__}: {err}":
        return (
            f"The saved {noun} would not load as trained; the check found it before it was put in place. Report it "
            "with the error above (trainer.save_check=off saves without the check)."
        )
    if "trainer.save_timeout_s=" in str(err):  # slow, not full: the error says to raise the limit
        return f"Resume with trainer.resume={run_dir}."
    return (
        f"Free space in {run_dir} or point trainer.output_dir at a writable disk, and resume with "
        f"trainer.resume={run_dir}."
    )


def check_same_data_order(folder: Path, fingerprint: Fingerprint) -> None:
    """Refuse a checkpoint saved with settings that would feed other samples to the remaining steps.

    Raises:
        CheckpointError: naming every setting that changed (as the user sets it), old and new.
    """
    changed = fingerprint.changes_from(read_manifest(folder)["data_order"])
    if changed:
        details = ", ".join(changed)
        raise CheckpointError(
            f"{folder} was saved with a different data order ({details}); resuming would silently train on "
            "other samples. Resume with the same data.*, optim.grad_accum_steps, trainer.seed and number of "
            "processes, or set trainer.resume=none to start over."
        )


# ----------------------------------------------------------------------------- writing


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

    def save(self, model: nn.Module, state: dict[str, Any], meta: dict[str, Any], final: bool = False) -> Path:
        """Write ``checkpoints/step-N`` (weights, trainer state, manifest last), point ``latest`` at it, copy its
        weights to ``best/`` when ``meta`` says it is the best, prune; ``checked`` holds the check's record
        (``final``: the run's last save).

        Returns:
            The checkpoint folder.

        Raises:
            Exception: whatever the write or the check raised; the previous checkpoints are untouched.
        """
        with rng_untouched():  # the check draws as it builds models: the run goes on as without it
            return self._save(model, state, meta, final)

    def _save(self, model: nn.Module, state: dict[str, Any], meta: dict[str, Any], final: bool) -> Path:
        target = self.folder / f"step-{meta['step']:08d}"
        self.checked = checked = {}
        if self.files is not None:
            self.files.ensure_base(self.run_dir)

        best = bool(meta.get("best")) and self.rule is not None and self.rule.keep_best_n > 0  # copied to best/

        def write(tmp: Path) -> None:
            self._write_weights(model, tmp / WEIGHTS, with_tokenizer=False)
            if self.check is not None:
                checked.update(self.check.written(tmp / WEIGHTS, target / WEIGHTS, final, best))
            torch.save(state, tmp / STATE)
            _write_manifest(tmp, meta)

        atomic_save_dir(target, write)
        latest_tmp = self.folder / ".latest.tmp"
        latest_tmp.write_text(target.name + "\n")
        latest_tmp.replace(self.folder / "latest")
        log.info("saved checkpoint %s", target)
        if best:
            self.checked = merge_records(checked, self._save_best(target, meta))
        self._prune()
        return target

    def _write_weights(self, model: nn.Module, folder: Path, with_tokenizer: bool) -> None:
        if self.files is None:
            model.save_pretrained(folder, safe_serialization=True)
        else:
            self.files.write(model, folder, self.run_dir, with_tokenizer)

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

    def save_final(self, model: nn.Module) -> None:
        """``<run>/adapter``: the final weights, the tokenizer (and a random-init LoRA base in ``<run>/base``), checked
        as the run's last save (``checked`` holds the record)."""
        assert self.files is not None, "the final weights carry the tokenizer: build the writer with files"
        with rng_untouched():
            self._save_final(model)

    def _save_final(self, model: nn.Module) -> None:
        self.files.ensure_base(self.run_dir)
        adapter = self.run_dir / "adapter"
        self.checked = checked = {}

        def write(tmp: Path) -> None:
            self._write_weights(model, tmp, with_tokenizer=True)
            if self.check is not None:
                checked.update(self.check.written(tmp, adapter, final=True))

        atomic_save_dir(adapter, write)
        log.info("saved the final weights to %s", adapter)


class NullCheckpointWriter:
    """What ranks other than 0 hold: every method does nothing."""

    checked: dict[str, Any] = {}  # noqa: RUF012 (never written: rank 0 checks)

    def save(self, model: nn.Module, state: dict[str, Any], meta: dict[str, Any], final: bool = False) -> None:
        """Rank 0 writes the checkpoint; this rank waits for it (``parallel.after_rank_zero``)."""

    def save_final(self, model: nn.Module) -> None:
        """Rank 0 writes the final weights; this rank waits for it (``parallel.after_rank_zero``)."""

    def adopt_best(self, source_run: Path, best_step: int | None) -> None:
        """Rank 0 carries ``best/`` over."""


def build_writer(
    is_rank_zero: bool, run_dir: Path, keep_last_n: int, **kwargs: Any
) -> CheckpointWriter | NullCheckpointWriter:
    """Rank 0's writer (``kwargs``: ``CheckpointWriter``'s), elsewhere a null one."""
    return CheckpointWriter(run_dir, keep_last_n, **kwargs) if is_rank_zero else NullCheckpointWriter()


def build_checkpointer(
    env: DistEnv,
    run_dir: Path,
    cfg: TrainerConfig,
    files: AdapterFiles,
    weights: nn.Module,
    shared: dict[str, Stateful],
    per_rank: dict[str, Stateful],
    fingerprint: Fingerprint,
    best: BestTracker,
    probe_rows: list[list[int]],
) -> Checkpointer:
    """The checkpointer of a run from the ``trainer`` group (``keep_last_n``, ``save_timeout_s``, ``save_check``; the
    best checkpoints by ``best``'s rule): when ``trainer.save_check`` is on, rank 0's writer checks the weights it
    saves (``evaluation.save_check.build_save_checks``: the adapter's round trip runs on a probe of ``probe_rows``, a
    few training rows). The other arguments are ``Checkpointer``'s."""
    check: SaveChecks | None = None
    if env.is_rank_zero:
        m = files.model_cfg
        base = base_model_path(m, run_dir) if m.lora else None
        on_gpu, attn, pad_id = env.device.type == "cuda", m.attn_implementation.value, files.tokenizer.pad_token_id
        dtype = TORCH_DTYPES[m.dtype]
        check = build_save_checks(cfg.save_check, weights, base, dtype, attn, probe_rows, pad_id, on_gpu)
    writer = build_writer(env.is_rank_zero, run_dir, cfg.keep_last_n, files=files, rule=best.rule, check=check)
    return Checkpointer(
        env,
        run_dir,
        writer,
        cfg.save_timeout_s,
        weights=weights,
        shared=shared,
        per_rank=per_rank,
        fingerprint=fingerprint,
        best=best,
    )
