"""``objective.reference=precomputed``: the reference's reply log-probabilities, computed once before training.

Every pair of the train and eval sets goes through the base model (the LoRA adapter switched off, eval mode, no
gradients, under the run's autocast) once, before the first step and before a resumed run loads its checkpoint, so
a full fine-tune's reference is its weights before training too. Each rank computes its share: the eval plan's
batches of neighbours by length, every pair on exactly one rank, the ranks' padded tokens balanced, the same batches
whatever the number of ranks. One all-reduce of the [pairs, 2] table (each pair's entries are zero on every rank but
one: the sum is exact) gives every rank all of it, and the step then reads each pair's values from its batch.

The table is cached beside the tokenized data, under a key of the tokenized rows and of everything that fixes the
base model's numbers (its weight files and configs, the architecture as built, a Hub snapshot, dtype, attention
kernel, head chunking, the autocast precision, the seed of a random start, model.base_adapter's files, the device
and its TF32 setting, sharding, the torch and transformers versions), not of the LoRA settings, β or the loss type:
a sweep over those computes it once. A run that finds the file on every rank reads it; where any rank misses it (a
cache on local disks) or cannot read it, every rank computes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ddptrain import parallel
from ddptrain.config import DType, ModelConfig, ModelInit, Objective, ObjectiveConfig, Reference
from ddptrain.data.collate import Collator, RowsDataset
from ddptrain.data.encode import RANK_ZERO_ONLY
from ddptrain.data.plan import eval_batch_plan
from ddptrain.model.precision import autocast
from ddptrain.process import hangs

if TYPE_CHECKING:
    import datasets

    from ddptrain.data import TrainingData
    from ddptrain.parallel import DistEnv

log = logging.getLogger(__name__)

CACHE_VERSION = "1"  # bump when the computation changes, so old tables are not reused
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def precompute_reference(
    objective: ObjectiveConfig,
    model_cfg: ModelConfig,
    seed: int,
    precision: DType,
    loss_module: nn.Module,
    data: TrainingData,
    env: DistEnv,
) -> None:
    """Give every batch of ``data`` its pairs' reference log-probabilities (``TrainingData.use_reference``), read
    from the cache or computed; nothing unless objective=dpo with objective.reference=precomputed. Every rank calls
    it (collectives), after the weights are on the device and before a checkpoint is resumed."""
    if objective.name != Objective.dpo or objective.reference != Reference.precomputed:
        return
    hangs.board.enter("reference")  # a hang report names the precomputation
    model_key = _model_key(model_cfg, seed, precision) | _numerics_key(loss_module, env)
    tables = []
    for name, rows in (("train", data.train), ("eval", data.eval)):
        if rows is None or len(rows) == 0:
            tables.append(None)
            continue
        started = time.monotonic()
        table, cache = _cached(rows, model_key, env)
        how = f"read from {cache}" if table is not None else ""
        if table is None:
            table = reference_table(loss_module, rows, data.eval_collator, data.eval_micro_batch_size, precision, env)
            how = _write(table, cache, env)
        tables.append(table)
        log.info(
            "reference: the %s set's %s pairs' log-probabilities %s in %.1f s",
            name,
            f"{len(rows):,}",
            how,
            time.monotonic() - started,
            extra=RANK_ZERO_ONLY,
        )
    data.use_reference(*tables)


def reference_table(
    loss_module: nn.Module,
    rows: datasets.Dataset,
    collate: Collator,
    micro_batch_size: int,
    precision: DType,
    env: DistEnv,
) -> torch.Tensor:
    """Each pair's reference log-probabilities, chosen and rejected ([pairs, 2], float64 holding fp32 values):
    this rank's share computed (``eval_batch_plan``), every rank's summed (a collective)."""
    table = torch.zeros(len(rows), 2, dtype=torch.float64)
    dataset = RowsDataset(rows)
    plan = eval_batch_plan(rows["length"], micro_batch_size, env.world_size)  # every rank's: the same on each
    mine = plan[env.rank]
    # FSDP2: each forward all-gathers every layer from every rank, so a rank with fewer batches repeats one, unused.
    rounds = max(len(batches) for batches in plan) if parallel.is_sharded(loss_module) else len(mine)
    for k in range(rounds):
        indices = mine[k] if k < len(mine) else (mine or plan[0])[-1]
        batch = {key: t.to(env.device) for key, t in collate([dataset[(i,)] for i in indices]).items()}
        with autocast(precision, env.device):  # the loss module's forward: FSDP2 gathers its root's weights there
            logps = loss_module(**batch, reference_only=True)
        if k < len(mine):
            table[indices] = logps.double().cpu().view(2, -1).T  # chosen rows, then rejected rows
    return parallel.all_reduce_sum(table.to(env.device)).cpu()


def _model_key(cfg: ModelConfig, seed: int, precision: DType) -> dict[str, object]:
    """What fixes the base model's log-probabilities: not the LoRA settings (switched off), not checkpointing."""
    key: dict[str, object] = {
        "name_or_path": cfg.name_or_path,
        "init": cfg.init.value,
        "dtype": cfg.dtype.value,
        "attention": cfg.attn_implementation.value,
        "loss_chunk_tokens": cfg.loss_chunk_tokens,
        "liger_kernel": cfg.liger_kernel,
        "precision": precision.value,
    }
    if cfg.init == ModelInit.random:
        key |= {"seed": seed, "config_path": cfg.config_path}
    if cfg.init == ModelInit.pretrained:  # weights edited in place: another key
        key["weights"] = _weight_files(cfg.name_or_path)
    if cfg.base_adapter is not None:  # merged into the base: the reference is the model that adapter trained
        key |= {"base_adapter": str(Path(cfg.base_adapter).resolve()), "adapter": _weight_files(cfg.base_adapter)}
    return key


