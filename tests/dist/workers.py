"""Module-level entrypoints for 2-process tests (spawned processes import them by name).

Each runs the real product code on one rank and writes what the test checks to files in
the run directory: results come back through files, not through the launcher.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ddptrain import parallel
from ddptrain.config import RunConfig
from ddptrain.metrics import setup_logging
from ddptrain.trainer import Trainer

PROBE_TEXT = "### Instruction:\nGive three tips for staying healthy.\n\n### Response:\n1. Eat well."


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def train_and_record(cfg: RunConfig, run_dir: str, store_port: int) -> None:
    """Train with the real Trainer, recording per step which LoRA grads are non-zero and a digest of
    every trainable parameter; record this rank's sample indices for epochs 0 and 1; save probe logits."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, None)
        trainer = Trainer(cfg, env, Path(run_dir))
        epochs = {}
        for epoch in (0, 1):
            trainer.sampler.set_epoch(epoch)
            epochs[epoch] = [i for batch in trainer.sampler for row in batch for i in row]
        dropped = trainer.sampler.dropped
        trainer.sampler.set_epoch(0)

        trainable = {n: p for n, p in trainer.loss_module.named_parameters() if p.requires_grad}
        nonzero_grads: list[list[str]] = []
        digests: list[dict[str, str]] = []

        def before_step(optimizer, args, kwargs):
            nonzero_grads.append(sorted(n for n, p in trainable.items() if p.grad is not None and p.grad.any()))

        def after_step(optimizer, args, kwargs):
            digests.append({n: _digest(p) for n, p in trainable.items()})

        trainer.optimizer.register_step_pre_hook(before_step)
        trainer.optimizer.register_step_post_hook(after_step)
        last = trainer.fit()

        record = {
            "epochs": epochs,
            "dropped": dropped,
            "dataset_size": len(trainer.data.train),
            "nonzero_grads": nonzero_grads,
            "digests": digests,
            "trainable": sorted(trainable),
            "last": last,
        }
        (Path(run_dir) / f"rank{env.rank}.json").write_text(json.dumps(record))
        if env.is_rank_zero:
            ids = trainer.tokenizer(PROBE_TEXT, return_tensors="pt").input_ids
            trainer.loss_module.eval()
            with torch.no_grad():
                logits = trainer.loss_module.full_logits(ids)
            torch.save({"input_ids": ids, "logits": logits}, Path(run_dir) / "probe.pt")
    finally:
        parallel.teardown()
