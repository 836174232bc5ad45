"""The 2-rank runs of tests/distributed/test_fsdp2.py: the real Trainer under either strategy, and what each rank
held and trained, written to files (results come back through files, not through the launcher)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from ddptrain import parallel
from ddptrain.config import RunConfig
from ddptrain.observe.console import setup_logging
from ddptrain.trainer import Trainer
from tests.distributed.workers import whole


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the storages behind ``tensors`` on this rank (a storage shared by several counted once)."""
    storages = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def train_and_report(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Train as the config says; then every rank writes ``rank{N}.json``: the bytes it holds for the parameters,
    their gradients and the optimizer states (measured from the tensors), and a digest of its own part of each
    trainable parameter; rank 0 also writes ``params.pt``, every trainable parameter whole (gathered)."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, None)
        trainer = Trainer(cfg, env, Path(run_dir))
        grads = []
        trainer.optimizer.register_step_pre_hook(  # the step's gradients, before the next step frees them
            lambda *_: grads.__setitem__(slice(None), [p.grad for p in trainer.trainable if p.grad is not None])
        )
        trainer.fit()
        named = dict(trainer.loss_module.model.named_parameters())
        states = [t for state in trainer.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        report = {
            "params_bytes": held_bytes(list(named.values())),
            "grads_bytes": held_bytes(grads),
            "optimizer_bytes": held_bytes([t for t in states if t.dim() > 0]),
            "digests": {
                name: hashlib.sha256(_local(p).detach().contiguous().numpy().tobytes()).hexdigest()
                for name, p in named.items()
                if p.requires_grad
            },
        }
        gathered = dict(zip(named, whole(named.values())))  # every rank: FSDP2 gathers each whole
        (Path(run_dir) / f"rank{env.rank}.json").write_text(json.dumps(report))
        if env.is_rank_zero:
            torch.save({n: t for n, t in gathered.items() if named[n].requires_grad}, Path(run_dir) / "params.pt")
    finally:
        parallel.teardown()


def _status_bytes(key: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, from /proc, in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(f"{key}:"))
    return int(line.split()[1]) * 1024


def start_and_report(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Build the Trainer (the run's start: data, model, sharding, weights) and nothing more; every rank writes
    ``start{N}.json``: how far its peak resident memory rose above where it stood before (the peak reset first:
    ``clear_refs`` 5), the bytes of its parameters (the storages it holds), and the whole model's parameter bytes."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, None)
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_bytes("VmRSS")
        trainer = Trainer(cfg, env, Path(run_dir))
        peak = _status_bytes("VmHWM")
        params = list(trainer.loss_module.parameters())
        report = {
            "peak_growth": peak - before,
            "held_bytes": held_bytes(params),
            "model_bytes": sum(p.numel() * p.element_size() for p in params),
        }
        (Path(run_dir) / f"start{env.rank}.json").write_text(json.dumps(report))
    finally:
        parallel.teardown()
