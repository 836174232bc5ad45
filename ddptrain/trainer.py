"""The training loop: ``fit`` owns epochs, steps, evaluation and saving.

The trainer composes parts that each know their own job: the data side yields this rank's
micro-batches (``data.build_training_data``), the checkpointer decides what a checkpoint holds
(``checkpoint.Checkpointer``), ``parallel`` holds every collective, and the rank-0-only work
(files, progress bar) hides behind null objects. No ``data.*`` key is read here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ddptrain import checkpoint, parallel, signals
from ddptrain.config import DType, RunConfig
from ddptrain.data import TrainingData, batch_token_counts, build_training_data
from ddptrain.metrics import Stopwatch, Window, build_metrics_logger, build_progress_bar
from ddptrain.model import autocast, build_model, build_tokenizer, mark_target_count_dynamic, wants_varlen_lengths
from ddptrain.optim import build_optimizer, build_scheduler, clip_gradients
from ddptrain.parallel import DistEnv

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one optimizer step leaves behind (local to this rank until reduced); tensors stay on the device."""

    loss_sum: torch.Tensor  # read only when logging, so steps never wait on the GPU
    target_tokens: int
    grad_norm: torch.Tensor
    overflowed: torch.Tensor | bool  # fp16: the GradScaler found inf/nan gradients and did not step
    batch_tokens: list[tuple[int, int]]  # (real, padded) tokens of each micro-batch this rank trained on
    stop_votes: torch.Tensor  # ranks that asked to stop (SIGTERM, Ctrl-C), summed over ranks


