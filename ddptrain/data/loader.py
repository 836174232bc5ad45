"""The data side of a run, assembled: ``build_training_data`` is the one call the trainer makes.

It builds the tokenized sets (``mixture.py``; local rank 0 tokenizes while the other ranks wait, then they
read its cache), plans this rank's micro-batches (``sampler.py``), and hands back the loader, the eval
shard and the data-order fingerprint (``DataOrder``) that a resumed run must match. It takes the ``data``
group; what other groups decide (the seed, ``grad_accum_steps``, the attention kernel, the process group)
arrives as arguments, so a reader finds every ``data.*`` key on this side.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import datasets
import torch

from ddptrain import parallel
from ddptrain.config import DataConfig
from ddptrain.data.batch_cost import ceil_div
from ddptrain.data.collate import REFERENCE_COLUMN, Collator, RowsDataset, build_collator
from ddptrain.data.encode import RANK_ZERO_ONLY
from ddptrain.data.mixture import build_datasets
from ddptrain.data.plan import BatchingSpec, eval_batch_plan
from ddptrain.data.sampler import DistributedBatchSampler, Layout
from ddptrain.data.show import marked_text
from ddptrain.data.tokenized import TokenizedData
from ddptrain.parallel import DistEnv
from ddptrain.process import hangs, signals

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__package__)  # "ddptrain.data": the data side's modules log under one name, as before the split


@dataclass
class TrainingData:
    """What the trainer gets from the data side: this rank's micro-batches and eval shard.

    ``sampler`` holds the data position (epoch, micro-steps consumed) that a checkpoint saves;
    ``fingerprint`` holds the settings that fix which samples each step sees, which a resumed run
    must share.
    """

    train: datasets.Dataset
    eval: datasets.Dataset | None
    sampler: DistributedBatchSampler
    loader: torch.utils.data.DataLoader
    fingerprint: DataOrder
    eval_collator: Collator
    eval_micro_batch_size: int
    env: DistEnv

    @property
    def tokenized(self) -> TokenizedData:
        """The train and eval sets as the memory plan reads them (with the samples each epoch draws)."""
        return TokenizedData(self.train, self.eval, {}, self.sampler.epoch_rows)

    def use_reference(self, train: torch.Tensor, eval_: torch.Tensor | None) -> None:
        """objective.reference=precomputed: each pair's reference log-probabilities (a [pairs, 2] tensor per split,
        chosen and rejected) go into its rows, so every batch carries them; before the loader's first epoch."""
        self.train = self.train.add_column(REFERENCE_COLUMN, train.tolist())
        self.loader.dataset.read(self.train)
        if self.eval is not None and eval_ is not None:
            self.eval = self.eval.add_column(REFERENCE_COLUMN, eval_.tolist())

    def optimizer_steps(self) -> Iterator[list[dict[str, Any]]]:
        """The rest of the epoch, ``grad_accum_steps`` micro-batches at a time (the last step may be short)."""
        step: list[dict[str, Any]] = []
        for batch in self.loader:
            step.append(batch)
            if len(step) == self.sampler.layout.grad_accum_steps:
                yield step
                step = []
        if step:
            yield step

    def steps_per_epochs(self, epochs: int) -> int:
        """Optimizer steps in the first ``epochs`` epochs (token_budget and packed plans vary by epoch)."""
        accum = self.sampler.layout.grad_accum_steps
        return sum(ceil_div(self.sampler.epoch_length(epoch), accum) for epoch in range(epochs))

    def eval_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's share of the eval split (``plan.eval_batch_plan``: every row on exactly one rank), collated on
        the CPU."""
        assert self.eval is not None
        rows = RowsDataset(self.eval)
        plan = eval_batch_plan(self.eval["length"], self.eval_micro_batch_size, self.env.world_size)
        for batch in plan[self.env.rank]:
            yield self.eval_collator([rows[(i,)] for i in batch])


SAMPLE_LOG_TOKENS = 1024  # the start-up log shows at most this much of the first sample


def log_first_sample(train: datasets.Dataset, tokenizer: PreTrainedTokenizerBase) -> None:
    """The first training sample as the model sees it, trained text marked, in the log (rank 0): a template that
    masks the wrong span shows at once. ``ddptrain preview`` shows any sample, and the batch plan."""
    row = train[0]
    for name, prefix in (("chosen", ""), ("rejected", "rejected_")) if "rejected_input_ids" in row else (("", ""),):
        ids, labels = row[f"{prefix}input_ids"][:SAMPLE_LOG_TOKENS], row[f"{prefix}labels"][:SAMPLE_LOG_TOKENS]
        more = len(row[f"{prefix}input_ids"]) - len(ids)
        log.info(
            "data: training row 0%s as the model sees it, trained text between [[ and ]]%s:\n%s",
            f", {name} (a preference pair)" if name else "",
            f" (its first {SAMPLE_LOG_TOKENS} tokens of {len(row[f'{prefix}input_ids'])})" if more else "",
            marked_text(tokenizer, ids, labels, colour=False),
            extra=RANK_ZERO_ONLY,
        )


def _loader_start_method(num_workers: int) -> str | None:
    """How the loader's workers start: ``fork`` on Linux, whatever started this rank.

    The self-launcher spawns its ranks, and a spawned process makes ``spawn`` its default: each loader worker would
    then import torch, transformers and ddptrain afresh, measured 4.4 s at every epoch's start (tiny model, this
    machine), which ``fork`` makes a fraction of a second. A forked worker only reads rows and collates them on the
    CPU; it is what torchrun's ranks (started with ``subprocess``) get anyway. Elsewhere Python's default stays.
    """
    if num_workers == 0 or sys.platform != "linux":
        return None
    return "fork"


def build_training_data(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    env: DistEnv,
    *,
    seed: int,
    grad_accum_steps: int,
    flash_varlen: bool,
    planned_for: tuple[int, int] | None = None,
) -> TrainingData:
    """Tokenize (local rank 0 first, the others read its cache), plan the batches, build the loader.

    Args:
        cfg: the ``data`` group; the values other groups decide arrive as the arguments below, so a
            reader finds every ``data.*`` key on this side.
        tokenizer: the model's tokenizer.
        env: this rank's place in the process group.
        seed: ``trainer.seed`` (the shuffle, the eval split and the loader's workers).
        grad_accum_steps: ``optim.grad_accum_steps`` (micro-batches per optimizer step).
        flash_varlen: the model runs flash-attention's varlen kernel
            (``model.attn_implementation=flash_attention_2``): packed rows carry their sample lengths.
        planned_for: ``(world_size, grad_accum_steps)`` of the plan a checkpoint this run resumes on another
            number of processes was made for (``checkpoint.planned_for``): with as many micro-batches per step
            (``world_size * grad_accum_steps``), its steps' micro-batches are dealt to this run's ranks; None, or
            other micro-batches per step: this run's own plan (the checkpoint's data-order check refuses it then).

    Raises:
        ValueError: unreadable data, or too little of it for one micro-step (naming the key).
    """
    hangs.board.enter("tokenize")  # every rank: local rank 0 tokenizes, the others wait, then read its cache
    with parallel.local_rank_zero_first(env, cfg.prepare_timeout_s, "tokenizing the dataset"):
        data = build_datasets(cfg, tokenizer, seed)
    log_first_sample(data.train, tokenizer)
    hangs.board.enter("plan_batches")  # back under parallel.timeout_s: the plan check below is a collective
    layout = Layout(env.world_size, grad_accum_steps)
    planned = Layout(*planned_for) if planned_for else layout
    if planned.micro_batches_per_step != layout.micro_batches_per_step:
        planned = layout
    plan_world, plan_accum = planned.world_size, planned.grad_accum_steps
    spec = build_batching_spec(cfg, plan_world, plan_accum, seed)
    sampler = DistributedBatchSampler(data.train["length"], spec, env.rank, data.epoch_rows, layout)
    parallel.check_same_on_all_ranks(
        len(sampler), "micro-batches per epoch", "Every rank must build the same batch plan; this is a bug."
    )
    log.info(
        "batches: %d micro-batches per rank per epoch (data.batching=%s), %d per optimizer step",
        len(sampler),
        cfg.batching.value,
        grad_accum_steps,
    )
    collator = build_collator(cfg, tokenizer.pad_token_id, flash_varlen)
    loader = _build_loader(data.train, sampler, collator, cfg.num_workers, env, seed)
    fingerprint = DataOrder.build(
        cfg, world_size=plan_world, seed=seed, grad_accum_steps=plan_accum, dataset_rows=len(data.train)
    )
    eval_collator = Collator(tokenizer.pad_token_id, cfg.pad_to_multiple_of)
    return TrainingData(data.train, data.eval, sampler, loader, fingerprint, eval_collator, cfg.micro_batch_size, env)


def _build_loader(
    train: datasets.Dataset,
    sampler: DistributedBatchSampler,
    collator: Collator,
    num_workers: int,
    env: DistEnv,
    seed: int,
) -> torch.utils.data.DataLoader:
    """The training loader: this rank's planned micro-batches, read and collated by ``data.num_workers`` workers."""
    return torch.utils.data.DataLoader(
        RowsDataset(train),
        batch_sampler=sampler,
        collate_fn=collator,
        num_workers=num_workers,
        multiprocessing_context=_loader_start_method(num_workers),
        pin_memory=env.device.type == "cuda",
        persistent_workers=False,
        # Its own generator: otherwise every new iterator draws its base seed from the global RNG,
        # and a run resumed mid-epoch would draw at another point than the uninterrupted run did,
        # shifting every dropout mask after it.
        generator=torch.Generator().manual_seed(seed),
        # A terminal's Ctrl-C or a scheduler's SIGTERM reaches every process of the job: the
        # loader's workers leave the stop to the training process, which shuts them down.
        # A rank killed outright takes its workers with it (signals.die_with).
        worker_init_fn=functools.partial(signals.init_loader_worker, os.getpid()),
    )


