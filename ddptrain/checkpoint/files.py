"""A checkpoint's files: folders written atomically, the manifest that lists every file with its SHA-256, finding
and verifying a complete checkpoint, and loading its weights and state safely (safetensors, ``weights_only``).

``checkpoint`` decides what a checkpoint holds and when it is written; this module knows how the files are laid
out and read, for the checkpointer, the export and the tests alike (``checkpoint`` re-exports every name).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedTokenizerBase

from ddptrain.checkpoint.format import FORMAT_VERSION, VERSION_KEY, upgrade_manifest
from ddptrain.config import ModelConfig, ModelInit
from ddptrain.model import point_adapter_at_base, save_random_base

log = logging.getLogger("ddptrain.checkpoint")

MANIFEST = "manifest.json"
STATE = "trainer_state.pt"
WEIGHTS = "weights"
SHARDED = "sharded"
"""A sharded model's checkpoint (FSDP2): every rank's shards of the trainable weights and of the optimizer state, as
``torch.distributed.checkpoint`` writes them (``parallel.fsdp.save_shards``)."""
STEP_DIR = re.compile(r"^step-(\d+)$")
KNOWN_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers
BEST, BEST_FILE = "best", "best.json"
"""``<run>/best/``: the best checkpoint's weights (``trainer.best_metric``), and the file naming its step."""
ADAPTER_CONFIG = "adapter_config.json"  # what peft writes beside an adapter, and a full model's folder lacks


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this run."""


# ----------------------------------------------------------------------------- writing a folder


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


def sha256_file(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes, hex: what a manifest lists for each file."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path, meta: dict[str, Any]) -> None:
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    manifest = {VERSION_KEY: FORMAT_VERSION, **meta, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


# ----------------------------------------------------------------------------- what an adapter carries


@dataclass(frozen=True)
class AdapterFiles:
    """What a saved adapter carries beside its weights, so that plain peft loads it anywhere: the tokenizer, and the
    base model named in its ``adapter_config.json`` (``<run>/base`` for a random-init model, written at the first
    save)."""

    tokenizer: PreTrainedTokenizerBase
    model_cfg: ModelConfig
    seed: int

    def write(
        self,
        model: nn.Module,
        folder: Path,
        run_dir: Path,
        with_tokenizer: bool,
        whole: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The weights as ``save_pretrained`` writes them (an adapter points at its base), and the tokenizer;
        ``whole``: the tensors to write, by ``state_dict`` key, where the model's own are shards (FSDP2)."""
        # A copy: transformers' save_pretrained takes keys out of the dict it is given, and the check reads it next.
        model.save_pretrained(folder, safe_serialization=True, state_dict=None if whole is None else dict(whole))
        if self.model_cfg.lora:
            point_adapter_at_base(folder, base_model_path(self.model_cfg, run_dir))
        if with_tokenizer:
            self.tokenizer.save_pretrained(folder)

    def ensure_base(self, run_dir: Path) -> None:
        """The base of a random-init LoRA run, or of one with model.base_adapter merged in, in ``<run>/base``, once:
        the adapters saved from it load onto it."""
        cfg = self.model_cfg
        if _base_in_run(cfg) and cfg.lora and not (run_dir / "base" / "config.json").is_file():
            atomic_save_dir(run_dir / "base", lambda tmp: save_random_base(cfg, self.seed, self.tokenizer, tmp))


def base_model_path(model_cfg: ModelConfig, run_dir: Path) -> str:
    """The base a run's adapters load onto: ``<run>/base`` for a random-init model or one with model.base_adapter
    merged in, else ``model.name_or_path``."""
    if _base_in_run(model_cfg):
        return str((run_dir / "base").resolve())
    return model_cfg.name_or_path


def _base_in_run(model_cfg: ModelConfig) -> bool:
    """Whether no folder but the run's own ``base/`` holds the base its adapters load onto."""
    return model_cfg.init == ModelInit.random or model_cfg.base_adapter is not None


def what_it_holds(folder: Path) -> str:
    """How messages name a saved folder: "adapter" (a peft adapter) or "weights" (a full fine-tune's model)."""
    return "adapter" if (folder / ADAPTER_CONFIG).is_file() else "weights"


def what_the_run_saved(run_dir: Path) -> str:
    """``what_it_holds`` of a run's ``best/``, else its ``adapter/``, else its newest checkpoint ("weights" when it
    saved nothing yet). Every folder of a run holds the same kind: no file is hashed to tell which."""
    checkpoints = sorted((run_dir / "checkpoints").glob(f"step-*/{WEIGHTS}"), reverse=True)
    for folder in (run_dir / BEST, run_dir / "adapter", *checkpoints):
        if folder.is_dir():
            return what_it_holds(folder)
    return "weights"


# ----------------------------------------------------------------------------- the best weights


def best_step_in(run_dir: Path) -> int | None:
    """The step ``<run_dir>/best/`` holds (its ``best.json``), or None."""
    try:
        return int(json.loads((run_dir / BEST / BEST_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


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
        if not path.is_file() or path.stat().st_size != info["bytes"] or sha256_file(path) != info["sha256"]:
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
        loaded = weights.keys() - set(result.unexpected_keys)
        missing = untied(model.state_dict(keep_vars=True), result.missing_keys, loaded)
        unexpected = sorted(result.unexpected_keys)
    if missing or unexpected:
        raise CheckpointError(
            f"{folder} does not fit this model: missing {_few(missing)}; unexpected {_few(unexpected)}. "
            "It was saved with other model.* or model.lora_* settings: use the ones in its run's config.yaml, "
            "or set trainer.resume=none to start over."
        )


def _storage(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """Where a tensor's elements are: two keys with the same place hold one tensor (a tied weight)."""
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


def tied_groups(tensors: dict[str, torch.Tensor]) -> set[frozenset[str]]:
    """The sets of keys of ``tensors`` (a ``state_dict``) that name one tensor: a tied LM head and its embedding."""
    by_place: dict[tuple, set[str]] = {}
    for key, tensor in tensors.items():
        by_place.setdefault(_storage(tensor), set()).add(key)
    return {frozenset(keys) for keys in by_place.values() if len(keys) > 1}


def untied(tensors: dict[str, torch.Tensor], missing: list[str], present: set[str]) -> list[str]:
    """The keys of ``missing`` that are not tied to a key of ``present`` (sorted).

    ``save_pretrained`` leaves a tied weight out (``lm_head.weight`` where the head is the input embedding, as in
    the bundled model and Qwen2.5-0.5B): loading the key it shares its storage with loads it too. A missing key
    that shares no storage with a loaded one would keep its initial values: that one is really missing.

    Args:
        tensors: the model's ``state_dict(keep_vars=True)`` (every key, tied ones included).
        missing: keys of ``tensors`` the saved weights lack.
        present: keys of ``tensors`` the saved weights hold.
    """
    places = {_storage(tensors[key]) for key in present if key in tensors}
    return sorted(key for key in missing if _storage(tensors[key]) not in places)


def _few(keys: list[str]) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def load_state(folder: Path) -> dict[str, Any]:
    """The trainer state (optimizer, schedule, scaler, position, RNG), loaded with ``weights_only=True``."""
    return torch.load(folder / STATE, map_location="cpu", weights_only=True)
