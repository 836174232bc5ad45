"""Checkpoints: written by global rank 0 atomically, found and verified on resume, loaded safely.

A checkpoint is a folder ``<run>/checkpoints/step-00000020/`` holding

- ``weights/``: the trainable weights as ``save_pretrained`` writes them (a peft adapter in safetensors, or the full
  model for a full fine-tune, a tied head left out as transformers does), from the unwrapped model;
- ``trainer_state.pt``: optimizer, LR schedule, GradScaler, step, data position, the partial logging window and the
  RNG states of every rank (plain tensors and numbers: it loads with ``torch.load(weights_only=True)``);
- ``manifest.json``, written last: step, epoch, data position, world size, the settings that
  fix the data order, the eval metrics when the step was evaluated, and every file with its size and SHA-256.

The folder is written under a temporary name, flushed, and renamed into place; a folder
without a complete, matching manifest is never loaded (``checkpoint.files``). ``latest`` names the newest one;
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

import logging
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ddptrain import parallel
from ddptrain.checkpoint.files import (
    BEST,
    BEST_FILE,
    KNOWN_PREFIXES,
    MANIFEST,
    SHARDED,
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
)
from ddptrain.checkpoint.format import upgrade_state, version_of
from ddptrain.checkpoint.writer import CheckpointWriter, NullCheckpointWriter, build_writer
from ddptrain.config import TrainerConfig
from ddptrain.evaluation.best import BestTracker
from ddptrain.model.precision import TORCH_DTYPES
from ddptrain.parallel import DistEnv
from ddptrain.process.rng import RNGState

__all__ = [  # the files' names too: ``checkpoint.verify``, ``checkpoint.MANIFEST``, ... as callers know them
    "BEST",
    "BEST_FILE",
    "KNOWN_PREFIXES",
    "MANIFEST",
    "SHARDED",
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
    "check_same_strategy",
    "find_checkpoint",
    "load_state",
    "load_trainable_weights",
    "newest_complete",
    "planned_for",
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
            restored to the same rank (on another number of processes: ``_restore_ranks``). The RNG states are
            always added.
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
        self.saved_dtype: torch.dtype | None = None
        """What a sharded model's gathered weights are saved in: ``model.dtype`` for a full fine-tune (FSDP2 trains
        fp32 masters of a bf16 model), None for LoRA (its adapters are fp32 under both strategies)."""
        self.saved_step: int | None = None
        """The step of the newest checkpoint in this run's folder (saved, or resumed from); None while it has none."""

    def save(self, step: int, final: bool = False) -> dict[str, Any]:
        """Every rank contributes its per-rank parts; rank 0 writes; the others wait for it (``after_rank_zero``).
        ``final``: the run's last save (no ``adapter/`` follows): ``trainer.save_check`` proves the round trip here.

        Returns:
            On rank 0, the save check's metrics record (``trainer.save_check``) when one ran; else empty.

        Raises:
            RuntimeError: the write or its check failed, on rank 0 or as rank 0 told the others (the previous
                checkpoint is intact and named), or took longer than ``trainer.save_timeout_s``.
        """
        sharded = parallel.is_sharded(self.weights)
        gathered = {name: parallel.all_gather_object(part.state_dict()) for name, part in self.per_rank.items()}
        state = {"step": step, **{name: part.state_dict() for name, part in self._shared(sharded).items()}, **gathered}
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
            write = partial(self.writer.save, self.weights, state, meta, final=final, **self._gather(step, sharded))
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

    def _shared(self, sharded: bool) -> dict[str, Stateful]:
        """The parts the trainer state holds: a sharded model's optimizer state is in the shards instead."""
        return {name: part for name, part in self.shared.items() if not (sharded and name == "optimizer")}

    def _gather(self, step: int | None, sharded: bool) -> dict[str, Any]:
        """A sharded model's (FSDP2) side of a save, on every rank: its trainable tensors gathered whole onto rank 0
        (``whole``: ``weights/``, the save check) and, for a checkpoint (``step``), every rank's shards of them and
        of the optimizer state written beside it (``sharded``: moved into the checkpoint by rank 0). A replica's:
        nothing (rank 0 reads its own model)."""
        if not sharded:
            return {}
        found = {"whole": parallel.whole_trainable(self.weights, self.env.rank, self.saved_dtype)}
        if step is not None:
            staging = self.run_dir / "checkpoints" / f".step-{step:08d}.{SHARDED}"
            found["sharded"] = parallel.save_shards(self.weights, self.shared["optimizer"], staging, self.env.rank)
        return found

    def save_last(self, step: int, save_final: bool, checking: bool) -> dict[str, Any]:
        """The run's last checkpoint, at ``step``: saved with ``save_final`` (``adapter/`` follows), for a best or an
        early stop, or where the run saved any checkpoint and ``checking`` (``trainer.save_check`` on: without
        ``save_final`` it is the run's last save, and the round trip runs on it). One already saved at ``step`` (an
        early stop, a finished run resumed) is not written again; without ``save_final`` rank 0 checks it as the last.

        Returns:
            On rank 0, the save check's metrics record when one ran; else empty.
        """
        final = not save_final
        if self.saved_step == step:
            return self._check_saved(step) if final else {}
        if (
            save_final
            or self.best.wants_checkpoint(step)
            or self.best.should_stop
            or (checking and self.saved_step is not None)
        ):
            return self.save(step, final)
        return {}

    def _check_saved(self, step: int) -> dict[str, Any]:
        check = partial(self.writer.check_saved, step, **self._gather(None, parallel.is_sharded(self.weights)))
        parallel.after_rank_zero(
            check, f"check the checkpoint of step {step}", self.save_timeout_s, "trainer.save_timeout_s"
        )
        return {"step": step, **self.writer.checked} if self.writer.checked else {}

    def save_final(self, step: int) -> dict[str, Any]:
        """Rank 0 writes the final weights (``<run>/adapter``); the others wait for it, as for a checkpoint.

        Returns:
            On rank 0, the save check's metrics record (at ``step``) when one ran; else empty.

        Raises:
            RuntimeError: the write or its check failed, or took longer than ``trainer.save_timeout_s``.
        """
        write = partial(self.writer.save_final, self.weights, **self._gather(None, parallel.is_sharded(self.weights)))
        what = f"save the final weights to {self.run_dir / 'adapter'}"
        parallel.after_rank_zero(write, what, self.save_timeout_s, "trainer.save_timeout_s")
        return {"step": step, **self.writer.checked} if self.writer.checked else {}

    def resume(self, folder: Path | None) -> int | None:
        """Restore every part from ``folder``, the checkpoint ``find_checkpoint`` found for ``trainer.resume``.

        A checkpoint saved on another number of processes resumes when this run shares its micro-batches per step
        (``planned_for``): the weights and optimizer state are whole or resharded (FSDP2), the sampler takes the
        same place in the same plan, and the per-rank parts are shared out (``_restore_ranks``).

        Returns:
            The step the checkpoint was saved at, or None when there is nothing to resume (``folder`` None).

        Raises:
            CheckpointError: the checkpoint does not fit this run (world size, data order, model).
        """
        if folder is None:
            return None
        check_same_data_order(folder, self.fingerprint, self.env.world_size)  # find_checkpoint verified the files
        sharded = parallel.is_sharded(self.weights)
        check_same_strategy(folder, sharded)
        if sharded:
            parallel.load_shards(self.weights, self.shared["optimizer"], folder / SHARDED)
        else:
            load_trainable_weights(self.weights, folder / WEIGHTS)
        fresh = {name: part.state_dict() for name, part in self.per_rank.items()}
        fresh_shared = {name: part.state_dict() for name, part in self.shared.items()}
        manifest = read_manifest(folder)
        saved_world = int(manifest["world_size"])
        state = upgrade_state(load_state(folder), version_of(manifest), fresh, saved_world, fresh_shared)
        for name in state["missing"]:
            log.warning("%s keeps no %s: it starts afresh on resume", folder, name)
        for name, part in self._shared(sharded).items():
            part.load_state_dict(state[name])
        for name, part in self.per_rank.items():
            _restore_ranks(part, state[name], self.env.rank, self.env.world_size)
        adopt = partial(self.writer.adopt_best, folder.parent.parent, self.best.best_step)
        parallel.after_rank_zero(adopt, "carry best/ over", self.save_timeout_s, "trainer.save_timeout_s")
        log.info("resumed from %s at step %d (epoch %d)", folder, state["step"], state["sampler"]["epoch"])
        if saved_world != self.env.world_size:
            log.info(
                "%s was saved by %s and resumes on %d: the same micro-batches each step; a rank past the saved "
                "ones draws dropout masks of its own",
                folder, _processes(saved_world), self.env.world_size,
            )  # fmt: skip
        if folder.parent.parent.resolve() == self.run_dir.resolve():  # resumed into another folder: none in this one
            self.saved_step = state["step"]
        return state["step"]