class Trainer:
    """Builds everything from a RunConfig on one rank and trains it.

    Args:
        cfg: the validated run config.
        env: this rank's place in the process group.
        run_dir: the run directory every rank agreed on.
    """

    def __init__(self, cfg: RunConfig, env: DistEnv, run_dir: Path):
        self.cfg, self.env, self.run_dir = cfg, env, run_dir
        self.tokenizer = build_tokenizer(cfg.model)
        # The model first: a tokenizer it cannot embed is refused before minutes of tokenizing.
        self.loss_module = build_model(cfg.model, cfg.trainer.seed, env.device, self.tokenizer)
        self.data: TrainingData = build_training_data(
            cfg,
            self.tokenizer,
            env,
            seed=cfg.trainer.seed,
            grad_accum_steps=cfg.optim.grad_accum_steps,
            flash_varlen=wants_varlen_lengths(cfg.model),
        )
        self.sampler, self.loader = self.data.sampler, self.data.loader
        self.comm = parallel.CommCounter()
        # The step calls DDP around the loss module; evaluation and checkpoints use the loss module itself.
        self.ddp_model = parallel.wrap_model(self.loss_module, cfg.parallel, env, self.comm)
        if cfg.trainer.compile:
            self.ddp_model = torch.compile(self.ddp_model)
        self.trainable = [p for p in self.loss_module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optim, self.loss_module)
        self.total_steps = cfg.trainer.max_steps or self.data.steps_per_epochs(cfg.trainer.epochs)
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, self.total_steps)
        self.autocast = partial(autocast, cfg.trainer.precision, env.device)
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.trainer.precision == DType.fp16)
        self.window = Window()
        self.metrics = build_metrics_logger(env.is_rank_zero, run_dir)
        shared = {"optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler}
        shared["sampler"] = self.sampler  # the data position: epoch and micro-steps consumed
        self.checkpointer = checkpoint.Checkpointer(
            env,
            run_dir,
            cfg.trainer.keep_last_n,
            weights=self.loss_module.model,
            shared=shared,
            per_rank={"windows": self.window},
            fingerprint=self.data.fingerprint,
        )
        self.step = self.checkpointer.resume(cfg.trainer.resume) or 0

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        """Train to trainer.max_steps (or trainer.epochs), evaluating and saving on the way.

        The data position lives in the sampler, so a resumed run continues mid-epoch exactly
        where the checkpoint left off. SIGTERM (pre-emption) or a first Ctrl-C saves a checkpoint
        at the next step boundary and returns (see ``ddptrain.signals``).

        Returns:
            The last logged metrics record (identical on every rank); after a stop by signal it
            also holds ``stopped_by`` and ``stopped_at_step``.
        """
        log.info("training %d steps on %d ranks, from step %d", self.total_steps, self.env.world_size, self.step)
        bar = build_progress_bar(self.cfg.trainer.progress_bar, self.env.is_rank_zero, self.total_steps, self.step)
        watch, last, votes, stopping = Stopwatch(), {}, None, False
        with signals.stop_on_signals() as stop:
            for micro_batches in self.remaining_steps():
                result = self.train_step(micro_batches, stop_requested=stop.requested)
                # The previous step's stop vote, the same on every rank: by now its copy to the host
                # has long finished, so reading it never waits for this step's work on the device.
                stopping = votes is not None and votes.value() > 0
                votes = parallel.LateRead(result.stop_votes)
                last = self.after_step(result, watch, bar) or last
                if stopping or self.step >= self.total_steps:
                    break
        bar.close()
        with signals.stop_on_signals(stop):  # while saving: a repeat changes nothing, a second Ctrl-C aborts
            if stopping and self.step < self.total_steps:  # a vote read at the last step: just finish
                self.checkpointer.save(self.step)
                last = {**last, **stop.report(self.step)}
                by = last[signals.STOPPED_BY]
                log.info("stopped by %s at step %d; resume with trainer.resume=%s", by, self.step, self.run_dir)
            else:
                self.finish()
        return last

    def remaining_steps(self) -> Iterator[list[dict[str, Any]]]:
        """Optimizer steps from the data position on, epoch after epoch (``fit`` stops at total_steps)."""
        while self.step < self.total_steps:
            yield from self.data.optimizer_steps()
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], stop_requested: bool = False) -> StepResult:
        """One optimizer step over this rank's micro-batches.

        The step's gradient is d/dθ [Σ token losses over the global batch] / N, where N is
        the number of target tokens in the global batch (all ranks, all micro-steps). Each
        rank back-propagates its loss sum × world_size / N; DDP then averages over ranks
        (÷ world_size), which leaves exactly Σ/N whatever the split into ranks and micro-steps.
        The same all-reduce carries the stop request (SIGTERM, Ctrl-C): every rank learns of it at the
        same step, at no cost. Nothing here waits for the device. Gradients live until the next step.
        """
        # Counted on the CPU copies: no wait on the device.
        local_tokens = sum(b["target_index"].numel() for b in micro_batches)  # the collator found the targets
        batch_tokens = [batch_token_counts(b) for b in micro_batches]
        batches = [self.to_device(b) for b in micro_batches]
        counts = torch.tensor([local_tokens, float(stop_requested)], dtype=torch.float64)
        n_tokens, stop_votes = parallel.all_reduce_sum(counts.to(self.env.device, non_blocking=True))
        # In fp32 (the scale is exact there), whatever the precision of the loss.
        scale = self.env.world_size / n_tokens.clamp(min=1).float()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.env.device)
        for i, batch in enumerate(batches):
            with parallel.grad_sync(self.ddp_model, enabled=i == len(batches) - 1), self.autocast():
                micro_loss, _ = self.ddp_model(**batch)
            self.scaler.scale(micro_loss * scale).backward()
            loss_sum += micro_loss.detach().float()
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.trainable, self.cfg.optim)
        # GradScaler lowers its scale (a device tensor, updated in place) exactly when it skips a step;
        # get_scale() would copy it to the host and wait for the step to finish.
        scale_before = self.scaler._scale.clone() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        overflowed = self.scaler._scale < scale_before if scale_before is not None else False
        return StepResult(loss_sum, local_tokens, grad_norm, overflowed, batch_tokens, stop_votes)

    def after_step(self, result: StepResult, watch: Stopwatch, bar: Any) -> dict[str, Any] | None:
        """Book the step (data position, log window), then log, evaluate and save when due.

        Returns:
            The metrics record when this step ends a log window, else None.
        """
        self.window.add(result)
        self.sampler.skip(len(result.batch_tokens))  # the micro-batches this step consumed
        self.step += 1
        bar.advance()
        if self.step == 1:
            self.check_first_step()
        record = None
        if self.step % self.cfg.trainer.log_every_n_steps == 0 or self.step == self.total_steps:
            record = self.log_window(watch, result.grad_norm)
            bar.update(record)
        if self.due(self.cfg.trainer.eval_every_n_steps) and self.data.eval is not None:
            self.evaluate()
        if self.due(self.cfg.trainer.save_every_n_steps):
            self.checkpointer.save(self.step)
        return record

    def due(self, every_n_steps: int) -> bool:
        """Whether a periodic task runs now (0 = only at the end, which ``finish`` does)."""
        return bool(every_n_steps) and self.step % every_n_steps == 0 and self.step < self.total_steps

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Tensors to the device; plain numbers (flash-attention's max lengths) stay as they are."""
        moved = {k: v.to(self.env.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        return mark_target_count_dynamic(moved) if self.cfg.trainer.compile else moved

    # ------------------------------------------------------------------ checks, logging, eval

    def check_first_step(self) -> None:
        """After step 1, on every rank: each trainable parameter got a gradient, and the replicas agree.

        Raises:
            RuntimeError: unused trainable parameters under DDP (naming them and the fix), or replicas
                that differ (the loss was computed outside the DDP-wrapped module).
        """
        parallel.check_every_trainable_param_has_a_gradient(self.loss_module, self.cfg.parallel)
        parallel.check_trainable_params_agree(self.loss_module)

    def log_window(self, watch: Stopwatch, grad_norm: torch.Tensor) -> dict[str, Any]:
        """Reduce the window over ranks, write one metrics record (all ranks return it), start a new window."""
        lr, comm = self.scheduler.get_last_lr()[0], self.comm.take()
        record = self.window.close(
            step=self.step, epoch=self.sampler.epoch, lr=lr, grad_norm=grad_norm, watch=watch, comm=comm
        )
        self.metrics.log(record)
        return record

    def evaluate(self) -> float:
        """Mean target-token loss over the whole eval split (every rank a disjoint shard, none dropped)."""
        self.optimizer.zero_grad(set_to_none=True)  # the last step's gradients: freed before eval's peak
        self.loss_module.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad(), self.autocast():
            for batch in self.data.eval_batches():
                loss_sum, n = self.loss_module(**self.to_device(batch))
                totals += torch.tensor([float(loss_sum), float(n)], dtype=torch.float64)
        self.loss_module.train()
        totals = parallel.all_reduce_sum(totals)
        eval_loss = float(totals[0] / max(totals[1], 1.0))
        self.metrics.log({"step": self.step, "eval_loss": eval_loss, "eval_tokens": int(totals[1])})
        log.info("step %d: eval_loss %.4f", self.step, eval_loss)
        return eval_loss

    def finish(self) -> None:
        """Final evaluation, then the last checkpoint and the adapter (and a random base) from rank 0."""
        if self.data.eval is not None:
            self.evaluate()
        if self.cfg.trainer.save_final:
            self.checkpointer.save(self.step)
            self.checkpointer.save_final(self.tokenizer, self.cfg.model, self.cfg.trainer.seed)
        parallel.barrier()
        self.metrics.close()
