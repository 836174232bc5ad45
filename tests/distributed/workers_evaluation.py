"""Entrypoints for 2-process tests of what runs around the steps: the samples' generation, which must hold no
collective, and one real step whose peak memory each rank measures against the memory plan's prediction."""

from __future__ import annotations

import contextlib
import gc
import json
import resource
import time
from pathlib import Path

from ddptrain import parallel
from ddptrain.config import RunConfig
from ddptrain.evaluation.samples import build_samples
from ddptrain.model import build_model, build_tokenizer
from ddptrain.observe.console import setup_logging
from ddptrain.process.memory import return_freed_memory
from ddptrain.trainer import Trainer

LATE_S = 5.0
"""How late rank 1 comes to the samples' round: rank 0 must have generated and reached the gather by then."""


def generate_while_the_other_rank_is_away(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Rank 1 starts the samples' round ``LATE_S`` after rank 0; each rank records when it started and when it
    reached the round's one collective (the gather at its end), and the rows it got back."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, None)
        tokenizer = build_tokenizer(cfg.model)
        model = build_model(cfg.model, cfg.trainer.seed, env.device, tokenizer).model
        samples = build_samples(cfg.trainer, cfg.data, tokenizer, env.rank, env.world_size)
        reached: list[float] = []
        gather = parallel.all_gather_object

        def timed_gather(obj):
            reached.append(time.monotonic())
            return gather(obj)

        parallel.all_gather_object = timed_gather  # ddptrain.evaluation.samples calls it through the module
        parallel.barrier()  # both ranks are ready: from here rank 1 stays away
        if env.rank == 1:
            time.sleep(LATE_S)
        started = time.monotonic()
        rows = samples(model, 1, contextlib.nullcontext, env.device)
        parallel.all_gather_object = gather
        record = {"started": started, "gathers": reached, "rows": rows}
        (Path(run_dir) / f"samples-rank{env.rank}.json").write_text(json.dumps(record))
    finally:
        parallel.teardown()


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_resident_bytes() -> int:
    """VmHWM: the peak resident set since the last reset (``/proc/self/clear_refs``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def hand_freed_memory_back() -> None:
    """Every block of 64 KiB or more goes back to the system when freed (``process.memory.return_freed_memory``, the
    product's plan.cpu_returns_freed_memory): the resident set then follows what is alive."""
    if not return_freed_memory():
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: not glibc?")


def train_a_step_measuring_its_memory(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """The real Trainer, planned at start (plan.at_start=true, plan.cpu_returns_freed_memory=true: the product hands
    freed memory back, so that the resident set follows what is alive), trains one step and evaluates. The step is
    measured without resetting the peak resident set, so that the report's figure (the process's resident peak at
    the step's log window) stays the whole run's: VmHWM before the step (the run so far: loading, LoRA, DDP) and after
    it, which is the step's own peak where the step set a new high (the test checks it did). The evaluation, after
    the step's window is logged, is measured with the peak reset right before (``clear_refs`` 5), VmHWM read first.
    Writes ``memory-rank{N}.json``: those, the increases, the eval tokens this rank ran, the plan's predictions for
    this rank (training as the allocator counts it, and evaluation), what the plan says of its step (the activations
    kept for backward, the transients on top, the resident set at start) and the weights' bytes, counted on the real
    model. Then the trainer closes as a run does: rank 0 writes report.json, which sets each rank's plan beside its
    measured resident peak."""
    from ddptrain.plan import at_start
    from ddptrain.plan.budget import RESIDENT_AT_START

    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    plans = []  # the plan this rank made for itself at start, for its breakdown (what the prediction is made of)
    make_plan = at_start.make_plan
    at_start.make_plan = lambda *args, **kwargs: plans.append(make_plan(*args, **kwargs)) or plans[-1]
    try:
        setup_logging(env.rank, None)
        trainer = Trainer(cfg, env, Path(run_dir))
        measured: dict[str, int] = {}

        def measuring(name: str, call, reset: bool):
            def measured_call(*args, **kwargs):
                gc.collect()
                measured[f"peak_before_{name}"] = peak_resident_bytes()  # the run's peak so far
                if reset:
                    Path("/proc/self/clear_refs").write_text("5")
                before = resident_bytes()
                result = call(*args, **kwargs)
                measured[f"peak_after_{name}"] = peak_resident_bytes()
                measured[f"{name}_increase"] = measured[f"peak_after_{name}"] - before
                return result

            return measured_call

        real_step, real_batches = trainer.train_step, trainer.evaluate.eval_batches

        def step(micro_batches, **kwargs):
            measured["padded"] = sum(b["input_ids"].numel() for b in micro_batches)
            measured["tokens"] = sum(int(b["attention_mask"].sum()) for b in micro_batches)
            return real_step(micro_batches, **kwargs)

        def eval_batches():
            measured["eval_padded"] = 0
            for batch in real_batches():
                measured["eval_padded"] += batch["input_ids"].numel()
                yield batch

        trainer.train_step = measuring("step", step, reset=False)
        trainer.evaluate.eval_batches = eval_batches
        trainer.evaluate = measuring("eval", trainer.evaluate, reset=True)
        trainer.fit()
        weights = sum(p.numel() * p.element_size() for p in trainer.loss_module.parameters())
        mine = plans[0]
        record = {
            **measured,
            "predicted_allocated": mine.allocated(mine.ranks[0]),
            "predicted_eval_gb": trainer.memory_plan.eval_gb,
            "weights": weights,
            "planned_activations": mine.ranks[0].activations,
            "planned_transient": mine.ranks[0].transient,
            "planned_resident_at_start": mine.fixed.get(RESIDENT_AT_START, 0),
        }
        (Path(run_dir) / f"memory-rank{env.rank}.json").write_text(json.dumps(record))
    finally:
        parallel.teardown()
    trainer.close("finished")  # after the group is gone, as a run closes


def measure_the_steps_of_saved_batches(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """One process (no group): the run's model, as ``build_model`` makes it, and its optimizer take a real training
    step on each batch saved in ``batches.pt`` (collated), in order; around each, the peak resident set is reset
    and read (``clear_refs`` 5, freed memory handed back). Writes ``steps.json``: per batch, what the step added,
    and what was alive before it beyond the weights (the optimizer states of earlier steps, counted on the
    tensors); and the weights' bytes, counted on the real model."""
    import torch

    from ddptrain.optim import build_optimizer

    hand_freed_memory_back()
    model = build_model(cfg.model, cfg.trainer.seed, torch.device("cpu"))
    optimizer = build_optimizer(cfg.optim, model)
    records = []
    for batch in torch.load(Path(run_dir) / "batches.pt"):
        optimizer.zero_grad(set_to_none=True)
        states = sum(
            t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        )
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        before = resident_bytes()
        loss, _ = model(**batch)
        loss.backward()
        optimizer.step()
        records.append({"increase": peak_resident_bytes() - before, "alive_before": states})
        del loss
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    (Path(run_dir) / "steps.json").write_text(json.dumps({"steps": records, "weights": weights}))
