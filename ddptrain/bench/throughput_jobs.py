"""Worker bodies of the throughput benchmark: one per way of training (see ``throughput.py``).

``run_job(cfg, run_dir, store_port)`` is the entrypoint that ``ddptrain.launch.launch`` starts on
every rank. What to run is read from ``<run_dir>/job.json``; every rank writes
``<run_dir>/rank<R>.json`` with what it measured:

- ``seconds`` / ``cpu_seconds``: wall time / this process's CPU time (``time.process_time``, all its
  threads) from the end of the last warm-up step to the end of the last measured step;
- ``real_tokens`` / ``target_tokens``: non-padding tokens / tokens with a label, over the measured
  steps, on this rank;
- ``peak_rss_mb``: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at the end (the whole process,
  tokenization and model build included);
- ``peak_cuda_mb``: ``torch.cuda.max_memory_allocated`` on GPU runs.

The three bodies share the tokenized rows (ddptrain's ``build_datasets``, same first N rows) and
the model (ddptrain's ``build_base_model`` + ``apply_lora``, same seed), so they differ only in the
training loop around them.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ddptrain.config import Precision, RunConfig
from ddptrain.process.started import Start


def run_job(cfg: RunConfig, run_dir: str, store_port: int | None) -> dict[str, Any]:
    """Entrypoint for ``ddptrain.launch.launch``: dispatch on ``job.json``'s ``kind``."""
    job = json.loads((Path(run_dir) / "job.json").read_text())
    body = {"ddptrain": _ddptrain, "hf": _hf_trainer, "hand": _hand_loop}[job["kind"]]
    result = body(cfg, Path(run_dir), store_port, job)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    if torch.cuda.is_available():
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    rank = Start.from_environ().rank
    (Path(run_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    return result


# ----------------------------------------------------------------------------- ddptrain


def _ddptrain(cfg: RunConfig, run_dir: Path, store_port: int | None, job: dict) -> dict[str, Any]:
    """The product as ``launch.worker`` runs it (group, shared run folder, logging, ``Trainer.fit``).

    ``Trainer.train_step`` is wrapped only to read the clocks and count tokens: the clock starts
    when step warmup+1 begins and stops when the last step ends, so everything ``fit`` does in
    between (logging, metrics, sampler bookkeeping) is inside the measurement.
    """
    from ddptrain import parallel
    from ddptrain.observe.console import setup_logging
    from ddptrain.trainer import Trainer

    warmup, total = job["warmup"], job["warmup"] + job["steps"]
    clock = Clock()

    class TimedTrainer(Trainer):
        def train_step(self, micro_batches, **kwargs):
            if self.step == warmup:
                clock.start(self.env.device)
            result = super().train_step(micro_batches, **kwargs)
            if self.step >= warmup:
                for batch in micro_batches:
                    clock.count(batch)
            if self.step + 1 == total:
                clock.stop(self.env.device)
            return result

    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, run_dir)
        TimedTrainer(cfg, env, run_dir).fit()
    finally:
        parallel.teardown()
    return clock.result()


class Clock:
    """Wall and process CPU time of the measured steps, and the real / target tokens they trained."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.real = self.target = 0

    def start(self, device: torch.device) -> None:
        _sync(device)
        self.real = self.target = 0
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self, device: torch.device) -> None:
        _sync(device)
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def count(self, batch: dict[str, torch.Tensor]) -> None:
        real, target = _count(batch)
        self.real, self.target = self.real + real, self.target + target

    def result(self) -> dict[str, Any]:
        return {"seconds": self.wall, "cpu_seconds": self.cpu, "real_tokens": self.real, "target_tokens": self.target}


# ----------------------------------------------------------------------------- shared setup


def _data_and_model(cfg: RunConfig, device: torch.device):
    """ddptrain's tokenized rows and a fresh peft model (same seed as ddptrain's ``build_model``)."""
    from ddptrain.data import build_datasets
    from ddptrain.model import apply_gradient_checkpointing, apply_lora, build_base_model, build_tokenizer

    tokenizer = build_tokenizer(cfg.model)
    data = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
    model = apply_lora(build_base_model(cfg.model, cfg.trainer.seed), cfg.model, cfg.trainer.seed)
    if cfg.model.gradient_checkpointing:
        apply_gradient_checkpointing(model)
    return tokenizer, data, model.to(device)


def _device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = Start.from_environ().local_rank
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _count(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(real, target) tokens of a collated batch: padded rows carry an attention mask, packed rows none."""
    mask = batch.get("attention_mask")
    real = int(mask.sum()) if mask is not None else batch["input_ids"].numel()
    return real, int((batch["labels"][:, 1:] != -100).sum())


