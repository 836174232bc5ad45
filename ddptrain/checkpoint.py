"""Checkpoints: written by global rank 0 atomically, found and verified on resume, loaded safely.

A checkpoint is a folder ``<run>/checkpoints/step-00000020/`` holding

- ``weights/``: the trainable weights as ``save_pretrained`` writes them (a peft adapter in
  safetensors, or the full model for a full fine-tune), from the unwrapped model;
- ``trainer_state.pt``: optimizer, LR schedule, GradScaler, step, data position, the partial
  logging window and the RNG states of every rank (plain tensors and numbers: it loads with
  ``torch.load(weights_only=True)``);
- ``manifest.json``, written last: step, epoch, data position, world size, the settings that
  fix the data order, and every file with its size and SHA-256.

The folder is written under a temporary name, flushed, and renamed into place; a folder
without a complete, matching manifest is never loaded. ``latest`` names the newest one, and
only the last ``trainer.keep_last_n`` are kept.

``Checkpointer`` decides what a checkpoint holds: the trainer hands it its stateful parts (each
with ``state_dict``/``load_state_dict``) and the data-order fingerprint; it gathers the per-rank
parts, has rank 0 write (ranks other than 0 hold a writer that does nothing) while the others wait for it
through the store, up to ``trainer.save_timeout_s`` (not a collective bounded by ``parallel.timeout_s``: a
save takes as long as the storage needs), and on resume checks that the checkpoint fits the run before
restoring every part.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedTokenizerBase

from ddptrain import parallel
from ddptrain.checkpoint_format import FORMAT_VERSION, VERSION_KEY, upgrade_manifest, upgrade_state, version_of
from ddptrain.config import ModelConfig, ModelInit
from ddptrain.model import point_adapter_at_base, save_random_base
from ddptrain.parallel import DistEnv
from ddptrain.rng import RNGState

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE = "trainer_state.pt"
WEIGHTS = "weights"
STEP_DIR = re.compile(r"^step-(\d+)$")
KNOWN_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this run."""


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
        keep_last_n: ``trainer.keep_last_n``.
        save_timeout_s: ``trainer.save_timeout_s``: how long the other ranks wait for rank 0 to write.
        weights: the model whose trainable weights are saved (the peft model, unwrapped).
        shared: parts equal on every rank (optimizer, scheduler, scaler, sampler), saved once.
        per_rank: parts that differ by rank (the log window); each rank's copy is saved and
            restored to the same rank. The RNG states are always added.
        fingerprint: the settings that fix which samples each step sees (``data.DataOrder``): its
            ``values`` go into the manifest, and ``changes_from(saved)`` names what a resume would change.
    """

    def __init__(
        self,
        env: DistEnv,
        run_dir: Path,
        keep_last_n: int,
        save_timeout_s: float,
        *,
        weights: nn.Module,
        shared: dict[str, Stateful],
        per_rank: dict[str, Stateful],
        fingerprint: Fingerprint,
    ):
        self.env, self.run_dir, self.weights = env, run_dir, weights
        self.save_timeout_s = save_timeout_s
        self.shared = shared
        self.per_rank = {**per_rank, "rng": RNGState()}
        self.fingerprint = fingerprint
        self.writer = build_writer(env.is_rank_zero, run_dir, keep_last_n)

    def save(self, step: int) -> None:
        """Every rank contributes its per-rank parts; rank 0 writes; the others wait for it (``after_rank_zero``).

        Raises:
            RuntimeError: the write failed, on rank 0 or as rank 0 told the others (the previous checkpoint is
                intact and named), or took longer than ``trainer.save_timeout_s``.
        """
        gathered = {name: parallel.all_gather_object(part.state_dict()) for name, part in self.per_rank.items()}
        state = {"step": step, **{name: part.state_dict() for name, part in self.shared.items()}, **gathered}
        meta = {
            "step": step,
            **state["sampler"],
            "world_size": self.env.world_size,
            "data_order": self.fingerprint.values,
        }
        try:
            write = partial(self.writer.save, self.weights, state, meta)
            what = f"save the checkpoint of step {step}"
            parallel.after_rank_zero(write, what, self.save_timeout_s, "trainer.save_timeout_s")
        except Exception as err:
            previous = newest_complete(self.run_dir / "checkpoints")
            raise RuntimeError(
                f"saving the checkpoint of step {step} failed: {type(err).__name__}: {err}. "
                f"The previous checkpoint is intact: {previous or 'none yet'}. "
                f"Free space in {self.run_dir} or point trainer.output_dir at a writable disk, and resume with "
                f"trainer.resume={self.run_dir}."
            ) from err

    def save_final(self, tokenizer: PreTrainedTokenizerBase, model_cfg: ModelConfig, seed: int) -> None:
        """Rank 0 writes ``<run>/adapter`` (and a random base); the others wait for it, as for a checkpoint.

        Raises:
            RuntimeError: the write failed, or took longer than ``trainer.save_timeout_s``.
        """
        write = partial(self.writer.save_final, self.weights, tokenizer, model_cfg, seed)
        what = f"save the final weights to {self.run_dir / 'adapter'}"
        parallel.after_rank_zero(write, what, self.save_timeout_s, "trainer.save_timeout_s")

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
        state = upgrade_state(load_state(folder), version_of(read_manifest(folder)), fresh, self.env.world_size)
        for name in state["missing"]:
            log.warning("%s keeps no per-rank %s: it starts afresh on resume", folder, name)
        for name, part in self.shared.items():
            part.load_state_dict(state[name])
        for name, part in self.per_rank.items():
            part.load_state_dict(state[name][self.env.rank])
        log.info("resumed from %s at step %d (epoch %d)", folder, state["step"], state["sampler"]["epoch"])
        return state["step"]


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


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def atomic_save_dir(target: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_dir)``, fsync, then rename tmp_dir to ``target`` (replacing an older one).

    If ``write`` raises, the temporary folder is removed and ``target`` is untouched.
    """
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        _fsync_tree(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path, meta: dict[str, Any]) -> None:
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    manifest = {VERSION_KEY: FORMAT_VERSION, **meta, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


class CheckpointWriter:
    """Writes checkpoints and the final adapter; used on global rank 0 only."""

    def __init__(self, run_dir: Path, keep_last_n: int):
        self.run_dir = run_dir
        self.folder = run_dir / "checkpoints"
        self.keep_last_n = keep_last_n

    def save(self, model: nn.Module, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write ``checkpoints/step-N`` (weights, trainer state, manifest last), point ``latest`` at it, prune.

        Raises:
            Exception: whatever the write raised; the previous checkpoints are untouched.
        """
        target = self.folder / f"step-{meta['step']:08d}"

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp / WEIGHTS, safe_serialization=True)
            torch.save(state, tmp / STATE)
            _write_manifest(tmp, meta)

        atomic_save_dir(target, write)
        latest_tmp = self.folder / ".latest.tmp"
        latest_tmp.write_text(target.name + "\n")
        latest_tmp.replace(self.folder / "latest")
        self._prune()
        log.info("saved checkpoint %s", target)
        return target

    def _prune(self) -> None:
        complete = sorted(p for p in self.folder.iterdir() if STEP_DIR.match(p.name))
        for old in complete[: max(0, len(complete) - self.keep_last_n)]:
            shutil.rmtree(old, ignore_errors=True)

    def save_final(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, model_cfg: ModelConfig, seed: int
    ) -> None:
        """``<run>/adapter`` with the tokenizer; a random-init base goes to ``<run>/base`` so the adapter loads."""
        random_lora = model_cfg.init == ModelInit.random and model_cfg.lora
        if random_lora:
            atomic_save_dir(self.run_dir / "base", lambda tmp: save_random_base(model_cfg, seed, tokenizer, tmp))

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if random_lora:
                point_adapter_at_base(tmp, str(self.run_dir / "base"))

        atomic_save_dir(self.run_dir / "adapter", write)
        log.info("saved the final weights to %s", self.run_dir / "adapter")


class NullCheckpointWriter:
    """What ranks other than 0 hold: every method does nothing."""

    def save(self, model: nn.Module, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Rank 0 writes the checkpoint; this rank waits for it (``parallel.after_rank_zero``)."""

    def save_final(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, model_cfg: ModelConfig, seed: int
    ) -> None:
        """Rank 0 writes the final adapter; this rank waits for it (``parallel.after_rank_zero``)."""


def build_writer(is_rank_zero: bool, run_dir: Path, keep_last_n: int) -> CheckpointWriter | NullCheckpointWriter:
    return CheckpointWriter(run_dir, keep_last_n) if is_rank_zero else NullCheckpointWriter()


# ----------------------------------------------------------------------------- finding and verifying


def read_manifest(folder: Path) -> dict[str, Any]:
    """A checkpoint's manifest, unchecked (for a folder that ``find_checkpoint`` already verified).

    Raises:
        CheckpointError: no manifest.
    """
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(
            f"{folder} has no {MANIFEST}: it is incomplete (interrupted save?) or not a checkpoint. Point "
            "trainer.resume at a complete checkpoints/step-N folder, or at the run directory (its newest complete one)."
        )
    return upgrade_manifest(json.loads(manifest_file.read_text()), folder)


def verify(folder: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint.

    Raises:
        CheckpointError: no manifest, or a listed file missing or changed.
    """
    manifest = read_manifest(folder)
    for name, info in manifest["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != info["bytes"] or _sha256(path) != info["sha256"]:
            raise CheckpointError(
                f"{folder}: {name} is missing or differs from the manifest; the checkpoint is corrupt. Resume "
                "from an older one (trainer.resume=<run>/checkpoints/step-N) or from the run directory, which "
                "takes its newest complete checkpoint."
            )
    return manifest


def newest_complete(checkpoints: Path) -> Path | None:
    """The newest checkpoint under ``checkpoints`` whose manifest verifies (older ones are tried in turn)."""
    if not checkpoints.is_dir():
        return None
    candidates = sorted((p for p in checkpoints.iterdir() if STEP_DIR.match(p.name)), reverse=True)
    for folder in candidates:
        try:
            verify(folder)
            return folder
        except CheckpointError as err:
            log.warning("skipping %s", err)
    return None


def find_checkpoint(resume: str, run_dir: Path) -> Path | None:
    """Resolve ``trainer.resume``: ``none``, ``auto`` (newest in this run, if any) or a path.

    A path may name a checkpoint folder or a run directory (its newest checkpoint is used).

    Raises:
        CheckpointError: a path that holds no usable checkpoint.
    """
    if resume == "none":
        return None
    if resume == "auto":
        return newest_complete(run_dir / "checkpoints")
    path = Path(resume).expanduser()
    if (path / MANIFEST).is_file():
        verify(path)
        return path
    found = newest_complete(path / "checkpoints") or newest_complete(path)
    if found is None:
        raise CheckpointError(
            f"trainer.resume={resume}: no complete checkpoint there. Point it at a checkpoints/step-N folder or a "
            "run directory, or use trainer.resume=auto|none."
        )
    return found


# ----------------------------------------------------------------------------- loading


def strip_known_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes other tools leave in keys."""
    clean = {}
    for key, value in state_dict.items():
        while key.startswith(KNOWN_PREFIXES):
            key = key.split(".", 1)[1]
        clean[key] = value
    return clean


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor in the folder's safetensors files (never unpickles anything).

    Raises:
        CheckpointError: no safetensors file in the folder.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder} holds no .safetensors weights: point at a checkpoint's weights/ folder or a run's adapter/ "
            "(ddptrain writes both with safetensors)."
        )
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return strip_known_prefixes(weights)


def load_trainable_weights(model: nn.Module, folder: Path) -> None:
    """Load saved trainable weights into ``model`` (a peft model, or a plain model for a full fine-tune).

    Raises:
        CheckpointError: naming missing and unexpected keys when the weights do not fit the model.
    """
    weights = read_weights(folder)
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, weights)
        expected = {n for n, p in model.named_parameters() if p.requires_grad}
        missing = sorted(expected & set(result.missing_keys))
        unexpected = sorted(result.unexpected_keys)
    else:
        result = model.load_state_dict(weights, strict=False)
        missing, unexpected = sorted(result.missing_keys), sorted(result.unexpected_keys)
    if missing or unexpected:
        raise CheckpointError(
            f"{folder} does not fit this model: missing {_few(missing)}; unexpected {_few(unexpected)}. "
            "It was saved with other model.* or model.lora_* settings: use the ones in its run's config.yaml, "
            "or set trainer.resume=none to start over."
        )


def _few(keys: list[str]) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def load_state(folder: Path) -> dict[str, Any]:
    """The trainer state (optimizer, schedule, scaler, position, RNG), loaded with ``weights_only=True``."""
    return torch.load(folder / STATE, map_location="cpu", weights_only=True)
