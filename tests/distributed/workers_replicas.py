"""2-rank workers for the start-up replica check (spawned processes import them by name)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ddptrain import parallel
from ddptrain import trainer as trainer_module
from ddptrain.config import RunConfig
from ddptrain.observe.console import setup_logging


def train_with_rank1_frozen_weight_changed(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """The real Trainer, but rank 1's copy of one frozen base weight differs by one element (as a
    node reading other model files would): DDP no longer broadcasts the weights, so the check must
    stop the run before training."""
    _train_with_rank1_drift(
        cfg, run_dir, store_port, lambda module: next(p for p in module.parameters() if not p.requires_grad)
    )


def _train_with_rank1_drift(cfg: RunConfig, run_dir: str, store_port: int | None, pick: Callable) -> None:
    """Train, with the tensor ``pick(model)`` returns nudged on rank 1; record each rank's error."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    real_build_model = trainer_module.build_model

    def build_model_with_drift(*args, **kwargs):
        module = real_build_model(*args, **kwargs)
        if env.rank == 1:
            with torch.no_grad():
                pick(module).view(-1)[0] += 1e-3
        return module

    trainer_module.build_model = build_model_with_drift
    try:
        setup_logging(env.rank, None)
        try:
            trainer_module.Trainer(cfg, env, Path(run_dir)).fit()
        except RuntimeError as err:
            (Path(run_dir) / f"error{env.rank}.txt").write_text(str(err))
            raise
        (Path(run_dir) / f"trained{env.rank}.txt").write_text("no error")
    finally:
        parallel.teardown()


def record_startup_broadcast(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Build the real Trainer (DDP included) and record the bytes DDP's start-up sync would broadcast."""
    import json

    import torch.nn.parallel.distributed as ddp_module

    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    broadcast: list[int] = []
    real_sync = ddp_module._sync_module_states

    def recording_sync(module, *args, **kwargs):
        broadcast.append(sum(p.numel() * p.element_size() for p in module.parameters()))
        return real_sync(module, *args, **kwargs)

    ddp_module._sync_module_states = recording_sync
    try:
        setup_logging(env.rank, None)
        trainer = trainer_module.Trainer(cfg, env, Path(run_dir))
        total = sum(p.numel() * p.element_size() for p in trainer.loss_module.parameters())
        (Path(run_dir) / f"broadcast{env.rank}.json").write_text(json.dumps({"broadcast": broadcast, "model": total}))
    finally:
        parallel.teardown()


def train_with_rank1_buffer_changed(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """As above, but rank 1's rotary frequencies differ: DDP does not re-send buffers every step
    (parallel.broadcast_buffers=false), so the start-up check must cover buffers too."""
    _train_with_rank1_drift(
        cfg, run_dir, store_port, lambda module: next(b for b in module.buffers() if b.is_floating_point())
    )


def record_buffer_broadcasts(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Train with the real Trainer, counting DDP's buffer broadcasts (its coalesced broadcast) during fit."""
    import json

    import torch.distributed as dist

    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    calls: list[int] = []
    real_broadcast = dist._broadcast_coalesced

    def counting_broadcast(*args, **kwargs):
        calls.append(1)
        return real_broadcast(*args, **kwargs)

    try:
        setup_logging(env.rank, None)
        trainer = trainer_module.Trainer(cfg, env, Path(run_dir))
        dist._broadcast_coalesced = counting_broadcast
        trainer.fit()
        (Path(run_dir) / f"broadcasts{env.rank}.json").write_text(json.dumps(len(calls)))
    finally:
        dist._broadcast_coalesced = real_broadcast
        parallel.teardown()
