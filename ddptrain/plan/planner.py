"""``make_plan``: the run's memory plan from its config and its tokenized data, and the levers that change it."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
from transformers import PretrainedConfig

from ddptrain.config import Batching, Objective, RunConfig, Strategy
from ddptrain.data.loader import build_batching_spec
from ddptrain.data.plan import BatchingSpec, plan_epoch
from ddptrain.data.tokenized import TokenizedData
from ddptrain.model import architecture_config
from ddptrain.plan.batches import (
    PAIRED_LABELS,
    Candidate,
    CostliestRows,
    eval_candidate,
    training_candidates,
    worst_case_shape,
)
from ddptrain.plan.budget import (
    Lever,
    MemoryPlan,
    StepPeak,
    device_limit,
    eval_peak,
    fixed_costs,
    largest_fitting,
    planned_device,
    precision_of,
    save_check_bytes,
    step_peak,
)
from ddptrain.plan.simulate import FakeModel
from ddptrain.plan.strategy import OFFLOAD, RESHARD, Held, held_memory, step_model

log = logging.getLogger(__name__)

ALL_ROWS = "all {rows} training rows of this data in one micro-batch: no larger setting changes it"


def make_plan(
    cfg: RunConfig,
    data: TokenizedData,
    world_size: int,
    with_levers: bool = True,
    only_ranks: set[int] | None = None,
    gpus: list[int] | None = None,
    limit: int | None = None,
) -> MemoryPlan:
    """Every rank's predicted peak for the run ``cfg`` on ``world_size`` ranks, with its data already tokenized
    (``only_ranks``: simulate these ranks' micro-batches alone, as each rank of a starting run does for itself;
    ``gpus``: the GPUs whose free memory is the limit, a starting rank's own; None: every visible one; ``limit``:
    the bytes to fit instead, the verdict's, that the largest sizes and the levers are planned against: a starting
    run's, the least over its ranks). Call it before any weight loads: on a CPU the process's resident set now is
    the plan's baseline (``budget.resident_at_start``)."""
    device = planned_device(cfg)
    fixed = fixed_costs(cfg.plan, device, world_size)  # first: the resident set before the fake model is built
    config = architecture_config(cfg.model)
    precision = precision_of(cfg, device)
    built = FakeModel(config, cfg.model, precision, compiled=cfg.trainer.compile, objective=cfg.objective)
    model = step_model(built, config, cfg, precision)  # fsdp2: computed on its gathered copies, in param_dtype
    spec = build_batching_spec(cfg.data, world_size, cfg.optim.grad_accum_steps, cfg.trainer.seed)
    held = held_memory(built, cfg, world_size, spec.grad_accum_steps, device, precision)
    measured, source = device_limit(cfg.plan, device, gpus)
    limit = measured if limit is None else limit
    plan = MemoryPlan(
        device=device,
        device_bytes=limit,
        limit_source=source,
        world_size=world_size,
        fixed=fixed,
        slack_share=cfg.plan.allocator_slack if device == "cuda" else 0.0,
        ranks=_rank_peaks(model, _of(training_candidates(data, spec, epochs_to_search(cfg, data, spec)), only_ranks)),
        strategy=cfg.parallel.strategy.value,
        **_held_fields(held),
    )
    evaluated = eval_candidate(data, cfg.data.micro_batch_size, world_size, spec)
    plan.eval = eval_peak(model, evaluated) if evaluated else None
    plan.save_check = save_check_bytes(built, cfg, config.vocab_size, device)
    if with_levers:
        plan.largest, plan.largest_on_data = largest_settings(plan, model, cfg, data, spec)
        plan.levers = levers(plan, cfg, data, spec, config, model)
        if plan.check_peak == plan.worst:  # the save check is what does not fit: it can go
            without = max(plan.peak(plan.fullest), plan.peak(plan.eval) if plan.eval else 0)
            plan.levers.append(Lever("trainer.save_check=off", without, "no second copy of the weights on rank 0"))
    return plan


def largest_settings(
    plan: MemoryPlan, model: FakeModel, cfg: RunConfig, data: TokenizedData, spec: BatchingSpec
) -> tuple[str | None, str | None]:
    """The largest batch setting that fits (``data.micro_batch_size`` for random and length_grouped, else
    ``data.max_tokens_per_batch``), twice: for the worst case any data could give (every row at data.max_length,
    every position trained), and for this data (``CostliestRows``: as wide as its longest row, as many positions
    trained as its most-trained rows), searched up to the size that holds every training row of this data in one
    micro-batch, beyond which nothing changes (``CostliestRows.whole``; tokens rounded up to data.max_length), and
    labelled so when it fits. (None, None) without a limit to fit."""
    if plan.device_bytes is None:
        return None, None
    d = cfg.data
    by_rows = d.batching in (Batching.random, Batching.length_grouped)
    key, unit = ("data.micro_batch_size", 1) if by_rows else ("data.max_tokens_per_batch", d.max_length)
    pairs = PAIRED_LABELS in data.train.column_names  # objective=dpo, a mixture's sources included
    worst = largest_fitting(plan, model, worst_case_shape(d, pairs), unit)
    costliest = CostliestRows(data, spec)
    whole = -(-costliest.whole // unit) * unit
    on_data = largest_fitting(plan, model, costliest, unit, most=whole)
    if worst is None:
        worst_words = "nothing fits: not even one row of data.max_length" if by_rows else "nothing fits"
    else:
        worst_words = f"{key}={worst}" + (f" at data.max_length={d.max_length}" if by_rows else "")
    data_words = "nothing fits: not even one row of this data's longest" if on_data is None else f"{key}={on_data}"
    if on_data == whole:
        data_words += f" ({ALL_ROWS.format(rows=costliest.most)})"
    return worst_words, data_words


def epochs_to_search(cfg: RunConfig, data: TokenizedData, spec: BatchingSpec) -> int:
    """The epochs the run trains (from trainer.max_steps, else trainer.epochs), at most plan.max_epochs."""
    epochs = cfg.trainer.epochs
    if cfg.trainer.max_steps is not None:
        lengths = np.asarray(data.train["length"], dtype=np.int64)
        if data.epoch_rows is not None:
            lengths = lengths[np.asarray(data.epoch_rows(0), dtype=np.int64)]
        micro_steps = len(plan_epoch(lengths, spec, 0))
        epochs = math.ceil(cfg.trainer.max_steps * spec.grad_accum_steps / max(micro_steps, 1))
    return epochs if cfg.plan.max_epochs == 0 else min(epochs, cfg.plan.max_epochs)


def _held_fields(held: Held) -> dict[str, object]:
    """``Held`` as the fields of a ``MemoryPlan``."""
    return dataclasses.asdict(held)


def _of(candidates: list[Candidate], ranks: set[int] | None) -> list[Candidate]:
    return candidates if ranks is None else [c for c in candidates if c.rank in ranks]


def _rank_peaks(model: FakeModel, candidates: list[Candidate]) -> list[StepPeak]:
    """Each rank's fullest step among its candidates."""
    peaks: dict[int, StepPeak] = {}
    for candidate in candidates:
        step = step_peak(model, candidate)
        current = peaks.get(candidate.rank)
        if current is None or step.activations + step.transient > current.activations + current.transient:
            peaks[candidate.rank] = step
    return [peaks[rank] for rank in sorted(peaks)]


def levers(
    plan: MemoryPlan,
    cfg: RunConfig,
    data: TokenizedData,
    spec: BatchingSpec,
    config: PretrainedConfig,
    model: FakeModel,
) -> list[Lever]:
    """What each setting ddptrain offers would make of the fullest rank's peak, simulated, not estimated."""
    m, p = cfg.model, cfg.parallel
    found = []
    fullest = [plan.fullest.candidate]
    if not m.gradient_checkpointing:
        found.append(
            _model_lever(plan, cfg, config, fullest, "model.gradient_checkpointing=true", gradient_checkpointing=True)
        )
    if m.loss_chunk_tokens == 0:
        found.append(_model_lever(plan, cfg, config, fullest, "model.loss_chunk_tokens=512", loss_chunk_tokens=512))
    if m.lora and m.lora_rank >= 2:
        found.append(
            _model_lever(plan, cfg, config, fullest, f"model.lora_rank={m.lora_rank // 2}", lora_rank=m.lora_rank // 2)
        )
    # Sharding is slower than a replica (a layer's weights all-gathered in forward and again in backward): named only
    # where the replica does not fit.
    if p.strategy == Strategy.ddp and plan.world_size > 1 and plan.fits is False and not cfg.model.base_adapter:
        note = f"each rank 1/{plan.world_size} of the weights, gradients and AdamW states; layers gathered per use"
        found.append(_parallel_lever(plan, cfg, config, "parallel.strategy=fsdp2", note, strategy=Strategy.fsdp2))
    if p.strategy == Strategy.fsdp2 and not p.reshard_after_forward:
        found.append(_parallel_lever(plan, cfg, config, f"{RESHARD}=true", "", reshard_after_forward=True))
    if p.strategy == Strategy.fsdp2 and not p.cpu_offload:
        note = "the optimizer steps on the CPU"
        found.append(_parallel_lever(plan, cfg, config, f"{OFFLOAD}=true", note, cpu_offload=True))
    # FSDP2 holds every unit's unsharded gradients between the micro-steps of an accumulation (no-sync).
    more = plan if p.strategy == Strategy.ddp else _replanned_held(plan, cfg, config, spec.grad_accum_steps * 2)[0]
    found += _batch_levers(plan, more, cfg, data, spec, model)
    # A lever that saves under 1% of the peak is no lever.
    return [lever for lever in found if lever.peak < 0.99 * plan.peak(plan.fullest)]


def _model_lever(
    plan: MemoryPlan, cfg: RunConfig, config: PretrainedConfig, candidates, overrides: str, **changes
) -> Lever:
    changed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))
    other, model = _replanned_held(plan, changed, config)
    return Lever(overrides, max(other.peak(step_peak(model, c)) for c in candidates))


def _parallel_lever(
    plan: MemoryPlan, cfg: RunConfig, config: PretrainedConfig, overrides: str, note: str, **changes
) -> Lever:
    """The same run with ``changes`` to cfg.parallel: its fullest rank's training peak, and its evaluation peak
    (what a rank holds changes both)."""
    changed = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **changes))
    other, model = _replanned_held(plan, changed, config)
    evaluation = other.peak(eval_peak(model, plan.eval.candidate)) if plan.eval else None
    return Lever(overrides, other.peak(step_peak(model, plan.fullest.candidate)), note, eval_peak=evaluation)