def _restore_ranks(part: Stateful, saved: list[dict[str, Any]], rank: int, world_size: int) -> None:
    """Restore this rank's per-rank ``part`` from every saved rank's: its own on the same number of processes. On
    another, a part that knows how to share them out does (the log window: ``load_saved_ranks``); any other takes
    the saved rank of its own number (the RNG streams), or on more processes than saved keeps its fresh state."""
    if len(saved) == world_size:
        part.load_state_dict(saved[rank])
    elif hasattr(part, "load_saved_ranks"):
        part.load_saved_ranks(saved, rank, world_size)
    elif rank < len(saved):
        part.load_state_dict(saved[rank])


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


def check_same_strategy(folder: Path, sharded: bool) -> None:
    """Refuse a checkpoint of the other strategy: a sharded one (FSDP2) keeps its optimizer state in ``sharded/``.

    Raises:
        CheckpointError: naming the strategy each side uses and the way out.
    """
    if (folder / SHARDED).is_dir() == sharded:
        return
    saved, running = ("fsdp2", "ddp") if not sharded else ("ddp", "fsdp2")
    raise CheckpointError(
        f"{folder} was saved by a parallel.strategy={saved} run and this one is parallel.strategy={running}: its "
        f"optimizer state is not in the form this run reads. Resume with parallel.strategy={saved}, or start a new "
        f"run from its weights ({folder / WEIGHTS}) with trainer.resume=none."
    )


