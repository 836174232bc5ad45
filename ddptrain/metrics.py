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
    """Appends one JSON object per logged step to ``metrics.jsonl``, and hands it to the chosen loggers.

    Args:
        path: the ``metrics.jsonl`` file (always written, whatever the loggers).
        loggers: TensorBoard, W&B, MLflow, ... (``ddptrain.loggers``); each gets every record.
    """

    def __init__(self, path: Path, loggers: list[Any] | None = None):
        self.path = path
        self.file = path.open("a", buffering=1)
        self.loggers = loggers or []

    def log(self, record: dict[str, Any]) -> None:
        plain = {k: _plain(v) for k, v in record.items()}
        self.file.write(json.dumps(plain) + "\n")
        for logger in self.loggers:
            # A tracking server that is down costs a warning, not the training: metrics.jsonl has the record.
            _tolerate(logger.log_metrics, plain, int(plain["step"]))

    def close(self, status: str = "finished") -> None:
        """The end of the run: close metrics.jsonl, write the diagnosis, hand it to the loggers, close them.

        Args:
            status: finished, stopped (by a signal) or failed: what the loggers record for the run.
        """
        if self.file.closed:
            return
        self.file.close()
        report = self.write_report()
        for logger in self.loggers:
            if report is not None:
                _tolerate(logger.log_report, report, self.path.parent / "report.md")
            _tolerate(logger.close, status)  # each one, whatever another did: no W&B or MLflow run left open

    def write_report(self) -> dict[str, Any] | None:
        """report.md and report.json beside metrics.jsonl, and the short version on the console."""
        from ddptrain import diagnose

        run_dir = self.path.parent
        try:
            report = diagnose.write_report(run_dir, plots=False)
        except Exception as err:  # the training is done: a report that fails must not fail the run
            logging.getLogger(__name__).warning(
                "no run report (%s); retry with: python -m ddptrain.diagnose %s", err, run_dir
            )
            return None
        print(diagnose.console_summary(report), file=sys.stderr)
        return report


class NullMetricsLogger:
    """What ranks other than 0 hold: the same calls, no file."""

    def log(self, record: dict[str, Any]) -> None:
        """Nothing to write: rank 0 logs the (already reduced) record."""

    def close(self, status: str = "finished") -> None:
        """No file to close."""


def build_metrics_logger(
    is_rank_zero: bool, run_dir: Path, logger_cfg: Any = None, config: dict[str, Any] | None = None
) -> MetricsLogger | NullMetricsLogger:
    """Rank 0's metrics file and loggers (``logger=...``); the other ranks get a logger that does nothing.

    Args:
        logger_cfg: the ``logger`` group (``config.LoggerConfig``); None = metrics.jsonl only.
        config: the resolved run config as plain data, for the loggers that record it.
    """
    if not is_rank_zero:
        return NullMetricsLogger()
    loggers = []
    if logger_cfg is not None:
        from ddptrain.loggers import build_loggers

        loggers = build_loggers(logger_cfg, run_dir, config or {})
    return MetricsLogger(run_dir / "metrics.jsonl", loggers)


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


def _tolerate(call: Any, *args: Any) -> None:
    """At the end of a run, a logger that fails is a warning: the training is done, the other loggers go on."""
    try:
        call(*args)
    except Exception as err:
        logging.getLogger(__name__).warning("%s failed: %s", getattr(call, "__qualname__", call), err)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


# ----------------------------------------------------------------------------- the log window


@dataclass
class StepResult:
    """What one optimizer step leaves behind (local to this rank until reduced); tensors stay on the device."""

    loss_sum: torch.Tensor  # read only when logging, so steps never wait on the GPU
    target_tokens: int
    grad_norm: torch.Tensor
    overflowed: torch.Tensor | bool  # fp16: the GradScaler found inf/nan gradients and did not step
    batch_tokens: list[tuple[int, int]]  # (real, padded) tokens of each micro-batch this rank trained on
    stop_votes: torch.Tensor  # ranks that asked to stop (SIGTERM, Ctrl-C), summed over ranks
    flops: float = 0.0  # model FLOPs of this rank's micro-batches (ddptrain.flops)


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
    flops: float = 0.0

    def add(self, result: Any) -> None:
        """Add one ``StepResult``."""
        self.loss_sum = self.loss_sum + result.loss_sum.double()
        self.target_tokens += result.target_tokens
        self.batch_tokens += result.batch_tokens
        self.overflowed_steps = self.overflowed_steps + result.overflowed
        self.steps += 1
        self.flops += result.flops

    def close(self, *, step: int, epoch: int, lr: float, grad_norm: Any, watch: Stopwatch, comm: tuple | None) -> dict:
        """The window over all ranks as one metrics record, then an empty window (in place: the checkpointer
        holds this object). Every rank calls it (it runs collectives) and gets the same record.

        Args:
            comm: ``(calls, syncs, bytes)`` handed to all-reduce during the window (``parallel.CommCounter``),
                or None when DDP's built-in all-reduce ran uncounted (trainer.timing=false).
        """
        record = self._reduce(step, epoch, lr, float(grad_norm), watch, comm)
        self.load_state_dict(asdict(Window()))
        return record

    def _reduce(self, step: int, epoch: int, lr: float, grad_norm: float, watch: Stopwatch, comm: tuple | None) -> dict:
        local = torch.tensor([float(self.loss_sum), self.target_tokens], dtype=torch.float64)
        totals = parallel.all_reduce_sum(local)
        seconds = watch.lap()  # after the reduction: every rank's steps of the window are done
        real, padded, imbalance, peak = batch_stats(parallel.all_gather_tensor(torch.tensor(self.batch_tokens)))
        per_step = [None] * 3 if comm is None else [n / self.steps for n in comm]  # None: DDP's own all-reduce
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
            "allreduce_calls_per_step": per_step[0],
            "allreduce_syncs_per_step": per_step[1],
            "allreduce_bytes_per_step": per_step[2],
            "elapsed_s": watch.elapsed(),
            "window_steps": self.steps,
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
        self.flops = float(state.get("flops", 0.0))  # absent in checkpoints written before FLOP counting


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