def _replanned_held(
    plan: MemoryPlan, cfg: RunConfig, config: PretrainedConfig, grad_accum_steps: int | None = None
) -> tuple[MemoryPlan, FakeModel]:
    """``plan`` with what a rank holds under ``cfg`` instead, and the model a micro-step of ``cfg`` computes with."""
    precision = precision_of(cfg, plan.device)
    built = FakeModel(config, cfg.model, precision, compiled=cfg.trainer.compile, objective=cfg.objective)
    accumulation = grad_accum_steps or _accumulation(cfg, plan.world_size)
    held = held_memory(built, cfg, plan.world_size, accumulation, plan.device, precision)
    other = dataclasses.replace(plan, strategy=cfg.parallel.strategy.value, **_held_fields(held))
    return other, step_model(built, config, cfg, precision)


def _accumulation(cfg: RunConfig, world_size: int) -> int:
    return build_batching_spec(cfg.data, world_size, cfg.optim.grad_accum_steps, cfg.trainer.seed).grad_accum_steps


def _batch_levers(
    plan: MemoryPlan,
    accumulating: MemoryPlan,
    cfg: RunConfig,
    data: TokenizedData,
    spec: BatchingSpec,
    model: FakeModel,
) -> list[Lever]:
    """A smaller micro-batch with more accumulation (the same global batch; ``accumulating``: what a rank holds with
    twice the accumulation), and a shorter data.max_length where rows are longer: each re-planned on epoch 0 of the
    data."""
    d, found = cfg.data, []
    # optim.global_batch_size derives the accumulation: naming it too would be refused ("both set").
    accumulate = "" if cfg.optim.global_batch_size else f" optim.grad_accum_steps={spec.grad_accum_steps * 2}"
    if d.batching in (Batching.random, Batching.length_grouped) and d.micro_batch_size >= 2:
        smaller = dataclasses.replace(
            spec, micro_batch_size=d.micro_batch_size // 2, grad_accum_steps=spec.grad_accum_steps * 2
        )
        overrides = f"data.micro_batch_size={d.micro_batch_size // 2}{accumulate}"
        found.append(_replanned(accumulating, model, data, smaller, overrides))
    elif d.batching in (Batching.token_budget, Batching.packed) and d.max_tokens_per_batch // 2 >= d.max_length:
        half = d.max_tokens_per_batch // 2
        smaller = dataclasses.replace(spec, max_tokens_per_batch=half, grad_accum_steps=spec.grad_accum_steps * 2)
        found.append(_replanned(accumulating, model, data, smaller, f"data.max_tokens_per_batch={half}{accumulate}"))
    shorter = d.max_length // 2
    # A pair's prompt is cut before its replies: its rows under a shorter data.max_length are not these rows cut.
    if shorter >= 16 and max(data.train["length"]) > shorter and cfg.objective.name != Objective.dpo:
        found.append(_replanned(plan, model, data, spec, f"data.max_length={shorter}", max_length=shorter))
    return found


def _replanned(
    plan: MemoryPlan,
    model: FakeModel,
    data: TokenizedData,
    spec: BatchingSpec,
    overrides: str,
    max_length: int | None = None,
) -> Lever:
    candidates = training_candidates(data, spec, epochs=1, max_length=max_length)
    # The rank with the most padded tokens stands for all: each simulation of a 7B model takes seconds.
    costliest = max(candidates, key=lambda c: (c.shape.tokens, c.shape.width))
    return Lever(overrides, plan.peak(step_peak(model, costliest)), "epoch 0's plan")