# ----------------------------------------------------------------------------- hand-written loop


def _hand_loop(cfg: RunConfig, run_dir: Path, store_port: int | None, job: dict) -> dict[str, Any]:
    """The floor: plain DDP over the same loss module, fed ddptrain's exact micro-batches.

    No accumulation logic, no global token count, no scheduler, no logging: forward, mean loss,
    backward, clip, AdamW step. Only the process group comes from the launcher's store.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddptrain.data import RowsDataset, build_batching_spec, build_collator
    from ddptrain.data.sampler import DistributedBatchSampler
    from ddptrain.model import CausalLMLoss

    device = _device()
    _init_group(device, store_port)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer, data, model = _data_and_model(cfg, device)
    spec = build_batching_spec(cfg.data, world, grad_accum_steps=1, seed=cfg.trainer.seed)
    loader = torch.utils.data.DataLoader(
        RowsDataset(data.train),
        batch_sampler=DistributedBatchSampler(data.train["length"], spec, rank),
        collate_fn=build_collator(cfg.data, tokenizer.pad_token_id),
        num_workers=0,
    )
    loss_module = CausalLMLoss(model, cfg.model.loss_chunk_tokens)  # the same loss path as ddptrain
    ddp = DDP(loss_module, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    params = [p for p in ddp.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.trainer.precision == Precision.bf16)
    clock = Clock()
    for step, batch in enumerate(loader, start=1):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast:
            loss_sum, n_targets = ddp(**batch)
        (loss_sum / n_targets.clamp(min=1)).backward()
        torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > job["warmup"]:
            clock.count(batch)
        if step == job["warmup"]:
            clock.start(device)
        if step == job["warmup"] + job["steps"]:
            clock.stop(device)
            break
    dist.destroy_process_group()
    return clock.result()


def _init_group(device: torch.device, store_port: int | None) -> None:
    """Join the launcher's process group (the same TCPStore ddptrain's workers use)."""
    from datetime import timedelta

    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    start = Start.from_environ()
    rank, world = start.rank, start.world_size
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=600))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))


# ----------------------------------------------------------------------------- transformers Trainer


def _hf_trainer(cfg: RunConfig, run_dir: Path, store_port: int | None, job: dict) -> dict[str, Any]:
    """transformers ``Trainer`` on the same rows and peft model, with its own sampler and loss.

    The process group is formed first from the launcher's store; accelerate adopts an existing
    group. Real tokens are counted from the attention masks of the batches ``training_step`` gets;
    time runs from ``on_step_end`` of the last warm-up step to ``on_step_end`` of the last step.
    """
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ddptrain.data import Collator

    device = _device()
    _init_group(device, store_port)
    tokenizer, data, model = _data_and_model(cfg, device)
    clock = Clock()
    warmup, total = job["warmup"], job["warmup"] + job["steps"]

    class CountingTrainer(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            clock.count(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                clock.start(device)
            elif state.global_step == total:
                clock.stop(device)

    padder = Collator(tokenizer.pad_token_id, cfg.data.pad_to_multiple_of)
    o = cfg.optim
    args = TrainingArguments(
        output_dir=str(run_dir / "hf"),
        per_device_train_batch_size=cfg.data.micro_batch_size,
        gradient_accumulation_steps=o.grad_accum_steps,
        max_steps=total,
        learning_rate=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        max_grad_norm=o.max_grad_norm or 0.0,
        lr_scheduler_type="cosine",
        train_sampling_strategy=job["hf_strategy"],
        use_cpu=device.type == "cpu",
        ddp_backend="nccl" if device.type == "cuda" else "gloo",
        ddp_find_unused_parameters=False,  # its default under DDP is True for a model without checkpointing: slower
        bf16=cfg.trainer.precision == Precision.bf16,
        dataloader_num_workers=0,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=cfg.trainer.seed,
    )
    trainer = CountingTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        # The transformers model computes its own loss: it takes no target_index.
        data_collator=lambda features: {
            k: v for k, v in padder([[f] for f in features]).items() if k != "target_index"
        },
        callbacks=[Timer()],
    )
    with contextlib.redirect_stdout(sys.stderr):  # its end-of-training summary would break --json
        trainer.train()
    result = clock.result()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return result
