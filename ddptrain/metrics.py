"""Logging, metrics and the progress bar, with null objects for ranks that do not write.

Global rank 0 writes ``metrics.jsonl`` and ``train.log`` and draws the progress bar; the
other ranks get objects with the same methods that do nothing, so the training loop
never asks which rank it is on.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from tqdm import tqdm

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
