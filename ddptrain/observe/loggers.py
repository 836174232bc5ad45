"""Where metrics go besides ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow (``logger=...``).

Every logger has the same three calls, made by ``observe.metrics.MetricsLogger`` on global rank 0 only:

- ``log_metrics(record, step)``: every training and eval record. Numbers only: ``step`` is the x-axis,
  not a metric; nested dicts and lists are flattened into ``key/sub`` names (``mem_peak_gb_by_rank/1``,
  ``by_rank/1/time_comm_s``);
  a NaN or infinite value reaches them as the float it is (``metrics.jsonl`` writes it as null), so that a
  diverging loss shows in the charts; strings and nulls are skipped.
- ``log_samples(step, rows)``: the completions of ``trainer.eval_prompts`` at an evaluation (``prompt``,
  ``completion``, ...): a TensorBoard text, a W&B table, an MLflow artifact ``samples/step-<N>.json``.
- ``log_report(report, report_md)``: the end-of-run diagnosis (``verdict``, ``summary``, ``levers``).
- ``close(status)``: flush and end the run as it ended, one of ``RUN_STATUSES``: ``"finished"`` (ran to its
  end), ``"failed"`` (raised), ``"stopped"`` (SIGTERM or Ctrl-C: a checkpoint was saved, ``trainer.resume``
  continues it), ``"diverged"`` (a step's loss or gradient norm was not finite: trainer.on_nonfinite). MLflow
  records it as the run's status, W&B as its exit code (see ``WANDB_EXIT_CODES``), TensorBoard has no run status.
  Idempotent: a second call, whatever its status, does nothing.

The resolved config is recorded when the logger is built. Each package is imported inside its
builder: a logger that was not chosen costs no import time, and a missing package is caught
earlier, by ``config.logger._check_loggers``, naming the extra that installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from ddptrain.config import LoggerConfig, MlflowLoggerConfig, TensorBoardLoggerConfig, WandbLoggerConfig
from ddptrain.process import signals

# MLflow 3 refuses a file store unless this is set (and so does every reader of it): the default store is
# SQLite, which it reads as is. Set only for a file store the user names in logger.mlflow.tracking_uri.
MLFLOW_ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"
MLFLOW_DB = "mlflow.db"
"""The default MLflow store, ``<run>/mlflow.db``: ``mlflow ui --backend-store-uri sqlite:///<run>/mlflow.db``."""
MLFLOW_ARTIFACTS = "mlartifacts"
"""Where the default store's runs keep their artifacts (the report), beside it in the run folder."""
# MLflow otherwise sends usage telemetry from a background thread: a training run makes no calls home.
MLFLOW_DISABLE_TELEMETRY = "MLFLOW_DISABLE_TELEMETRY"
WANDB_FINISH_TIMEOUT = "WANDB_FINISH_TIMEOUT"

RUN_STATUSES = ("finished", "failed", "stopped", "diverged")
"""How a run ended, as ``close`` takes it."""
MLFLOW_STATUSES = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED", "diverged": "FAILED"}
"""MLflow's run status for each: KILLED is MLflow's word for a run ended from outside before its end."""
WANDB_EXIT_CODES = {
    "finished": 0,
    "failed": 1,
    "stopped": signals.STOPPED_EXIT_CODE,
    "diverged": signals.DIVERGED_EXIT_CODE,
}
"""The exit code ``wandb.finish`` gets: W&B shows 0 as Finished and any other code as Failed; it has no state of
its own for a run stopped to be resumed (its Killed is set by the server only, for runs stopped from the UI).
A stop gets 75, the code ``python -m ddptrain`` exits with after one: Failed in the runs table, as W&B itself
ends a run on Ctrl-C (code 255), yet told apart from a failure (1) by its exit code."""


class Logger(Protocol):
    """What ``observe.metrics.MetricsLogger`` calls on each chosen logger."""

    def log_metrics(self, record: dict[str, Any], step: int) -> None: ...

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def log_report(self, report: dict[str, Any], report_md: Path) -> None: ...

    def close(self, status: str = "finished") -> None: ...


def check_status(status: str) -> str:
    """``status`` if it is one of ``RUN_STATUSES``.

    Raises:
        ValueError: naming the statuses a logger's ``close`` takes.
    """
    if status not in RUN_STATUSES:
        raise ValueError(f"a logger closes with a status in {RUN_STATUSES}, not {status!r}")
    return status


def build_loggers(cfg: LoggerConfig, run_dir: Path, config: dict[str, Any]) -> list[Logger]:
    """The loggers chosen with ``logger=...``, each already holding the run's config.

    Args:
        cfg: the ``logger`` group; a field that is null is a logger not chosen.
        run_dir: the run folder; local files (event files, the offline W&B run, the MLflow store) go inside.
        config: the resolved run config as plain nested data (``config.config_as_dict``).

    Returns:
        One logger per chosen entry, in the order tensorboard, wandb, mlflow.
    """
    builders = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger}
    loggers: list[Logger] = []
    try:
        for name, builder in builders.items():
            if getattr(cfg, name) is not None:
                loggers.append(builder(getattr(cfg, name), run_dir, config))
    except BaseException:
        for logger in loggers:  # one failed to start: end those already started (a W&B run, say) too
            logger.close("failed")
        raise
    return loggers