def check_same_data_order(folder: Path, fingerprint: Fingerprint, world_size: int) -> None:
    """Refuse a checkpoint saved with settings that would feed other samples to the remaining steps (``world_size``:
    this run's processes, for the fix the error names).

    Raises:
        CheckpointError: naming every setting that changed (as the user sets it), old and new.
    """
    saved = read_manifest(folder)["data_order"]
    changed = fingerprint.changes_from(saved)
    if changed:
        details = ", ".join(changed)
        raise CheckpointError(
            f"{folder} was saved with a different data order ({details}); resuming would silently train on "
            "other samples. Resume with the same data.*, trainer.seed and micro-batches per step "
            f"({_same_step(saved, world_size)}), or set trainer.resume=none to start over."
        )


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _same_step(saved: dict[str, Any], world: int) -> str:
    """The saved plan's micro-batches per step, and how a run on ``world`` processes keeps them: the
    optim.grad_accum_steps that does, or the process counts that can."""
    saved_world, saved_accum = int(saved["world_size"]), int(saved["grad_accum_steps"])
    per_step = saved_world * saved_accum
    was = f"saved: {_processes(saved_world)} x optim.grad_accum_steps={saved_accum}"
    if per_step % world == 0:
        return f"{was}; on {_processes(world)}: optim.grad_accum_steps={per_step // world}"
    counts = [str(n) for n in range(1, per_step + 1) if per_step % n == 0]
    return f"{was} = {per_step}, which {_processes(world)} cannot split: run {', '.join(counts)} processes"


def planned_for(folder: Path | None, env: DistEnv) -> tuple[int, int] | None:
    """The ``(world_size, grad_accum_steps)`` the data plan of the checkpoint in ``folder`` was made for, when it
    was saved on another number of processes than this run's (``env``): the run trains that plan, dealt to its
    own ranks, if it shares its micro-batches per step (``data.build_training_data``; else the data-order check
    refuses the checkpoint, naming the optim.grad_accum_steps that would). None: no checkpoint, or the same number."""
    if folder is None:
        return None
    saved = read_manifest(folder)["data_order"]
    layout = (int(saved["world_size"]), int(saved["grad_accum_steps"]))
    return None if layout[0] == env.world_size else layout


# ----------------------------------------------------------------------------- writing


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
    from ddptrain.evaluation.save_check import SaveChecks, build_save_checks  # it imports the checkpoint's files

    check: SaveChecks | None = None
    if env.is_rank_zero:
        m = files.model_cfg
        base = base_model_path(m, run_dir) if m.lora else None
        on_gpu, attn, pad_id = env.device.type == "cuda", m.attn_implementation.value, files.tokenizer.pad_token_id
        dtype = TORCH_DTYPES[m.dtype]
        check = build_save_checks(cfg.save_check, weights, base, dtype, attn, probe_rows, pad_id, on_gpu)
    writer = build_writer(env.is_rank_zero, run_dir, cfg.keep_last_n, files=files, rule=best.rule, check=check)
    checkpointer = Checkpointer(
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
    checkpointer.saved_dtype = None if files.model_cfg.lora else TORCH_DTYPES[files.model_cfg.dtype]
    return checkpointer
