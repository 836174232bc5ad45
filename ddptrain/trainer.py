"""The training loop: ``fit`` owns epochs, steps, evaluation and saving.

No ``torch.distributed`` here: collectives come from ``ddptrain.parallel``, and the
rank-0-only work (files, progress bar) hides behind null objects.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddptrain import checkpoint, parallel, signals
from ddptrain.config import Attention, Batching, DType, RunConfig
from ddptrain.data import Collator, RowsDataset, TokenizedData, batch_token_counts, build_datasets
from ddptrain.metrics import Stopwatch, build_metrics_logger, build_progress_bar
from ddptrain.model import (
    TORCH_DTYPES,
    CausalLMLoss,
    build_model,
    build_tokenizer,
    mark_target_count_dynamic,
)
from ddptrain.optim import build_optimizer, build_scheduler
from ddptrain.parallel import DistEnv
from ddptrain.sampler import BatchingSpec, DistributedBatchSampler

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one optimizer step leaves behind (local to this rank until reduced)."""

    loss_sum: torch.Tensor  # on the device: read only when logging, so steps never wait on the GPU
    target_tokens: int
    grad_norm: torch.Tensor
    skipped: torch.Tensor | bool  # fp16: the GradScaler skipped this step (an overflow); on the device
    batch_tokens: list[tuple[int, int]]  # (real, padded) tokens of each micro-batch this rank trained on
    stop_votes: torch.Tensor  # ranks that asked to stop (SIGTERM, Ctrl-C), summed over ranks; on the device

    @property
    def micro_steps(self) -> int:
        return len(self.batch_tokens)