@dataclass(frozen=True)
class DataOrder:
    """The settings that fix which samples each step sees: a resumed run must share every one.

    ``values`` go into each checkpoint's manifest (``data_order``) under these short names. ``world_size`` and
    ``grad_accum_steps`` are those the plan is made for: a run resumed on another number of processes trains its
    checkpoint's plan and keeps them (``checkpoint.planned_for``).
    """

    values: dict[str, Any]

    # How the user sets each value; the others are data.<name>.
    SET_BY: ClassVar[dict[str, str]] = {
        "world_size": "number of processes",
        "seed": "trainer.seed",
        "grad_accum_steps": "optim.grad_accum_steps",
        "dataset_rows": "rows left after tokenizing data.path",
    }

    @classmethod
    def build(
        cls, cfg: DataConfig, *, world_size: int, seed: int, grad_accum_steps: int, dataset_rows: int
    ) -> DataOrder:
        """This run's data order: the ``data`` group's values, and those other groups decide, passed in.

        Args:
            cfg: the ``data`` group.
            world_size: the number of processes the plan is made for.
            seed: ``trainer.seed``.
            grad_accum_steps: the ``optim.grad_accum_steps`` the plan is made for.
            dataset_rows: training rows left after tokenizing.
        """
        values = {
            "world_size": world_size,
            "seed": seed,
            "grad_accum_steps": grad_accum_steps,
            "path": cfg.path,
            "max_rows": cfg.max_rows,
            "eval_fraction": cfg.eval_fraction,
            "max_length": cfg.max_length,
            "batching": cfg.batching.value,
            "micro_batch_size": cfg.micro_batch_size,
            "max_tokens_per_batch": cfg.max_tokens_per_batch,
            "pad_to_multiple_of": cfg.pad_to_multiple_of,
            "dataset_rows": dataset_rows,
            # Empty without a mixture (older checkpoints keep no sources then: checkpoint.format reads them).
            "sources": [json.dumps(dataclasses.asdict(s), default=str) for s in cfg.sources],
            # Only when set: checkpoints from before these keys resume as before.
            **{key: value for key, value in (("revision", cfg.revision), ("eval_split", cfg.eval_split)) if value},
        }
        return cls(values)

    def changes_from(self, saved: dict[str, Any]) -> list[str]:
        """``"<key as the user sets it>: <saved> -> <now>"`` for every value that differs from ``saved``."""
        return [
            f"{self.SET_BY.get(name, f'data.{name}')}: {saved.get(name)} -> {value}"
            for name, value in sorted(self.values.items())
            if saved.get(name) != value
        ]


def build_batching_spec(cfg: DataConfig, world_size: int, grad_accum_steps: int, seed: int) -> BatchingSpec:
    """The sampler's spec from the ``data`` group, with the values other groups own passed in."""
    return BatchingSpec(
        mode=cfg.batching,
        world_size=world_size,
        micro_batch_size=cfg.micro_batch_size,
        max_tokens_per_batch=cfg.max_tokens_per_batch,
        grad_accum_steps=grad_accum_steps,
        pad_to_multiple_of=cfg.pad_to_multiple_of,
        seed=seed,
        costliest_first=cfg.costliest_first,
    )
