"""Module-level entrypoint for the 2-process test of leaving the process group (spawned processes import it)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

from ddptrain import parallel
from ddptrain.config import RunConfig


def free_the_model_while_gloo_needs_the_gil(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Leave the group as ``launch.worker`` does (``teardown``, the DDP model freed, ``release_left_groups``), with
    gloo's worker thread needing the GIL at the moment the model goes.

    In a run that happens at random (a finished collective's tensors freed on gloo's thread); here it is made
    certain: after ``teardown`` rank 1 starts one more all-reduce whose completion runs a Python callback on gloo's
    thread, and rank 0 joins it only 2 s later, while rank 1's main thread frees the model and never gives the GIL
    up on its own (``sys.setswitchinterval``). Were DDP's Reducer the last holder of the group, freeing the model
    would join gloo's threads with the GIL held, and rank 1 would never exit. Each rank writes
    ``left-rank{N}.txt`` once it is through."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    model = parallel.wrap_model(nn.Linear(4, 4), cfg.parallel, env)
    model(torch.ones(2, 4)).sum().backward()
    parallel.teardown()
    group = model.process_group
    done = []
    if env.rank == 0:
        time.sleep(2.0)
        group.allreduce([torch.ones(1)]).wait()
    else:
        sys.setswitchinterval(1000.0)
        group.allreduce([torch.ones(1)]).get_future().then(lambda future: done.append(future.value()))
    del group
    del model  # DDP's Reducer lets go of the group here
    parallel.release_left_groups()
    sys.setswitchinterval(0.005)
    (Path(run_dir) / f"left-rank{env.rank}.txt").write_text(f"callback ran: {bool(done) or env.rank == 0}\n")
