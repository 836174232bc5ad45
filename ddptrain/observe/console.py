"""The console and the log, with null objects for ranks that do not write.

Global rank 0 logs INFO to stderr and ``train.log``, draws the progress bar and tells the user where the results
are; the other ranks log warnings only, prefixed with their rank, and hold objects with the same methods that do
nothing, so neither the training loop nor the launcher asks which rank it is on. ``RANK_ZERO_ONLY`` marks a warning
every rank would emit identically: rank 0 prints it once.
"""

from __future__ import annotations

import logging
import sys
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


class Console:
    """What rank 0 tells the user outside the log: lines on stderr (the files it leaves: ``observe.run_files``)."""

    def say(self, line: str) -> None:
        print(line, file=sys.stderr)


class NullConsole:
    """What ranks other than 0 hold: rank 0 speaks for the job."""

    def say(self, line: str) -> None:
        """Nothing to say: rank 0 says it."""


def build_console(is_rank_zero: bool) -> Console | NullConsole:
    return Console() if is_rank_zero else NullConsole()


class ProgressBar:
    """tqdm over optimizer steps, showing loss and tokens/s; tqdm supplies the ETA."""

    def __init__(self, total: int, initial: int = 0):
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, record: dict[str, Any]) -> None:
        # No loss when every step of the window was dropped as non-finite (trainer.on_nonfinite=skip).
        loss = "n/a" if record["loss"] is None else f"{record['loss']:.4f}"
        self.bar.set_postfix(loss=loss, tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)

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


def done_line(result: dict[str, Any], run_dir: Path) -> str:
    """The run's last lines: where the results are (or why it stopped early), then the best evaluation and where its
    weights are: "the best adapter" of a LoRA run, "the best weights" of a full fine-tune (as the run saved them)."""
    from ddptrain.checkpoint.files import what_the_run_saved  # imports torch: a finished run has it loaded

    line = f"ddptrain: done. Results in {run_dir}"
    if "early_stopped" in result:
        line = f"ddptrain: stopped early at step {result['last_step']}: {result['early_stopped']}.\n{line}"
    if "best_step" in result:
        noun = what_the_run_saved(run_dir)
        verb = "is" if noun == "adapter" else "are"
        where = f"in {run_dir / 'best'}" if result["best_kept"] else "not kept (trainer.keep_best_n=0)"
        best = f"step {result['best_step']}, {result['best_metric']} {result['best_value']:.4f}"
        line += f"\nddptrain: the best {noun} ({best}) {verb} {where}"
    return line
