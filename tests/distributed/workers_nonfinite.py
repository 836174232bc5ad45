"""Entrypoints for tests/distributed/test_nonfinite.py: the product's worker with a NaN loss injected by design on one
rank at the steps ``inject.json`` names, each rank recording what the test checks in ``rank<N>.json``: what its run
returned, how many steps it trained, its trainable weights and its optimizer's step count after each step, the host
reads of device values its step code made per step, and which step's verdict each late read brought."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import ddptrain
from ddptrain.config import RunConfig

PACKAGE = str(Path(ddptrain.__file__).parent) + os.sep
# Reads of the device-side counts of the CPU batch, made by the data side and the FLOP count before the batch moves to
# the device (trainer.train_step counts "on the CPU copies"): no wait for a GPU.
HOST_SIDE = (PACKAGE + "data" + os.sep, PACKAGE + os.path.join("observe", "flops.py"))
READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"})
"""The tensor methods that bring a value to the host: on a GPU each waits for the device to get there."""


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values made by ddptrain's step (the trainer, the optimizer step, the collectives,
    torch code they call): on a GPU each is a wait for the device. Left out: the model's own forward (transformers
    code, the same whatever ddptrain does) and the host-side counts of the CPU batch (``HOST_SIDE``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False  # while the test's own hooks read what they record

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused and getattr(func, "__name__", "") in READS and self._by_the_step(sys._getframe(1)):
            self.count += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _by_the_step(frame: Any) -> bool:
        """The innermost ddptrain frame that led to the read is the step's, with no transformers frame inside it."""
        while frame is not None:
            name = frame.f_code.co_filename
            if f"{os.sep}transformers{os.sep}" in name:
                return False
            if name.startswith(PACKAGE):
                return not name.startswith(HOST_SIDE)
            frame = frame.f_back
        return False


def _digest(tensors: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train_with_nan_loss(cfg: RunConfig, run_dir: str, store_port: int | None) -> Any:
    """The product's worker; on rank ``inject["rank"]``, the training loss of each step in ``inject["steps"]`` is
    multiplied by NaN, as a loss that overflowed would be: its backward makes that rank's gradients NaN. Under
    objective=dpo the policy's reply log-probabilities are, and with them the loss and the rewards."""
    from ddptrain import launch, parallel
    from ddptrain.model import CausalLMLoss
    from ddptrain.model.preference import PreferenceLoss
    from ddptrain.trainer import Trainer

    inject = json.loads((Path(run_dir) / "inject.json").read_text())
    rank = int(os.environ["RANK"])
    trained: list[int] = []  # the steps train_step was called for
    in_step = [False]
    after_steps: list[dict[str, Any]] = []
    reads = HostReads()
    reads_at_step_start: list[int] = []

    forward, train_step, init = CausalLMLoss.forward, Trainer.train_step, Trainer.__init__
    reply_logps = PreferenceLoss.reply_logps
    late_values = parallel.LateRead.values
    verdicts_read: dict[int, list[int]] = {}  # by the last step trained when it was read: the steps whose verdict

    def recorded_read(self: parallel.LateRead) -> list[float]:
        verdicts_read.setdefault(trained[-1], []).append(self.waits_in.step)
        return late_values(self)

    def poisoned(self: CausalLMLoss, *args: Any, **kwargs: Any) -> Any:
        loss_sum, n_tokens = forward(self, *args, **kwargs)
        if in_step[0] and rank == inject["rank"] and len(trained) in inject["steps"]:
            loss_sum = loss_sum * math.nan
        return loss_sum, n_tokens

    def poisoned_logps(self: PreferenceLoss, *args: Any, **kwargs: Any) -> Any:
        """objective=dpo: the policy's reply log-probabilities (not the reference's, computed without gradients)."""
        logps, tokens = reply_logps(self, *args, **kwargs)
        if in_step[0] and torch.is_grad_enabled() and rank == inject["rank"] and len(trained) in inject["steps"]:
            logps = logps * math.nan
        return logps, tokens

    def counted_step(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        reads_at_step_start.append(reads.count)
        trained.append(self.step + 1)
        in_step[0] = True
        try:
            return train_step(self, *args, **kwargs)
        finally:
            in_step[0] = False

    def recorded_init(self: Trainer, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        trainable = [p for p in self.loss_module.parameters() if p.requires_grad]

        def after(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            reads.paused = True
            steps = {int(optimizer.state[p]["step"]) for p in trainable}
            after_steps.append({"digest": _digest(trainable), "optimizer_steps": sorted(steps)})
            reads.paused = False

        self.optimizer.register_step_post_hook(after)

    CausalLMLoss.forward, Trainer.train_step, Trainer.__init__ = poisoned, counted_step, recorded_init
    PreferenceLoss.reply_logps = poisoned_logps
    parallel.LateRead.values = recorded_read
    with reads:
        result = launch.worker(cfg, run_dir, store_port)
    per_step = [b - a for a, b in itertools.pairwise(reads_at_step_start)]
    record = {
        "result": result,
        "trained": trained,
        "after_steps": after_steps,
        "reads_per_step": per_step,
        "verdicts_read": verdicts_read,
    }
    (Path(run_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    return result
