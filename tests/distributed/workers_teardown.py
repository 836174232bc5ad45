"""Module-level entrypoint for the 2-process test of leaving the process group (spawned processes import it)."""

from __future__ import annotations

import sys
import time
import weakref
from pathlib import Path

import torch
from torch import nn

from ddptrain import parallel
from ddptrain.config import RunConfig


def free_the_model_while_gloo_needs_the_gil(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Leave the group as a rank does at the end of a run (``teardown``, the DDP model freed, then
    ``release_left_groups``), with gloo's worker thread needing the GIL while the model goes.

    In a run that happens at random (a finished collective's tensors freed on gloo's thread). Here rank 1 makes it
    happen: after ``teardown`` it starts one more all-reduce whose completion runs a Python callback on gloo's thread
    (gloo's group still works after ``destroy_process_group``, which only unregisters it), says it is about to free
    the model, and frees it without giving the GIL up on its own (``sys.setswitchinterval``); rank 0 joins the
    all-reduce 0.5 s after that. Were DDP's Reducer the last holder of the group, freeing the model would join
    gloo's threads with the GIL held, and rank 1 would never exit. Each rank writes ``left-rank{N}.txt`` once
    through."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    model = parallel.wrap_model(nn.Linear(4, 4), cfg.parallel, env)
    model(torch.ones(2, 4)).sum().backward()
    parallel.teardown()
    kept = len(parallel.group._left_groups)
    group = model.process_group
    ready, done = Path(run_dir) / "rank1-frees-the-model", []
    if env.rank == 0:
        while not ready.exists():
            time.sleep(0.05)
        time.sleep(0.5)
        group.allreduce([torch.ones(1)]).wait()
    else:
        sys.setswitchinterval(1000.0)
        group.allreduce([torch.ones(1)]).get_future().then(lambda future: done.append(future.value()))
        ready.write_text("")
    del group
    gone = weakref.ref(model)
    del model  # whatever still held the group from C++ lets go of it here at the latest
    freed = gone() is None
    parallel.release_left_groups()
    sys.setswitchinterval(0.005)
    callback_ran = bool(done) or env.rank == 0
    (Path(run_dir) / f"left-rank{env.rank}.txt").write_text(
        f"kept {kept}, model freed {freed}, callback {callback_ran}\n"
    )
