"""The training loop: ``fit`` owns epochs, steps, evaluation and saving.

The trainer composes parts that each know their own job: the data side yields this rank's micro-batches
(``data.build_training_data``), the checkpointer decides what a checkpoint holds (``checkpoint.Checkpointer``),
``parallel`` holds every collective, ``timing`` books where the time goes, and the rank-0-only work (files,
progress bar, report) hides behind null objects. No ``data.*`` key is read here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ddptrain import checkpoint, model, parallel
from ddptrain.config import DType, ModelInit, RunConfig, SaveCheckMode, config_as_dict
from ddptrain.data import TrainingData, batch_token_counts, build_training_data, loss_units
from ddptrain.evaluation.best import build_best_tracker
from ddptrain.evaluation.evaluator import Evaluator
from ddptrain.evaluation.samples import build_samples
from ddptrain.model import batch_to_device, build_model, build_tokenizer, precompute_reference, weights
from ddptrain.model.attention import wants_varlen_lengths, warn_about_attention_cost
from ddptrain.model.precision import autocast, autocast_dtype, sharded_compute_dtype
from ddptrain.observe import profiling, timing
from ddptrain.observe.console import build_progress_bar
from ddptrain.observe.flops import build_model_flops, matmul_dtype, peak_tflops
from ddptrain.observe.metrics import build_metrics_logger
from ddptrain.observe.nonfinite import DIVERGED, Diverged, build_nonfinite_guard
from ddptrain.observe.window import StepResult, Stopwatch, Window
from ddptrain.optim import build_optimizer, build_scheduler, divergence_levers, step_optimizer
from ddptrain.parallel import DistEnv
from ddptrain.plan.at_start import plan_at_start
from ddptrain.process import rng, signals

log = logging.getLogger(__name__)


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
        model.check_tokenizer_embeddable(self.tokenizer, cfg.model)  # before minutes of tokenizing: from the config
        resume_from = checkpoint.find_checkpoint(cfg.trainer.resume, run_dir)  # saved on other ranks: its plan goes on
        self.data: TrainingData = build_training_data(
            cfg.data, self.tokenizer, env, seed=cfg.trainer.seed, grad_accum_steps=cfg.optim.grad_accum_steps,
            flash_varlen=wants_varlen_lengths(cfg.model), planned_for=checkpoint.planned_for(resume_from, env),
        )  # fmt: skip
        self.best = build_best_tracker(cfg.trainer, has_eval=self.data.eval is not None)  # before the weights load
        self.memory_plan = plan_at_start(cfg, self.data.tokenized, env.rank, env.world_size)  # no fit: stops here
        where = parallel.load_device(cfg.parallel, cfg.model.init == ModelInit.pretrained)  # FSDP2: host or meta
        self.loss_module = build_model(cfg.model, cfg.trainer.seed, env.device, self.tokenizer, where, cfg.objective)
        rng.seed_rng(cfg.trainer.seed, env.rank)  # same weights everywhere; each rank its own dropout masks
        self.sampler, self.loader = self.data.sampler, self.data.loader
        warn_about_attention_cost(cfg.model.attn_implementation, env.device, self.sampler.row_lengths)
        self.comm = parallel.CommCounter()
        self.clock = timing.build_clock(cfg.trainer.timing, env.device, self.comm)  # before DDP: it times the hook
        self.clock.enter("wrap_model")  # a collective (the replicas' checksum): a hang here says so
        # The step calls DDP around the loss module; evaluation and checkpoints use the loss module itself.
        precision = autocast_dtype(cfg.trainer, env.device)  # trainer.precision=auto resolved on this device
        gather = sharded_compute_dtype(precision, cfg.model.dtype, cfg.model.lora)  # fsdp2: in place, the same module
        wrapped = parallel.wrap_model(self.loss_module, cfg.parallel, env, self.comm, gather)
        weights.materialize(self.loss_module, cfg, env.device)  # built on the meta device: each rank reads its rows
        precompute_reference(cfg.objective, cfg.model, cfg.trainer.seed, precision, self.loss_module, self.data, env)
        self.ddp_model = torch.compile(wrapped) if cfg.trainer.compile else wrapped
        self.trainable = [p for p in self.loss_module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optim, self.loss_module)
        self.total_steps = cfg.trainer.max_steps or self.data.steps_per_epochs(cfg.trainer.epochs)
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, self.total_steps)
        self.autocast = partial(autocast, precision, env.device)
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=precision == DType.fp16)
        self.guard = build_nonfinite_guard(cfg.trainer, divergence_levers(cfg.optim), self.scaler, env.device)
        self.window, self.flops = Window(), build_model_flops(self.loss_module, enabled=cfg.trainer.timing)
        self.peak_tflops = peak_tflops(env.device, matmul_dtype(precision, cfg.model.dtype), cfg.trainer.peak_tflops)
        self.profiler = profiling.build_profiler(cfg.trainer, env, run_dir, self.clock)
        self.metrics = build_metrics_logger(env.is_rank_zero, run_dir, cfg.logger, config_as_dict(cfg))
        samples = build_samples(cfg.trainer, cfg.data, self.tokenizer, env.rank, env.world_size)
        batches = self.data.eval_batches if self.data.eval is not None else None
        parts = (self.loss_module, batches, samples, self.best, self.metrics, self.clock, self.autocast, env.device)
        self.evaluate = Evaluator(*parts, optimizer=self.optimizer, comm=self.comm)  # eval metrics, samples, best
        shared = {"optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler}
        files = checkpoint.AdapterFiles(self.tokenizer, cfg.model, cfg.trainer.seed)
        self.checkpointer = checkpoint.build_checkpointer(  # the sampler holds the data position
            env, run_dir, cfg.trainer, files, self.loss_module.model, {**shared, "sampler": self.sampler},
            {"windows": self.window}, self.data.fingerprint, self.best, self.data.train[:2]["input_ids"],
        )  # fmt: skip
        self.clock.enter("resume")
        self.step = self.checkpointer.resume(resume_from) or 0
        self.metrics.log(self.memory_plan.as_record(self.step))  # the report sets it beside the measured peaks

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        """Train to trainer.max_steps (or trainer.epochs), evaluating and saving (a resume goes on mid-epoch).
        SIGTERM or a first Ctrl-C saves a checkpoint at the next step boundary and returns (``process.signals``); a
        non-finite step stops every rank there as trainer.on_nonfinite says (``observe.nonfinite``). Returns the last
        metrics record (every rank's), with ``stopped_by``, ``stopped_at_step`` after a signal; ``diverged`` only."""
        log.info("training %d steps on %d ranks, from step %d", self.total_steps, self.env.world_size, self.step)
        try:
            with signals.stop_on_signals() as stop:
                last, stopping = self.train_steps(stop)
            with signals.stop_on_signals(stop):  # while saving: a repeat changes nothing, a second Ctrl-C aborts
                self.guard.read()  # the last step's verdict, before anything of it is evaluated or saved
                stopped = stopping and self.step < self.total_steps  # a vote read at the last step: just finish
                return {**last, **(self.save_and_stop(stop) if stopped else self.finish())}
        except Diverged as diverged:  # every rank at the same step: nothing more is saved; the launcher exits 65
            self.log_window(self.watch, torch.tensor(float("nan")))  # the steps up to it: the report's numbers
            last_good = checkpoint.newest_complete(self.run_dir / "checkpoints")
            return {DIVERGED: self.guard.record(diverged.verdict, last_good, self.metrics)}

    def train_steps(self, stop: Any) -> tuple[dict[str, Any], bool]:
        """Optimizer steps until the last, a stop request or an early stop: the last metrics record, and whether a
        stop was requested. Raises ``Diverged`` where trainer.on_nonfinite stops the run."""
        bar = build_progress_bar(self.cfg.trainer.progress_bar, self.env.is_rank_zero, self.total_steps, self.step)
        self.watch, last, stopping = Stopwatch(), {}, False
        self.clock.enter("data", self.step + 1)
        try:
            for micro_batches in self.remaining_steps():
                self.profiler.step_begins(self.step + 1)
                with profiling.out_of_memory_named(micro_batches, self.env, self.run_dir):
                    result = self.train_step(micro_batches, stop_requested=stop.requested)
                previous = self.guard.read()  # equal on every rank; its copy has long reached the host
                stopping = previous is not None and previous.stop_votes > 0
                self.guard.queue(result.verdict, self.step + 1, result.local_loss)
                last = self.after_step(result, self.watch, bar) or last
                if stopping or self.step >= self.total_steps or self.best.should_stop:
                    break
        finally:
            bar.close()
        return last, stopping

    def save_and_stop(self, stop: Any) -> dict[str, Any]:
        """A stop requested (SIGTERM, Ctrl-C) before the last step: a checkpoint, and where to resume from."""
        self.save()
        report = stop.report(self.step)
        by = report[signals.STOPPED_BY]
        log.info("stopped by %s at step %d; resume with trainer.resume=%s", by, self.step, self.run_dir)
        return report

    def remaining_steps(self) -> Iterator[list[dict[str, Any]]]:
        """Optimizer steps from the data position on, epoch after epoch (``fit`` stops at total_steps)."""
        while self.step < self.total_steps and not self.best.should_stop:  # an early-stopped run resumed: done
            yield from self.data.optimizer_steps()
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], stop_requested: bool = False) -> StepResult:
        """One optimizer step over this rank's micro-batches.

        The step's gradient is d/dθ [Σ losses over the global batch] / N, N its target tokens (DPO: its pairs; all
        ranks, all micro-steps). Each rank back-propagates its loss sum × world_size / N; DDP averages
        over ranks (÷ world_size), which leaves exactly Σ/N whatever the split into ranks and micro-steps. The same
        all-reduce carries the stop request (SIGTERM, Ctrl-C) to every rank at the same step, at no cost. Nothing
        here waits for the device. Gradients live until the next step. ``self.clock`` marks each phase.
        """
        self.clock.enter("to_device", self.step + 1)
        # Counted on the CPU copies: no wait on the device.
        local_tokens = sum(loss_units(b) for b in micro_batches)  # target tokens, or DPO's pairs: on the CPU
        batch_tokens = [batch_token_counts(b) for b in micro_batches]
        flops = sum(self.flops.batch_flops(b) for b in micro_batches)
        batches = [batch_to_device(b, self.env.device, self.cfg.trainer.compile) for b in micro_batches]
        counts = torch.tensor([local_tokens, float(stop_requested)], dtype=torch.float64)
        self.optimizer.zero_grad(set_to_none=True)
        self.clock.enter("sync", self.step + 1)  # waits for the slowest rank to reach this step
        n_tokens, stop_votes = parallel.all_reduce_sum(counts.to(self.env.device, non_blocking=True))
        scale = self.env.world_size / n_tokens.clamp(min=1).float()  # fp32 (exact there), whatever the loss's dtype
        loss_sum = torch.zeros((), device=self.env.device)
        for i, batch in enumerate(batches):
            self.clock.enter("forward", self.step + 1, i)
            with parallel.grad_sync(self.ddp_model, enabled=i == len(batches) - 1), self.autocast():
                micro_loss, _ = self.ddp_model(**batch)
            self.clock.enter("backward", self.step + 1, i)
            self.scaler.scale(micro_loss * scale).backward()
            loss_sum += micro_loss.detach().float()
        self.clock.enter("optimizer", self.step + 1)
        o = self.optimizer, self.scaler, self.scheduler, self.trainable, self.cfg.optim
        grad_norm, nonfinite, dropped = step_optimizer(*o, drop_nonfinite=self.guard.drops)
        verdict = self.guard.verdict_of(stop_votes, nonfinite, dropped)  # read a step late (fit)
        self.clock.enter("other", self.step + 1)
        counted = self.guard.counted(loss_sum, local_tokens)  # what the log window averages
        return StepResult(*counted, grad_norm, dropped, batch_tokens, verdict, flops, local_loss=loss_sum)

    def after_step(self, result: StepResult, watch: Stopwatch, bar: Any) -> dict[str, Any] | None:
        """Book the step (data position, log window), then log, evaluate and save when due; returns the metrics record
        when this step ends a log window, else None."""
        self.window.add(result)
        self.sampler.skip(len(result.batch_tokens))  # the micro-batches this step consumed
        self.step += 1
        bar.advance()
        self.profiler.step_ends(self.step)
        if self.step == 1:  # every trainable parameter got a gradient (naming any that did not), replicas agree
            parallel.check_every_trainable_param_has_a_gradient(self.loss_module, self.cfg.parallel)
            parallel.check_trainable_params_agree(self.loss_module)
        record = None
        logs = self.step % self.cfg.trainer.log_every_n_steps == 0 or self.step == self.total_steps
        if logs or self.due(self.cfg.trainer.eval_every_n_steps) or self.due(self.cfg.trainer.save_every_n_steps):
            self.guard.read()  # nothing of a diverged step is logged, evaluated or saved (they wait for the device)
        if logs:
            self.clock.enter("log", self.step)
            record = self.log_window(watch, result.grad_norm)
            bar.update(record)
        if self.due(self.cfg.trainer.eval_every_n_steps):
            self.evaluate(self.step)
        # A new best is saved at once, or the checkpoints to keep the best from would not exist.
        if self.due(self.cfg.trainer.save_every_n_steps) or self.best.wants_checkpoint(self.step):
            self.save()
        self.clock.enter("data", self.step + 1)
        return record

    def due(self, every_n_steps: int) -> bool:
        """Whether a periodic task runs now (0 = only at the end, which ``finish`` does)."""
        return bool(every_n_steps) and self.step % every_n_steps == 0 and self.step < self.total_steps

    def log_window(self, watch: Stopwatch, grad_norm: torch.Tensor) -> dict[str, Any]:
        """Reduce the window over ranks, write one metrics record (all ranks return it), start a new window."""
        lr, comm = self.scheduler.get_last_lr()[0], self.comm.take() if self.comm.counting else None
        flops_per_step = self.window.flops / max(self.window.steps, 1)
        record = self.window.close(
            step=self.step, epoch=self.sampler.epoch, lr=lr, grad_norm=grad_norm, watch=watch, comm=comm
        )
        record.update(self.clock.close_window(flops_per_step, self.peak_tflops), **self.loss_module.close_window())
        self.metrics.log(record)
        return record

    def finish(self) -> dict[str, Any]:
        """Final evaluation (unless just evaluated), the last checkpoint (without adapter/, the round trip's), the final
        weights. Returns the final eval metrics, the best (``best_step``, ``best_value``), ``early_stopped`` if any."""
        self.clock.enter("finish", self.step)
        final = self.best.evaluated_at(self.step) or self.evaluate(self.step)
        self.clock.enter("save", self.step)
        t = self.cfg.trainer
        self.metrics.log(self.checkpointer.save_last(self.step, t.save_final, t.save_check != SaveCheckMode.off))
        if t.save_final:
            self.metrics.log(self.checkpointer.save_final(self.step))  # the save check's record, on rank 0
        parallel.barrier()
        kept = {"best_kept": checkpoint.best_step_in(self.run_dir) == self.best.best_step, "last_step": self.step}
        outcome = {k: v for k, v in final.items() if k.startswith("eval_")} | self.best.summary() | kept
        if "early_stopped" in outcome:
            log.info("early stopping at step %d: %s", self.step, outcome["early_stopped"])
        return outcome

    def save(self) -> None:
        self.clock.enter("save", self.step)
        self.metrics.log(self.checkpointer.save(self.step))  # the save check's record (its cost), on rank 0

    def close(self, status: str) -> None:
        """After the process group is gone (no rank waits on this): a profile cut short, then on rank 0 the
        report and the loggers' last word. ``status``: finished, stopped, diverged or failed."""
        self.profiler.close()
        self.metrics.close(status)
