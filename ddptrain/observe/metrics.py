"""The metrics record's way out: global rank 0 appends each record to ``metrics.jsonl`` and hands it to the chosen
loggers (``observe.loggers``); at the end it has the run report written (``observe.run_files``), gives it to the
loggers and closes them. Other ranks hold ``NullMetricsLogger``: the loop just calls ``metrics.log(record)``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from ddptrain.observe.loggers import build_loggers
from ddptrain.observe.run_files import RunFiles

SAMPLES_FILE = "samples.jsonl"
"""``<run>/samples.jsonl``: a row per prompt and evaluation: ``{"step", "prompt", "completion", "tokens", "ended"}``."""


class MetricsLogger:
    """Appends one JSON object per logged step to ``metrics.jsonl``, and hands it to the chosen loggers.

    Args:
        path: the ``metrics.jsonl`` file (always written, whatever the loggers).
        loggers: TensorBoard, W&B, MLflow, ... (``ddptrain.observe.loggers``); each gets every record.
    """

    def __init__(self, path: Path, loggers: list[Any] | None = None, files: RunFiles | None = None):
        self.path = path
        self.file = path.open("a", buffering=1)
        self.loggers = loggers or []
        self.files = files or RunFiles()  # writes the run report

    def log(self, record: dict[str, Any]) -> None:
        """Write ``record`` (an empty one is not written: nothing to log)."""
        if not record:
            return
        plain = {k: _plain(v) for k, v in record.items()}  # NaN stays a float: the loggers' charts show it
        self.file.write(json.dumps(_nulled(plain)) + "\n")
        for logger in self.loggers:
            # A tracking server that is down costs a warning, not the training: metrics.jsonl has the record.
            _tolerate(logger.log_metrics, plain, int(plain["step"]))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """The completions of trainer.eval_prompts at ``step``: appended to ``samples.jsonl``, handed to the loggers."""
        with (self.path.parent / SAMPLES_FILE).open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        for logger in self.loggers:
            _tolerate(logger.log_samples, step, rows)

    def close(self, status: str = "finished") -> None:
        """The end of the run: close metrics.jsonl, have the diagnosis written, hand it to the loggers, close them.

        Args:
            status: finished, stopped (by a signal), diverged or failed: what the loggers record for the run.
        """
        if self.file.closed:
            return
        self.file.close()
        report = self.files.write_report(self.path.parent)
        for logger in self.loggers:
            if report is not None:
                _tolerate(logger.log_report, report, self.path.parent / "report.md")
            _tolerate(logger.close, status)  # each one, whatever another did: no W&B or MLflow run left open


class NullMetricsLogger:
    """What ranks other than 0 hold: the same calls, no file."""

    def log(self, record: dict[str, Any]) -> None:
        """Nothing to write: rank 0 logs the (already reduced) record."""

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Nothing to write: rank 0 writes the samples, gathered from every rank."""

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
        loggers = build_loggers(logger_cfg, run_dir, config or {})
    return MetricsLogger(run_dir / "metrics.jsonl", loggers)


def _tolerate(call: Any, *args: Any) -> None:
    """At the end of a run, a logger that fails is a warning: the training is done, the other loggers go on."""
    try:
        call(*args)
    except Exception as err:
        logging.getLogger(__name__).warning("%s failed: %s", getattr(call, "__qualname__", call), err)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _nulled(value: Any) -> Any:
    """``value`` with every NaN or infinity (a diverged step's loss or gradient norm), at any depth, as None: JSON has
    no NaN, and a column of numbers keeps one type (a number, or null as for a missing one)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nulled(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nulled(v) for v in value]
    return value
