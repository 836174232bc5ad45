"""Entrypoints for tests/distributed/test_slow_saves.py: the product's worker, with rank 0's checkpoint writer held
past parallel.timeout_s, stuck past trainer.save_timeout_s, or failing as a full disk does. Only rank 0 holds a
``CheckpointWriter`` (the other ranks hold a null writer), so the patch acts on rank 0 alone."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any

from ddptrain.config import RunConfig

HOLD_S = 7.0
"""How long rank 0's first checkpoint write is held: longer than the test's parallel.timeout_s."""


def train_with_rank0_save_held(cfg: RunConfig, run_dir: str, store_port: int | None) -> Any:
    """Rank 0's first checkpoint write sleeps ``HOLD_S`` before it writes; ``held.json`` says which and how long."""
    from ddptrain import checkpoint, launch

    write = checkpoint.CheckpointWriter.save

    def held(self: checkpoint.CheckpointWriter, model: Any, state: dict, meta: dict, **kwargs: Any) -> Any:
        record = Path(run_dir) / "held.json"
        if not record.exists():
            started = time.monotonic()
            time.sleep(HOLD_S)
            record.write_text(json.dumps({"step": meta["step"], "held_s": time.monotonic() - started}))
        return write(self, model, state, meta, **kwargs)

    checkpoint.CheckpointWriter.save = held
    return launch.worker(cfg, run_dir, store_port)


def train_with_rank0_save_failing(cfg: RunConfig, run_dir: str, store_port: int | None) -> Any:
    """Rank 0's checkpoint writes fail as on a full disk (``failed_at`` holds when); the error each rank's training
    raised goes to ``error{rank}.txt``, as it leaves ``Trainer.fit``. (Written later, after the worker's cleanup,
    rank 0's was lost once under load: rank 1 had exited first and the agent had SIGTERMed rank 0 mid-cleanup.)"""
    from ddptrain import checkpoint, launch
    from ddptrain.trainer import Trainer

    def full_disk(self: checkpoint.CheckpointWriter, model: Any, state: dict, meta: dict, **kwargs: Any) -> None:
        (Path(run_dir) / "failed_at").write_text(repr(time.time()))
        raise OSError(errno.ENOSPC, "No space left on device (injected by the test)")

    checkpoint.CheckpointWriter.save = full_disk
    Trainer.fit = _recording_its_error(Trainer.fit, run_dir)
    return launch.worker(cfg, run_dir, store_port)


STUCK_S = 45.0
"""How long rank 0's checkpoint write is stuck: far past the test's trainer.save_timeout_s, and short enough that a
wait without a limit ends (the run then finishes, and the test fails) well within the test's own timeout."""


def train_with_rank0_save_stuck(cfg: RunConfig, run_dir: str, store_port: int | None) -> Any:
    """Rank 0's checkpoint write sleeps ``STUCK_S`` before it writes (``stuck_at`` holds when it began); the error each
    rank's training raised goes to ``error{rank}.txt``, as it leaves ``Trainer.fit``."""
    from ddptrain import checkpoint, launch
    from ddptrain.trainer import Trainer

    write = checkpoint.CheckpointWriter.save

    def stuck(self: checkpoint.CheckpointWriter, model: Any, state: dict, meta: dict, **kwargs: Any) -> Any:
        (Path(run_dir) / "stuck_at").write_text(repr(time.time()))
        time.sleep(STUCK_S)
        return write(self, model, state, meta, **kwargs)

    checkpoint.CheckpointWriter.save = stuck
    Trainer.fit = _recording_its_error(Trainer.fit, run_dir)
    return launch.worker(cfg, run_dir, store_port)


def _recording_its_error(fit: Any, run_dir: str) -> Any:
    def fit_recording_its_error(self: Any) -> Any:
        try:
            return fit(self)
        except Exception as err:
            (Path(run_dir) / f"error{os.environ['RANK']}.txt").write_text(str(err))
            raise

    return fit_recording_its_error
