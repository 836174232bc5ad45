"""Logging, metrics, the progress bar and the console, with null objects for ranks that do not write.

Global rank 0 writes ``metrics.jsonl`` and ``train.log``, draws the progress bar and tells the
user where the results are; the other ranks get objects with the same methods that do nothing,
so neither the training loop nor the launcher asks which rank it is on.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ddptrain import parallel

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Pass ``extra=RANK_ZERO_ONLY`` to a warning that every rank would emit identically (data
# statistics, say): rank 0 prints it once instead of once per rank.
SAME_ON_ALL_RANKS = "same_on_all_ranks"
RANK_ZERO_ONLY = {SAME_ON_ALL_RANKS: True}


def setup_logging(rank: int, run_dir: Path | None) -> None:
    """Rank 0: INFO to stderr and ``<run_dir>/train.log``. Other ranks: warnings only, prefixed with the rank."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    if rank == 0:
        console.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        root.setLevel(logging.INFO)
        if run_dir is not None:
            file_handler = logging.FileHandler(run_dir / "train.log")
            file_handler.setFormatter(logging.Formatter(FORMAT))
            root.addHandler(file_handler)
    else:
        console.setFormatter(logging.Formatter(f"[rank{rank}] {FORMAT}", datefmt="%H:%M:%S"))
        console.addFilter(lambda record: not getattr(record, SAME_ON_ALL_RANKS, False))
        root.setLevel(logging.WARNING)
    root.addHandler(console)
    quiet_libraries()


def quiet_libraries() -> None:
    """Silence library progress bars and deprecation chatter that say nothing about the run."""
    # Libraries chatter at INFO (datasets, httpx); keep the run's own log readable.
    import transformers

    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    for noisy in ("datasets", "httpx", "urllib3", "filelock", "torch.distributed.elastic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class MetricsLogger:
    """Appends one JSON object per logged step to ``metrics.jsonl``."""

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("a", buffering=1)

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        self.file.close()


class NullMetricsLogger:
    """What ranks other than 0 hold: the same calls, no file."""

    def log(self, record: dict[str, Any]) -> None:
        """Nothing to write: rank 0 logs the (already reduced) record."""

    def close(self) -> None:
        """No file to close."""


def build_metrics_logger(is_rank_zero: bool, run_dir: Path) -> MetricsLogger | NullMetricsLogger:
    return MetricsLogger(run_dir / "metrics.jsonl") if is_rank_zero else NullMetricsLogger()


class Console:
    """What rank 0 tells the user outside the log: lines on stderr, and small files it leaves."""

    def say(self, line: str) -> None:
        print(line, file=sys.stderr)

    def write_file(self, path: Path, text: str) -> None:
        """Write ``text`` to ``path``, creating its folder (``config.yaml``, the torchrun restart marker)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


class NullConsole:
    """What ranks other than 0 hold: rank 0 speaks, and writes, for the job."""

    def say(self, line: str) -> None:
        """Nothing to say: rank 0 says it."""

    def write_file(self, path: Path, text: str) -> None:
        """Nothing to write: rank 0 writes it."""


def build_console(is_rank_zero: bool) -> Console | NullConsole:
    return Console() if is_rank_zero else NullConsole()


class ProgressBar:
    """tqdm over optimizer steps, showing loss and tokens/s; tqdm supplies the ETA."""

    def __init__(self, total: int, initial: int = 0):
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, record: dict[str, Any]) -> None:
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)

    def advance(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class NullProgressBar:
    """What ranks other than 0 (or runs with trainer.progress_bar=false) hold: draws nothing."""

    def update(self, record: dict[str, Any]) -> None:
        """No bar to update."""

    def advance(self) -> None:
        """No bar to advance."""

    def close(self) -> None:
        """No bar to close."""


def build_progress_bar(
    enabled: bool, is_rank_zero: bool, total: int, initial: int = 0
) -> ProgressBar | NullProgressBar:
    return ProgressBar(total, initial) if enabled and is_rank_zero else NullProgressBar()


class Stopwatch:
    """Wall time since start and since the last lap (throughput windows)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


# ----------------------------------------------------------------------------- the log window


@dataclass
class Window:
    """This rank's share of the steps between two log lines.

    A step's token counts travel with the step, measured from the tensors it trained on, so a
    window that spans an epoch boundary (or a resume) never looks anything up in a batch plan.
    Each rank keeps its own (a checkpoint saves every rank's, see ``checkpoint.Checkpointer``).
    """

    loss_sum: Any = 0.0  # a device tensor once a step is added: read only when logging
    target_tokens: int = 0
    batch_tokens: list[tuple[int, int]] = field(default_factory=list)
    overflowed_steps: Any = 0  # fp16 steps the GradScaler did not take; a device tensor once added
    steps: int = 0

    def add(self, result: Any) -> None:
        """Add one ``trainer.StepResult``."""
        self.loss_sum = self.loss_sum + result.loss_sum.double()
        self.target_tokens += result.target_tokens
        self.batch_tokens += result.batch_tokens
        self.overflowed_steps = self.overflowed_steps + result.overflowed
        self.steps += 1

    def close(self, *, step: int, epoch: int, lr: float, grad_norm: Any, watch: Stopwatch, comm: tuple) -> dict:
        """The window over all ranks as one metrics record, then an empty window (in place: the checkpointer
        holds this object). Every rank calls it (it runs collectives) and gets the same record.

        Args:
            comm: ``(calls, syncs, bytes)`` handed to all-reduce during the window (``parallel.CommCounter``).
        """
        record = self._reduce(step, epoch, lr, float(grad_norm), watch, comm)
        self.load_state_dict(asdict(Window()))
        return record

    def _reduce(self, step: int, epoch: int, lr: float, grad_norm: float, watch: Stopwatch, comm: tuple) -> dict:
        local = torch.tensor([float(self.loss_sum), self.target_tokens], dtype=torch.float64)
        totals = parallel.all_reduce_sum(local)
        seconds = watch.lap()  # after the reduction: every rank's steps of the window are done
        real, padded, imbalance, peak = batch_stats(parallel.all_gather_tensor(torch.tensor(self.batch_tokens)))
        calls, syncs, sent = comm
        return {
            "step": step,
            "epoch": epoch,
            "loss": float(totals[0] / max(totals[1], 1.0)),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": real,
            "target_tokens": int(totals[1]),
            "tokens_per_s": real / max(seconds, 1e-9),
            "padding_fraction": 1.0 - real / max(padded, 1),
            "rank_imbalance": imbalance,
            "peak_rank_tokens": peak,
            "skipped_steps": int(self.overflowed_steps),
            # Per optimizer step and rank, as DDP's communication hook saw them.
            "allreduce_syncs_per_step": syncs / self.steps,
            "allreduce_calls_per_step": calls / self.steps,
            "allreduce_bytes_per_step": sent / self.steps,
            "elapsed_s": watch.elapsed(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers (the sums are read off the device): one rank's partial window for a checkpoint."""
        return {**asdict(self), "loss_sum": float(self.loss_sum), "overflowed_steps": int(self.overflowed_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum = float(state["loss_sum"])
        self.target_tokens = int(state["target_tokens"])
        self.batch_tokens = [(int(real), int(padded)) for real, padded in state["batch_tokens"]]
        # "skipped": the name in checkpoints written before the rename.
        self.overflowed_steps = int(state["overflowed_steps"] if "overflowed_steps" in state else state["skipped"])
        self.steps = int(state["steps"])


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