def _weight_files(name_or_path: str) -> list[tuple[str, int, int]]:
    """A local folder's weight files and configs (name, size, modification time); nothing for a Hub id."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        return []
    return sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in folder.iterdir()
        if f.suffix in WEIGHT_SUFFIXES or f.name in ("config.json", "adapter_config.json")
    )


def _numerics_key(loss_module: nn.Module, env: DistEnv) -> dict[str, object]:
    """What else fixes the numbers, read off the built model and this process: the architecture as built (a
    config.json edited in place), the Hub snapshot it came from, the device and its fp32 matmuls, sharding (FSDP2
    computes in its gather dtype, which the keyed precision and dtype fix), and the libraries' versions."""
    import transformers

    config = loss_module.decoder.config
    architecture = hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
    cuda = env.device.type == "cuda"
    return {
        "architecture": architecture,
        "snapshot": getattr(config, "_commit_hash", None),
        "device": env.device.type,
        "tf32": cuda and torch.backends.cuda.matmul.allow_tf32,
        "sharded": parallel.is_sharded(loss_module),
        "versions": [torch.__version__, transformers.__version__],
    }


def _cached(
    rows: datasets.Dataset, model_key: dict[str, object], env: DistEnv
) -> tuple[torch.Tensor | None, Path | None]:
    """The cached table of ``rows`` under this model where every rank has it, and where it lives (None: the rows
    are not cached on disk, nor is the table)."""
    cache = _cache_path(rows, model_key)
    table = None
    if cache is not None and cache.is_file():
        try:
            loaded = torch.load(cache, map_location="cpu", weights_only=True)
            table = loaded if torch.is_tensor(loaded) and loaded.shape == (len(rows), 2) else None
        except Exception as err:  # a torn or foreign file: computed again (a rank that raised would hang the others)
            log.warning("reference: %s cannot be read (%s): computing the table again", cache, err)
            table = None
    missing = parallel.all_reduce_sum(torch.tensor([float(table is None)], device=env.device))
    return (table if missing.item() == 0 else None), cache


def _cache_path(rows: datasets.Dataset, model_key: dict[str, object]) -> Path | None:
    """Beside the tokenized rows' cache file, named by a key of the rows and the model."""
    if not rows.cache_files:
        return None
    key = json.dumps([CACHE_VERSION, rows._fingerprint, len(rows), model_key], sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return Path(rows.cache_files[0]["filename"]).parent / f"reference-logps-{digest}.pt"


def _write(table: torch.Tensor, cache: Path | None, env: DistEnv) -> str:
    """Rank 0 writes the table (atomically: a reader never sees half of it); how the log line says it came."""
    if cache is None:
        return "computed (the data is not cached on disk: neither is the table)"
    if not env.is_rank_zero:
        return f"computed and cached at {cache}"
    partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")
    try:
        torch.save(table, partial)
        os.replace(partial, cache)
    except OSError as err:  # a full or read-only cache: the run has its table, the next one computes it again
        log.warning("reference: the table could not be cached at %s (%s)", cache, err)
        return "computed (not cached: the cache folder could not be written)"
    return f"computed and cached at {cache}"
