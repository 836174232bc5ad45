"""Module-level entrypoints for 2-process tests of gradient communication (spawned processes import them by name).

They measure what reached ``torch.distributed`` from the test side, independently of the product's
own counters, and write it to files in the run directory.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ddptrain import parallel
from ddptrain.config import RunConfig
from ddptrain.observe.console import setup_logging
from ddptrain.trainer import Trainer


def train_recording_gradient_allreduces(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Train with the real Trainer, recording per optimizer step the bytes of every tensor handed to
    ``torch.distributed.all_reduce`` during backward; write ``allreduce-rank{N}.json``:
    ``{"bytes": [per step], "calls": [per step]}``.

    During backward the only all-reduces are DDP's gradient communication: its hook issues them, and
    PowerSGD's later ones run from future callbacks (on gloo's thread) that DDP waits for before
    backward returns. The trainer's own all-reduces (token count and stop flag, log totals) run
    outside backward and are not counted. A DDP without a Python hook reduces in C++ and shows
    nothing here.
    """
    real_all_reduce, real_backward = dist.all_reduce, torch.autograd.backward
    in_backward = threading.Event()  # not thread-local: PowerSGD's callbacks run on another thread
    lock = threading.Lock()
    steps: list[list[int]] = [[]]  # bytes of each gradient all-reduce, one list per optimizer step

    def recording_all_reduce(tensor, *args, **kwargs):
        if in_backward.is_set():
            with lock:
                steps[-1].append(tensor.numel() * tensor.element_size())
        return real_all_reduce(tensor, *args, **kwargs)

    def marked_backward(*args, **kwargs):
        in_backward.set()
        try:
            return real_backward(*args, **kwargs)
        finally:
            in_backward.clear()

    dist.all_reduce, torch.autograd.backward = recording_all_reduce, marked_backward
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, None)
        trainer = Trainer(cfg, env, Path(run_dir))
        trainer.optimizer.register_step_post_hook(lambda *_: steps.append([]))
        trainer.fit()
        done = steps[:-1]  # the last list was opened after the last step
        record = {"bytes": [sum(step) for step in done], "calls": [len(step) for step in done]}
        (Path(run_dir) / f"allreduce-rank{env.rank}.json").write_text(json.dumps(record))
    finally:
        parallel.teardown()
        dist.all_reduce, torch.autograd.backward = real_all_reduce, real_backward
