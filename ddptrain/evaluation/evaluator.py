"""One evaluation of the run: the eval metrics over the whole eval split (when there is one) and the samples (when
there are prompts), logged as one metrics record with their times, and booked by the best tracker."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ddptrain import parallel
from ddptrain.evaluation.best import BestTracker
from ddptrain.evaluation.metrics import evaluate
from ddptrain.evaluation.samples import SampleRound
from ddptrain.model import CausalLMLoss

log = logging.getLogger("ddptrain.trainer")


@dataclass
class Evaluator:
    """What the trainer calls at every evaluation; every rank calls it at the same step.

    Args:
        loss_module: the unwrapped model and its loss.
        eval_batches: this rank's eval batches, afresh at each call; None without an eval split.
        samples: the prompts' round (``trainer.eval_prompts``); None without prompts.
        best: books each evaluation's metrics.
        metrics: the metrics logger (rank 0 writes; elsewhere a null object).
        clock: the step clock: evaluation and samples are phases of their own, outside the steps.
        autocast: the run's autocast; device: where the model is.
        optimizer: its gradients are freed before evaluating (the next step sets them anew).
    """

    loss_module: CausalLMLoss
    eval_batches: Callable[[], Iterable[dict[str, Any]]] | None
    samples: SampleRound | None
    best: BestTracker
    metrics: Any
    clock: Any
    autocast: Callable[[], AbstractContextManager]
    device: torch.device
    optimizer: torch.optim.Optimizer
    comm: Any = None
    """The step's ``parallel.CommCounter``: what evaluation sends (FSDP2's all-gathers) is not the steps'."""

    def __call__(self, step: int) -> dict[str, Any]:
        """Evaluate at ``step``; returns the record logged (``eval_loss``, ..., ``eval_s``, ``samples_s``)."""
        self.optimizer.zero_grad(set_to_none=True)  # the last step's gradients: freed before eval's peak
        record: dict[str, Any] = {"step": step}
        uncounted = self.comm.paused() if self.comm is not None else contextlib.nullcontext()
        self.clock.enter("eval", step)  # before the gather below: an evaluation's collectives are not step time
        with uncounted, parallel.gathered(self.loss_module):  # FSDP2: the root's weights whole (eval sums, generate)
            record |= self._evaluate(step)
        if len(record) > 1:  # something was evaluated
            self.metrics.log(record)
        if "eval_loss" in record:
            self._book(step, record)
        return record

    def _evaluate(self, step: int) -> dict[str, Any]:
        record: dict[str, Any] = {}
        if self.eval_batches is not None:
            self.clock.enter("eval", step)
            start = time.perf_counter()
            record |= evaluate(self.loss_module, self.eval_batches(), self.autocast, self.device)
            record["eval_s"] = time.perf_counter() - start
        if self.samples is not None:
            self.clock.enter("samples", step)
            start = time.perf_counter()
            sharded = parallel.is_sharded(self.loss_module)
            rows = self.samples(self.loss_module.model, step, self.autocast, self.device, sharded)
            record["samples_s"] = time.perf_counter() - start  # generating, and waiting for the slowest rank
            self.metrics.log_samples(step, rows)
        return record

    def _book(self, step: int, record: dict[str, Any]) -> None:
        improved = self.best.observe(step, record)
        metric = self.best.rule.metric
        best = "the best so far" if improved else self.best.best_so_far()
        if "eval_rewards_accuracy" in record:  # objective=dpo
            shown = f"rewards accuracy {100 * record['eval_rewards_accuracy']:.1f}%"
        else:
            shown = f"perplexity {record['eval_perplexity']:.4g}, accuracy {100 * record['eval_accuracy']:.1f}%"
        log.info("step %d: eval_loss %.4f, %s (%s: %s)", step, record["eval_loss"], shown, metric, best)