# ----------------------------------------------------------------------------- flattening


def metric_values(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record under flat names, without ``step`` (the x-axis, passed apart)."""
    return numeric_items({key: value for key, value in record.items() if key != "step"})


def numeric_items(data: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number in ``data`` as ``{"a/b/0": float}``; strings other than NaN/inf, and nulls, are skipped."""
    out: dict[str, float] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(numeric_items(value, f"{name}/"))
        elif isinstance(value, (list, tuple)):
            out.update(numeric_items(_by_position(value), f"{name}/"))
        elif (number := _number(value)) is not None:
            out[name] = number
    return out


def _by_position(values: list | tuple) -> dict[int, Any]:
    """A list keyed by position (per-rank lists are in rank order); an entry's own ``rank`` field is
    dropped where it only repeats the position (``by_rank/1/rank`` would chart the constant 1)."""
    return {
        i: {k: v for k, v in item.items() if not (k == "rank" and v == i)} if isinstance(item, dict) else item
        for i, item in enumerate(values)
    }


def _number(value: Any) -> float | None:
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """The config as ``{"optim.lr": 0.005}``, keys as the user types them; lists and nulls as JSON text
    (``[1, 2]``, ``null``), since TensorBoard's hparams and MLflow's params hold scalars only."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{name}."))
        elif isinstance(value, (str, int, float, bool)):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


# ----------------------------------------------------------------------------- samples

SAMPLES_TAG = "samples"
SAMPLE_COLUMNS = ("step", "prompt", "completion")


def _cell(value: Any) -> str | int:
    """A prompt given as a row shows as its JSON."""
    return value if isinstance(value, (str, int)) else json.dumps(value)


def samples_markdown(rows: list[dict[str, Any]]) -> str:
    """The samples of one evaluation as Markdown (TensorBoard's text tab renders it): each prompt and its completion
    as indented code blocks, which keep their lines."""
    blocks = [
        f"**prompt {i}**\n\n{_code_block(str(_cell(r['prompt'])))}\n\n**completion**\n\n"
        f"{_code_block(r['completion'] or '(empty)')}"
        for i, r in enumerate(rows)
    ]
    return "\n\n".join(blocks)


# ----------------------------------------------------------------------------- TensorBoard


class TensorBoardLogger:
    """Scalars, the config (text and hparams) and the report in ``<run>/<logger.tensorboard.log_dir>``."""

    def __init__(self, cfg: TensorBoardLoggerConfig, run_dir: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / cfg.log_dir))
        self.last_step = 0  # the report has no step of its own: it goes at the last logged one
        self.writer.add_text("config", _code_block(_to_yaml(config)))
        self._add_hparams(config)

    def _add_hparams(self, config: dict[str, Any]) -> None:
        # Written into this run's event file, not a new sub-run as SummaryWriter.add_hparams would make;
        # the HParams tab then shows each run's config beside its last loss and eval_loss.
        from torch.utils.tensorboard.summary import hparams

        # Metric names only (their values are not used): the tab shows these scalars' last values.
        for summary in hparams(flat_config(config), {"loss": 0.0, "eval_loss": 0.0}):
            self.writer.file_writer.add_summary(summary)

    def log_metrics(self, record: dict[str, Any], step: int) -> None:
        for name, value in metric_values(record).items():
            self.writer.add_scalar(name, value, step)
        self.last_step = step

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text(SAMPLES_TAG, samples_markdown(rows), step)

    def log_report(self, report: dict[str, Any], report_md: Path) -> None:
        self.writer.add_text("report", report_md.read_text(), self.last_step)
        for name, value in numeric_items(report["summary"], "report/").items():
            self.writer.add_scalar(name, value, self.last_step)

    def close(self, status: str = "finished") -> None:
        """Flush and close the event file; TensorBoard has no run status, so ``status`` is only checked."""
        check_status(status)
        self.writer.close()  # flushes; closing twice is harmless


def _to_yaml(config: dict[str, Any]) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(config)


def _code_block(text: str) -> str:
    # TensorBoard renders text as Markdown: indent by four spaces so YAML keeps its lines and indentation.
    return "\n".join("    " + line for line in text.splitlines())


# ----------------------------------------------------------------------------- Weights & Biases


class WandbLogger:
    """A W&B run whose local files live in ``<run>/wandb/``; offline with ``logger.wandb.mode=offline``
    or ``WANDB_MODE=offline`` (then ``wandb sync <run>/wandb/offline-run-*`` uploads it later)."""

    def __init__(self, cfg: WandbLoggerConfig, run_dir: Path, config: dict[str, Any]):
        # Online, finish() waits for the upload; W&B versions that know this setting give up after it
        # (the data stays on disk for `wandb sync`), older ones ignore it. Offline there is nothing to wait for.
        os.environ.setdefault(WANDB_FINISH_TIMEOUT, "300")
        import wandb

        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_dir.name,
            mode=cfg.mode,  # None: W&B decides (WANDB_MODE, else online)
            tags=list(cfg.tags),
            dir=str(run_dir),  # W&B adds wandb/ below it
            config=config,
            # ddptrain prints its own summary and report; W&B's history table would repeat it at the end.
            settings=wandb.Settings(quiet=True),
        )
        self.closed = False

    def log_metrics(self, record: dict[str, Any], step: int) -> None:
        # W&B keeps a row open until a higher step arrives, so the eval record of a step joins its training row.
        self.run.log(metric_values(record), step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        table = wandb.Table(
            columns=list(SAMPLE_COLUMNS), data=[[_cell(row[c]) for c in SAMPLE_COLUMNS] for row in rows]
        )
        self.run.log({SAMPLES_TAG: table}, step=step)

    def log_report(self, report: dict[str, Any], report_md: Path) -> None:
        self.run.summary["report"] = report  # nested: verdict, summary numbers, levers
        # A copy in the W&B run's files/ folder, not the symlink wandb.save would make: the run folder
        # can then be moved or copied elsewhere and still be synced with its report.
        copy = Path(shutil.copy(report_md, Path(self.run.dir) / report_md.name))
        self.run.save(str(copy), base_path=self.run.dir, policy="now")

    def close(self, status: str = "finished") -> None:
        """End the W&B run with the exit code for ``status`` (``WANDB_EXIT_CODES``); online, wait for the upload."""
        exit_code = WANDB_EXIT_CODES[check_status(status)]
        if not self.closed:
            self.closed = True
            self.run.finish(exit_code=exit_code)


# ----------------------------------------------------------------------------- MLflow


class MlflowLogger:
    """An MLflow run: metrics, the config as params, the report as artifacts; by default in a SQLite store
    ``<run>/mlflow.db`` that needs no server (``mlflow ui --backend-store-uri sqlite:///<run>/mlflow.db``)."""

    def __init__(self, cfg: MlflowLoggerConfig, run_dir: Path, config: dict[str, Any]):
        uri, artifacts = cfg.tracking_uri, None
        if uri is None:
            uri = f"sqlite:///{(run_dir / MLFLOW_DB).resolve()}"
            # Otherwise MLflow puts the artifacts in ./mlruns of whatever folder the run started from.
            artifacts = (run_dir / MLFLOW_ARTIFACTS).resolve().as_uri()
        elif uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault(MLFLOW_ALLOW_FILE_STORE, "true")
        os.environ.setdefault(MLFLOW_DISABLE_TELEMETRY, "true")  # before mlflow is imported
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(cfg.experiment_name, artifact_location=artifacts)
        )
        tags = {"ddptrain.run_dir": str(run_dir.resolve())}
        run = self.client.create_run(experiment_id, run_name=cfg.run_name or run_dir.name, tags=tags)
        self.run_id = run.info.run_id
        self.last_step = 0
        self.closed = False
        self._log_params(flat_config(config))

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        # Values as the user types them (true, 0.005), cut to what the store accepts.
        texts = {key: value if isinstance(value, str) else json.dumps(value) for key, value in params.items()}
        items = [Param(key, text[:MAX_PARAM_VAL_LENGTH]) for key, text in texts.items()]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):  # the store's limit per call
            self.client.log_batch(self.run_id, params=items[start : start + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, record: dict[str, Any], step: int) -> None:
        self._log_numbers(metric_values(record), step)
        self.last_step = step

    def _log_numbers(self, numbers: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now_ms = int(time.time() * 1000)
        metrics = [Metric(key, value, now_ms, step) for key, value in numbers.items()]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):  # per-rank figures of a large job add up
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.client.log_dict(self.run_id, {"step": step, "samples": rows}, f"{SAMPLES_TAG}/step-{step:08d}.json")

    def log_report(self, report: dict[str, Any], report_md: Path) -> None:
        self.client.set_tag(self.run_id, "verdict", str(report["verdict"]))
        self._log_numbers(numeric_items(report["summary"], "report/"), self.last_step)
        self.client.log_artifact(self.run_id, str(report_md))
        self.client.log_dict(self.run_id, report, "report.json")

    def close(self, status: str = "finished") -> None:
        """End the MLflow run with the status for ``status`` (``MLFLOW_STATUSES``)."""
        mlflow_status = MLFLOW_STATUSES[check_status(status)]
        if not self.closed:
            self.closed = True
            self.client.set_terminated(self.run_id, mlflow_status)
