"""Runs with a known slowdown injected, for the diagnosis tests (tests/distributed/test_diagnose_injected.py).

One process group trains several runs one after another (each its own Trainer and run folder), so the
suite pays for starting two processes once. The injections live here, in the tests: the product has no
switch that slows it down.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ddptrain import parallel
from ddptrain.config import to_yaml
from ddptrain.observe.console import setup_logging
from ddptrain.observe.flops import ModelFlops
from ddptrain.trainer import Trainer

DELAY_S = 0.15  # injected per micro-batch (loader, slow rank)
# Injected per optimizer step into the all-reduce. Larger than DELAY_S so that the communication-bound run gains far
# more from 4x the accumulation than the compute-bound one: at 0.15 s a loaded CI run measured gains of 2.62 and
# 1.58, a ratio under the 1.67 the prediction test needs to tell them apart (a quiet machine: 2.64 and 1.31).
COMM_DELAY_S = 0.4
# Injected into each of FSDP2's collectives: 7 per step of the 2-layer LoRA model (5 all-gathers: each layer's forward
# and backward, the root's forward; 2 reduce-scatters: the layers' LoRA gradients), so 0.35 s per step.
COLLECTIVE_DELAY_S = 0.05
SCENARIOS_FILE = "scenarios.pkl"
# What rank 1 holds from step 3 on in the plain run (its peak memory must show it): well above the ~0.15 GB by which
# the ranks' own peaks differed in a CI-like run, where a 300 MiB ballast showed as 0.23 GB, under the 80% asserted.
BALLAST_BYTES = 600 * 2**20


def _slow_loader(trainer: Trainer, rank: int) -> Callable[[], None]:
    """Every rank's loader takes DELAY_S longer per micro-batch (inside the step's wait for data)."""
    steps = trainer.data.optimizer_steps

    def slow_steps() -> Iterator[list[dict[str, Any]]]:
        for micro_batches in steps():
            time.sleep(DELAY_S * len(micro_batches))
            yield micro_batches

    trainer.data.optimizer_steps = slow_steps
    return lambda: None


def _slow_rank_one(trainer: Trainer, rank: int) -> Callable[[], None]:
    """Rank 1's forward takes DELAY_S longer: the rank itself is slow, its data is not."""
    if rank != 1:
        return lambda: None
    forward = trainer.loss_module.forward

    def slow_forward(*args: Any, **kwargs: Any) -> Any:
        time.sleep(DELAY_S)
        return forward(*args, **kwargs)

    trainer.loss_module.forward = slow_forward
    return lambda: None


def _slow_all_reduce(trainer: Trainer, rank: int) -> Callable[[], None]:
    """The gradient all-reduce takes COMM_DELAY_S longer once per optimizer step (at the step's last bucket): half
    while the hook launches it (the autograd thread waits), half before it completes (backward waits for it at
    its end). Both halves are exposed communication, booked by different paths of the step clock."""
    count, average = parallel.ddp._count_bucket, parallel.ddp._average_async
    last_bucket: list[bool] = []

    def slow_count(counter: parallel.CommCounter, bucket: Any) -> None:
        last_bucket[:] = [bucket.is_last()]
        if bucket.is_last():
            time.sleep(COMM_DELAY_S / 2)
        count(counter, bucket)

    def slow_average(tensor: torch.Tensor, counter: parallel.CommCounter) -> torch.futures.Future:
        future = average(tensor, counter)
        if not last_bucket[0]:
            return future

        def late(done: torch.futures.Future) -> Any:
            time.sleep(COMM_DELAY_S / 2)
            return done.value()

        return future.then(late)

    parallel.ddp._count_bucket, parallel.ddp._average_async = slow_count, slow_average

    def restore() -> None:
        parallel.ddp._count_bucket, parallel.ddp._average_async = count, average

    return restore