@dataclass
class Window:
    """This rank's share of the steps between two log lines.

    A step's token counts travel with the step, measured from the tensors it trained on, so a
    window that spans an epoch boundary (or a resume) never looks anything up in a batch plan.
    """

    loss_sum: torch.Tensor | float = 0.0
    target_tokens: int = 0
    batch_tokens: list[tuple[int, int]] = field(default_factory=list)
    skipped: torch.Tensor | int = 0
    steps: int = 0

    def add(self, result: StepResult) -> None:
        self.loss_sum = self.loss_sum + result.loss_sum.double()
        self.target_tokens += result.target_tokens
        self.batch_tokens += result.batch_tokens
        self.skipped = self.skipped + result.skipped
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers (the loss sum is read off the device): one rank's partial window for a checkpoint."""
        return {**asdict(self), "loss_sum": float(self.loss_sum), "skipped": int(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum = float(state["loss_sum"])
        self.target_tokens = int(state["target_tokens"])
        self.batch_tokens = [(int(real), int(padded)) for real, padded in state["batch_tokens"]]
        self.skipped, self.steps = int(state["skipped"]), int(state["steps"])


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
        self.loss_module: CausalLMLoss = build_model(cfg.model, cfg.trainer.seed, env.device, self.tokenizer)
        with parallel.local_rank_zero_first(env, cfg.data.prepare_timeout_s, "tokenizing the dataset"):
            self.data: TokenizedData = build_datasets(cfg.data, self.tokenizer, cfg.trainer.seed)
        self.sampler = DistributedBatchSampler(self.data.train["length"], self._batching_spec(), env.rank)
        self.loader = self._build_loader()
        self.comm = parallel.CommCounter()
        self.model: nn.Module = parallel.wrap_model(self.loss_module, cfg.parallel, env, self.comm)
        if cfg.trainer.compile:
            self.model = torch.compile(self.model)
        self.optimizer = build_optimizer(cfg.optim, self.loss_module)
        self.trainable = [p for p in self.loss_module.parameters() if p.requires_grad]
        self.total_steps = self._total_steps()
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, self.total_steps)
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.trainer.precision == DType.fp16)
        self.step = 0
        self.window = Window()
        self.stopping = False
        self.metrics = build_metrics_logger(env.is_rank_zero, run_dir)
        self.writer = checkpoint.build_writer(env.is_rank_zero, run_dir, cfg.trainer.keep_last_n)
        self.maybe_resume()

    # ------------------------------------------------------------------ setup

    def _batching_spec(self) -> BatchingSpec:
        d = self.cfg.data
        return BatchingSpec(
            mode=d.batching,
            world_size=self.env.world_size,
            micro_batch_size=d.micro_batch_size,
            max_tokens_per_batch=d.max_tokens_per_batch,
            grad_accum_steps=self.cfg.optim.grad_accum_steps,
            pad_to_multiple_of=d.pad_to_multiple_of,
            seed=self.cfg.trainer.seed,
            costliest_first=d.costliest_first,
        )

    def _build_loader(self) -> torch.utils.data.DataLoader:
        collator = Collator(
            pad_id=self.tokenizer.pad_token_id,
            pad_to_multiple_of=self.cfg.data.pad_to_multiple_of,
            packed=self.cfg.data.batching == Batching.packed,
            flash_varlen=self.cfg.model.attn_implementation == Attention.flash_attention_2,
        )
        return torch.utils.data.DataLoader(
            RowsDataset(self.data.train),
            batch_sampler=self.sampler,
            collate_fn=collator,
            num_workers=self.cfg.data.num_workers,
            pin_memory=self.env.device.type == "cuda",
            persistent_workers=False,
            # Its own generator: otherwise every new iterator draws its base seed from the global RNG,
            # and a run resumed mid-epoch would draw at another point than the uninterrupted run did,
            # shifting every dropout mask after it.
            generator=torch.Generator().manual_seed(self.cfg.trainer.seed),
            # A terminal's Ctrl-C or a scheduler's SIGTERM reaches every process of the job: the
            # loader's workers leave the stop to the training process, which shuts them down.
            worker_init_fn=signals.ignore_stop_signals,
        )

    def _total_steps(self) -> int:
        """trainer.max_steps, or the optimizer steps of trainer.epochs whole epochs (a short last step each)."""
        if self.cfg.trainer.max_steps is not None:
            return self.cfg.trainer.max_steps
        accum = self.cfg.optim.grad_accum_steps
        return sum(math.ceil(self.sampler.epoch_length(e) / accum) for e in range(self.cfg.trainer.epochs))

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
        parallel.check_same_on_all_ranks(
            len(self.sampler), "micro-batches per epoch", "Every rank must build the same batch plan; this is a bug."
        )
        log.info(
            "training %d steps: %d ranks x %d micro-steps per step, %d micro-batches per rank per epoch",
            self.total_steps,
            self.env.world_size,
            self.cfg.optim.grad_accum_steps,
            len(self.sampler),
        )
        bar = build_progress_bar(self.cfg.trainer.progress_bar, self.env.is_rank_zero, self.total_steps, self.step)
        watch, last, votes = Stopwatch(), {}, None
        with signals.stop_on_signals() as stop:
            while self.step < self.total_steps and not self.stopping:
                for micro_batches in chunked(self.loader, self.cfg.optim.grad_accum_steps):
                    result = self.train_step(micro_batches, stop_requested=stop.requested)
                    self.window.add(result)
                    # The previous step's stop vote, the same on every rank: by now its copy to the host
                    # has long finished, so reading it never waits for this step's work on the device.
                    self.stopping = votes is not None and votes.value() > 0
                    votes = parallel.LateRead(result.stop_votes)
                    self.sampler.skip(result.micro_steps)
                    self.step += 1
                    bar.advance()
                    if self.step == 1:
                        self.preflight()
                    if self.step % self.cfg.trainer.log_every_n_steps == 0 or self.step == self.total_steps:
                        last = self.log_window(watch, result.grad_norm)
                        bar.update(last)
                    self.maybe_evaluate()
                    self.maybe_save()
                    if self.step >= self.total_steps or self.stopping:
                        break
                else:
                    self.sampler.set_epoch(self.sampler.epoch + 1)
        bar.close()
        with signals.stop_on_signals(stop):  # while saving: a repeat changes nothing, a second Ctrl-C aborts
            if self.stopping and self.step < self.total_steps:  # a vote read at the last step: just finish
                self.save_checkpoint()
                last = {**last, **stop.report(self.step)}
                by = last[signals.STOPPED_BY]
                log.info("stopped by %s at step %d; resume with trainer.resume=%s", by, self.step, self.run_dir)
            else:
                self.finish()
        return last

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], stop_requested: bool = False) -> StepResult:
        """One optimizer step over this rank's micro-batches.

        The step's gradient is d/dθ [Σ token losses over the global batch] / N, where N is
        the number of target tokens in the global batch (all ranks, all micro-steps). Each
        rank back-propagates its loss sum × world_size / N; DDP then averages over ranks
        (÷ world_size), which leaves exactly Σ/N whatever the split into ranks and micro-steps.
        The same all-reduce carries the stop request (SIGTERM, Ctrl-C), so every rank learns of
        it at the same step at no extra cost; the result holds the votes, read one step later.
        Nothing here waits for the device: the counts go up and come back as device tensors.
        """
        # Counted on the CPU copies: no wait on the device.
        local_tokens = sum(b["target_index"].numel() for b in micro_batches)  # the collator found the targets
        batch_tokens = [batch_token_counts(b) for b in micro_batches]
        batches = [self._to_device(b) for b in micro_batches]
        counts = torch.tensor([local_tokens, float(stop_requested)], dtype=torch.float64)
        n_tokens, stop_votes = parallel.all_reduce_sum(counts.to(self.env.device, non_blocking=True))
        # In fp32 (the scale is exact there), whatever the precision of the loss.
        scale = self.env.world_size / n_tokens.clamp(min=1).float()
        loss_sum = torch.zeros((), device=self.env.device)
        for i, batch in enumerate(batches):
            with parallel.grad_sync(self.model, enabled=i == len(batches) - 1), self._autocast():
                micro_loss, _ = self.model(**batch)
            self.scaler.scale(micro_loss * scale).backward()
            loss_sum += micro_loss.detach().float()
        if self.step == 0:
            self.check_every_trainable_param_has_a_gradient()
        grad_norm = self._clip_gradients()
        # GradScaler lowers its scale (a device tensor, updated in place) exactly when it skips a step;
        # get_scale() would copy it to the host and wait for the step to finish.
        scale_before = self.scaler._scale.clone() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        skipped = self.scaler._scale < scale_before if scale_before is not None else False
        return StepResult(loss_sum, local_tokens, grad_norm, skipped, batch_tokens, stop_votes)

    def _clip_gradients(self) -> torch.Tensor:
        self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.optim.max_grad_norm or math.inf
        return torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)

    def _autocast(self) -> contextlib.AbstractContextManager:
        precision = self.cfg.trainer.precision
        if precision == DType.fp32:
            return contextlib.nullcontext()
        return torch.autocast(self.env.device.type, dtype=TORCH_DTYPES[precision])

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Tensors to the device; plain numbers (flash-attention's max lengths) stay as they are."""
        moved = {k: v.to(self.env.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        return mark_target_count_dynamic(moved) if self.cfg.trainer.compile else moved

    # ------------------------------------------------------------------ checks

    def check_every_trainable_param_has_a_gradient(self) -> None:
        """Before the first optimizer step: name trainable parameters that got no gradient on any rank.

        Under DDP such a parameter stalls its gradient bucket and the next step fails with
        "Expected to have finished reduction in the prior iteration"; say which ones and why.
        """
        missing = sorted(n for n, p in self.loss_module.named_parameters() if p.requires_grad and p.grad is None)
        per_rank = parallel.all_gather_object(missing)
        unused = sorted(set().union(*per_rank))
        if not unused:
            return
        names = ", ".join(unused[:10]) + (f" and {len(unused) - 10} more" if len(unused) > 10 else "")
        if self.env.world_size > 1 and not self.cfg.parallel.find_unused_parameters:
            raise RuntimeError(
                f"{len(unused)} trainable parameters received no gradient in step 1: {names}. Freeze them "
                "(e.g. narrow model.lora_target_modules), or set parallel.find_unused_parameters=true."
            )
        log.warning("%d trainable parameters received no gradient in step 1: %s", len(unused), names)

    def preflight(self) -> None:
        """After step 1: replicas identical on every rank (catches a loss computed outside DDP)."""
        checksums = parallel.all_gather_object(parallel.trainable_checksum(self.loss_module))
        if any(c != checksums[0] for c in checksums):
            raise RuntimeError(
                f"trainable parameters differ between ranks after step 1 (checksums {checksums}): gradients "
                "were not synchronised. The loss must be computed inside the DDP-wrapped module."
            )

    # ------------------------------------------------------------------ logging, eval, save

    def log_window(self, watch: Stopwatch, grad_norm: torch.Tensor) -> dict[str, Any]:
        """Reduce the window's loss over ranks, write one metrics record (all ranks return it), start a new window."""
        window, self.window = self.window, Window()
        epoch = self.sampler.epoch
        local = torch.tensor([float(window.loss_sum), window.target_tokens], dtype=torch.float64)
        totals = parallel.all_reduce_sum(local)
        seconds = watch.lap()
        real, padded, imbalance, peak = batch_stats(parallel.all_gather_tensor(torch.tensor(window.batch_tokens)))
        calls, syncs, sent = self.comm.take()
        record = {
            "step": self.step,
            "epoch": epoch,
            "loss": float(totals[0] / max(totals[1], 1.0)),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "tokens": real,
            "target_tokens": int(totals[1]),
            "tokens_per_s": real / max(seconds, 1e-9),
            "padding_fraction": 1.0 - real / max(padded, 1),
            "rank_imbalance": imbalance,
            "peak_rank_tokens": peak,
            "skipped_steps": int(window.skipped),
            # Per optimizer step and rank, as DDP's communication hook saw them.
            "allreduce_syncs_per_step": syncs / window.steps,
            "allreduce_calls_per_step": calls / window.steps,
            "allreduce_bytes_per_step": sent / window.steps,
            "elapsed_s": watch.elapsed(),
        }
        self.metrics.log(record)
        return record

    def maybe_evaluate(self) -> None:
        every = self.cfg.trainer.eval_every_n_steps
        if self.data.eval is not None and every and self.step % every == 0 and self.step < self.total_steps:
            self.evaluate()

    def evaluate(self) -> float:
        """Mean target-token loss over the whole eval split (every rank a disjoint shard, none dropped)."""
        self.loss_module.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad(), self._autocast():
            for batch in self._eval_batches():
                loss_sum, n = self.loss_module(**self._to_device(batch))
                totals += torch.tensor([float(loss_sum), float(n)], dtype=torch.float64)
        self.loss_module.train()
        totals = parallel.all_reduce_sum(totals)
        eval_loss = float(totals[0] / max(totals[1], 1.0))
        self.metrics.log({"step": self.step, "eval_loss": eval_loss, "eval_tokens": int(totals[1])})
        log.info("step %d: eval_loss %.4f", self.step, eval_loss)
        return eval_loss

    def _eval_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        assert self.data.eval is not None
        lengths = self.data.eval["length"]
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        shard = order[self.env.rank :: self.env.world_size]
        size = self.cfg.data.micro_batch_size
        collator = Collator(self.tokenizer.pad_token_id, self.cfg.data.pad_to_multiple_of)
        rows = RowsDataset(self.data.eval)
        for start in range(0, len(shard), size):
            yield collator([rows[(i,)] for i in shard[start : start + size]])

    def maybe_save(self) -> None:
        every = self.cfg.trainer.save_every_n_steps
        if every and self.step % every == 0 and self.step < self.total_steps:
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        """Every rank contributes its RNG state; rank 0 writes; everyone waits at the barrier.

        Raises:
            RuntimeError: the write failed (the previous checkpoint is intact and named).
        """
        rng = parallel.all_gather_object(checkpoint.capture_rng())
        # Each rank's partial log window: its loss and token counts are its own, not rank 0's.
        windows = parallel.all_gather_object(self.window.state_dict())
        state = {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "windows": windows,
            "rng": rng,
        }
        meta = {
            "step": self.step,
            **self.sampler.state_dict(),
            "world_size": self.env.world_size,
            "data_order": self._data_order(),
        }
        try:
            self.writer.save(self.loss_module.model, state, meta)
        except Exception as err:
            previous = checkpoint.newest_complete(self.run_dir / "checkpoints")
            raise RuntimeError(
                f"saving the checkpoint of step {self.step} failed: {type(err).__name__}: {err}. "
                f"The previous checkpoint is intact: {previous or 'none yet'}."
            ) from err
        parallel.barrier()

    def _data_order(self) -> dict[str, Any]:
        """The settings that fix which samples each step sees: a resumed run must share them."""
        d = self.cfg.data
        return {
            "world_size": self.env.world_size,
            "seed": self.cfg.trainer.seed,
            "grad_accum_steps": self.cfg.optim.grad_accum_steps,
            "path": d.path,
            "max_rows": d.max_rows,
            "eval_fraction": d.eval_fraction,
            "max_length": d.max_length,
            "batching": d.batching.value,
            "micro_batch_size": d.micro_batch_size,
            "max_tokens_per_batch": d.max_tokens_per_batch,
            "pad_to_multiple_of": d.pad_to_multiple_of,
            "dataset_rows": len(self.data.train),
        }

    def maybe_resume(self) -> None:
        """Continue from trainer.resume (auto: the newest checkpoint of this run directory, if any).

        Raises:
            CheckpointError: the checkpoint does not fit this run (world size, data order, model).
        """
        folder = checkpoint.find_checkpoint(self.cfg.trainer.resume, self.run_dir)
        if folder is None:
            return
        manifest = checkpoint.read_manifest(folder)  # find_checkpoint verified every file's hash
        saved, now = manifest["data_order"], self._data_order()
        changed = sorted(k for k in now if saved.get(k) != now[k])
        if changed:
            details = ", ".join(f"{k}: {saved.get(k)} -> {now[k]}" for k in changed)
            raise checkpoint.CheckpointError(
                f"{folder} was saved with a different data order ({details}); resuming would silently train on "
                "other samples. Resume with the same settings (and the same number of processes), or use "
                "trainer.resume=none to start over."
            )
        checkpoint.load_trainable_weights(self.loss_module.model, folder / checkpoint.WEIGHTS)
        state = checkpoint.load_state(folder)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        if "windows" in state:
            self.window.load_state_dict(state["windows"][self.env.rank])
        else:  # saved before windows were kept per rank: the next log line covers the steps from here
            log.warning("%s keeps no per-rank log window: the first log line after resuming is partial", folder)
        self.step = state["step"]
        checkpoint.restore_rng(state["rng"][self.env.rank])
        log.info("resumed from %s at step %d (epoch %d)", folder, self.step, self.sampler.epoch)

    def finish(self) -> None:
        """Final evaluation, then rank 0 saves the adapter (and a random base) while the others wait."""
        if self.data.eval is not None:
            self.evaluate()
        if self.cfg.trainer.save_final:
            self.save_checkpoint()
            self.writer.save_final(self.loss_module.model, self.tokenizer, self.cfg.model, self.cfg.trainer.seed)
        parallel.barrier()
        self.metrics.close()


def batch_stats(tokens: torch.Tensor) -> tuple[int, int, float, int]:
    """Figures of a log window from every rank's measured ``(real, padded)`` tokens per micro-step.

    Args:
        tokens: ``[world_size, micro_steps, 2]`` integers, as gathered from the ranks.

    Returns:
        Real and padded tokens over all ranks, the worst micro-step's rank imbalance (largest padded
        micro-batch / mean over ranks) and the largest padded micro-batch of any rank.
    """
    real, padded = int(tokens[..., 0].sum()), int(tokens[..., 1].sum())
    per_rank = tokens[..., 1].double()  # [world, micro_steps]
    imbalance = float((per_rank.max(dim=0).values / per_rank.mean(dim=0).clamp(min=1e-9)).max())
    return real, padded, max(imbalance, 1.0), int(per_rank.max())


def chunked(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive lists of ``size`` items (the last may be shorter): micro-batches of one optimizer step."""
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
