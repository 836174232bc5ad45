"""trainer.profile_steps: a torch.profiler trace of a few optimizer steps, and CUDA memory snapshots.

``trainer.profile_steps=[3,5]`` traces optimizer steps 3 to 5 (1-based, inclusive) on the ranks in
``trainer.profile_ranks`` and writes ``<run>/profile/rank<R>_steps<START>-<END>.trace.json``, a Chrome
trace that https://ui.perfetto.dev or chrome://tracing opens. Each step sits under a ``ddptrain.step <N>``
range, with the forward and backward operators inside it. On CUDA the allocator's history is recorded
over the same steps and saved as ``rank<R>_steps<START>-<END>.memory.pickle`` (drag it onto
https://pytorch.org/memory_viz). Ranks and runs without profiling hold a ``NullProfiler``.

An out-of-memory error in a step names the micro-batch that raised it (its shape and tokens) and, on
CUDA, leaves the allocator's state in ``<run>/profile/oom_rank<R>.memory.pickle``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ddptrain.config import TrainerConfig
from ddptrain.parallel import DistEnv
from ddptrain.process import hangs

log = logging.getLogger(__name__)
# Allocations kept by the CUDA memory history: enough for a few steps of a large model.
MEMORY_HISTORY_ENTRIES = 200_000


class Profiler:
    """Traces optimizer steps ``first`` to ``last`` of this rank.

    Starting and stopping the profiler (and writing the trace) are booked to the clock's ``profile`` phase,
    which is not step time: the profiled window's time split stays the training's own.
    """

    def __init__(self, first: int, last: int, rank: int, device: torch.device, folder: Path, clock: Any):
        self.first, self.last, self.cuda, self.clock = first, last, device.type == "cuda", clock
        self.stem = folder / f"rank{rank}_steps{first}-{last}"
        self.profile: Any = None
        self.step_range: Any = None
        self.done = False

    def step_begins(self, step: int) -> None:
        """Before optimizer step ``step`` (1-based): start tracing at the first profiled step."""
        if self.first <= step <= self.last and self.profile is None and not self.done:
            self.clock.enter("profile", step)  # a run resumed inside the range traces the rest of it
            self._start()
        if self.profile is not None:
            self.step_range = torch.profiler.record_function(f"ddptrain.step {step}")
            self.step_range.__enter__()

    def step_ends(self, step: int) -> None:
        """After optimizer step ``step``: close its range; after the last profiled step, write the files."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Write what was traced (also when the run ends, or stops, before the last profiled step)."""
        if self.profile is None:
            return
        self.clock.enter("profile")
        self.profile.stop()
        self.stem.parent.mkdir(parents=True, exist_ok=True)
        trace = self.stem.with_suffix(".trace.json")
        self.profile.export_chrome_trace(str(trace))
        self.profile, self.done = None, True
        log.info("profiler trace of steps %d-%d: %s", self.first, self.last, trace)
        if self.cuda:
            snapshot = self.stem.with_suffix(".memory.pickle")
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            log.info("CUDA memory snapshot of steps %d-%d: %s", self.first, self.last, snapshot)

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profile.start()


class NullProfiler:
    """No profiling on this rank (trainer.profile_steps unset, or the rank not in trainer.profile_ranks)."""

    def step_begins(self, step: int) -> None:
        """Nothing to trace."""

    def step_ends(self, step: int) -> None:
        """Nothing to trace."""

    def close(self) -> None:
        """Nothing to write."""


def build_profiler(cfg: TrainerConfig, env: DistEnv, run_dir: Path, clock: Any) -> Profiler | NullProfiler:
    """trainer.profile_steps on the ranks of trainer.profile_ranks; ``clock`` (``timing``) books its own time."""
    if cfg.profile_steps is None or env.rank not in cfg.profile_ranks:
        return NullProfiler()
    first, last = cfg.profile_steps
    return Profiler(first, last, env.rank, env.device, run_dir / "profile", clock)


# torch.OutOfMemoryError since torch 2.5; the CUDA-only name before.
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@contextlib.contextmanager
def out_of_memory_named(micro_batches: list[dict[str, Any]], env: DistEnv, run_dir: Path) -> Iterator[None]:
    """Turn an out-of-memory error in a step into one that names the micro-batch and the fixes.

    Raises:
        RuntimeError: from the out-of-memory error, naming the phase, step, micro-batch shape and tokens,
            the memory snapshot (CUDA) and the keys that lower the peak.
    """
    try:
        yield
    except OutOfMemoryError as err:
        where = hangs.board.current
        snapshot = _oom_snapshot(env, run_dir)
        raise RuntimeError(
            f"out of memory on rank {env.rank} in {where.name} of step {where.step}, "
            f"{_which_batch(micro_batches, where.micro_step)}.{snapshot} To lower the peak: "
            "data.micro_batch_size (or data.max_tokens_per_batch with data.batching=token_budget), "
            "data.max_length, model.gradient_checkpointing=true, model.loss_chunk_tokens, trainer.precision=bf16."
        ) from err


def _which_batch(micro_batches: list[dict[str, Any]], index: int | None) -> str:
    """The micro-batch of a forward or backward, or all of them (their shapes) when the phase had none."""
    if index is None or index >= len(micro_batches):
        return "micro-batches " + ", ".join(_shape(b) for b in micro_batches)
    return f"micro-batch {index}: {_shape(micro_batches[index])}"


def _shape(batch: dict[str, Any]) -> str:
    real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
    return f"input_ids of shape {list(batch['input_ids'].shape)} ({real} real tokens)"


def _oom_snapshot(env: DistEnv, run_dir: Path) -> str:
    """On CUDA, the allocator's segments (and history, if recording) as a pickle; the sentence naming it."""
    if env.device.type != "cuda":
        return ""
    path = run_dir / "profile" / f"oom_rank{env.rank}.memory.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    return f" Memory snapshot: {path} (open it at https://pytorch.org/memory_viz)."