def _slow_collectives(trainer: Trainer, rank: int) -> Callable[[], None]:
    """Every all-gather and every reduce-scatter FSDP2 runs takes COLLECTIVE_DELAY_S longer: torch's own collectives,
    under the product's counting and timing, sleep before they run."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    originals = {cls: cls.__call__ for cls in (DefaultAllGather, DefaultReduceScatter)}

    def slowed(call: Callable[..., Any]) -> Callable[..., Any]:
        def slow_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            time.sleep(COLLECTIVE_DELAY_S)
            return call(self, *args, **kwargs)

        return slow_call

    for cls, call in originals.items():
        cls.__call__ = slowed(call)

    def restore() -> None:
        for cls, call in originals.items():
            cls.__call__ = call

    return restore


def _ballast_on_rank_one(trainer: Trainer, rank: int) -> Callable[[], None]:
    """Rank 1 allocates and touches BALLAST_BYTES at step 3 and keeps them: its peak memory, not rank 0's, grows."""
    held: list[torch.Tensor] = []
    step = trainer.train_step

    def step_with_ballast(micro_batches: list[dict[str, Any]], **kwargs: Any) -> Any:
        if rank == 1 and trainer.step == 2 and not held:
            held.append(torch.ones(BALLAST_BYTES // 4, dtype=torch.float32))
        return step(micro_batches, **kwargs)

    trainer.train_step = step_with_ballast
    return held.clear


INJECTIONS: dict[str, Callable[[Trainer, int], Callable[[], None]]] = {
    "none": lambda trainer, rank: lambda: None,
    "slow_loader": _slow_loader,
    "slow_rank_one": _slow_rank_one,
    "slow_all_reduce": _slow_all_reduce,
    "slow_collectives": _slow_collectives,
    "ballast_on_rank_one": _ballast_on_rank_one,
}


def _record_flops(trainer: Trainer, run_dir: Path, rank: int) -> None:
    """Each step's model FLOPs on this rank, counted from the micro-batches it trained on (ModelFlops's formula
    is held to torch's FlopCounterMode in tests/unit/test_flops.py; here: the trainer sums and logs them right)."""
    counter, step, per_step = ModelFlops.from_model(trainer.loss_module), trainer.train_step, []

    def counting_step(micro_batches: list[dict[str, Any]], **kwargs: Any) -> Any:
        per_step.append(sum(counter.batch_flops(b) for b in micro_batches))
        (run_dir / f"flops{rank}.json").write_text(json.dumps(per_step))
        return step(micro_batches, **kwargs)

    trainer.train_step = counting_step


def _record_step_ends(trainer: Trainer, run_dir: Path, rank: int) -> None:
    """When each optimizer step ended on this rank, by the test's own clock (not the product's step clock)."""
    ends: list[float] = []

    def stamp(*_: Any) -> None:
        ends.append(time.perf_counter())
        (run_dir / f"step_ends{rank}.json").write_text(json.dumps(ends))

    trainer.optimizer.register_step_post_hook(stamp)


def train_scenarios(cfg: Any, run_dir: str, store_port: int) -> None:
    """Train each ``(name, run config, injection)`` of ``<run_dir>/scenarios.pkl`` into ``<run_dir>/<name>``."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, None)
        scenarios = pickle.loads((Path(run_dir) / SCENARIOS_FILE).read_bytes())
        for name, scenario_cfg, injection in scenarios:
            scenario_dir = Path(run_dir) / name
            scenario_dir.mkdir(exist_ok=True)
            if env.is_rank_zero:  # what a real run leaves: the diagnosis reads the thresholds from it
                (scenario_dir / "config.yaml").write_text(to_yaml(scenario_cfg))
            parallel.barrier()
            trainer = Trainer(scenario_cfg, env, scenario_dir)
            restore = INJECTIONS[injection](trainer, env.rank)
            _record_flops(trainer, scenario_dir, env.rank)
            _record_step_ends(trainer, scenario_dir, env.rank)
            try:
                trainer.fit()
            finally:
                restore()
            trainer.close("finished")  # rank 0 writes report.json (launch.worker does this after teardown)
            parallel.barrier()
    finally:
        parallel.teardown()
