"""2-rank entrypoint of ``test_presets.py``: one process group trains one step of every preset in turn."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

from ddptrain import parallel
from ddptrain.config import RunConfig
from ddptrain.observe.console import setup_logging
from ddptrain.trainer import Trainer


def train_each_preset(cfg: RunConfig, run_dir: str, store_port: int | None) -> dict:
    """For each ``presets/<name>.yaml`` in the run folder: a Trainer on that config, ``fit()`` (one step), and the
    first training row as the data pipeline made it. Returns rank 0's, by preset."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    results = {}
    try:
        setup_logging(env.rank, None)
        for saved in sorted(Path(run_dir, "presets").glob("*.yaml")):
            preset_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(saved)))
            (out := Path(run_dir, saved.stem)).mkdir(exist_ok=True)
            trainer = Trainer(preset_cfg, env, out)
            last = trainer.fit()
            row = trainer.data.train[0]
            trained = {n: p.detach() for n, p in trainer.loss_module.named_parameters() if p.requires_grad}
            digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in trained.values())).hexdigest()
            moved = sum(int(p.any()) for n, p in trained.items() if "lora_B" in n)  # every lora_B starts at 0
            lora_b = sum("lora_B" in n for n in trained)
            (out / f"rank{env.rank}.json").write_text(json.dumps({"digest": digest, "moved": moved, "lora_B": lora_b}))
            results[saved.stem] = {"last": last, "input_ids": list(row["input_ids"]), "labels": list(row["labels"])}
    finally:
        parallel.teardown()
    return results
