"""A 2-rank worker that trains through the real ``Trainer.fit`` and records what the loader really gave it.

Spawned processes import this module by name; results come back through files in the run directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddptrain import parallel
from ddptrain.config import RunConfig
from ddptrain.data import RowsDataset
from ddptrain.observe.console import setup_logging
from ddptrain.trainer import Trainer


def train_recording_batches(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Run ``fit`` over several epochs, recording for every micro-batch this rank trained on: the
    optimizer step it belongs to, the epoch, its sample indices, the samples' token lengths (as stored
    in the dataset rows) and the padded shape of the tensor handed to the model."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, Path(run_dir) if env.is_rank_zero else None)
        trainer = Trainer(cfg, env, Path(run_dir))
        fetched: list[tuple[int, ...]] = []
        batches: list[dict] = []
        real_getitem = RowsDataset.__getitem__

        def getitem(self, row):
            fetched.append(tuple(int(i) for i in row))
            return real_getitem(self, row)

        RowsDataset.__getitem__ = getitem
        collate = trainer.loader.collate_fn

        def recording_collate(rows):
            batch = collate(rows)
            # num_workers=0: the loader collates in this process just before the step that uses the batch.
            batches.append(
                {
                    "step": trainer.step + 1,
                    "epoch": trainer.sampler.epoch,
                    "samples": [i for row in fetched for i in row],
                    "real": sum(len(sample["input_ids"]) for row in rows for sample in row),
                    "padded": int(batch["input_ids"].numel()),
                }
            )
            fetched.clear()
            return batch

        trainer.loader.collate_fn = recording_collate
        trainer.fit()
        record = {"dataset_size": len(trainer.data.train), "batches": batches}
        (Path(run_dir) / f"batches-rank{env.rank}.json").write_text(json.dumps(record))
    finally:
        parallel.teardown()
