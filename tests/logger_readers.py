"""Read back what the loggers wrote, with each tool's own reader: the oracle side of the logger tests.

TensorBoard through its EventAccumulator, MLflow through MlflowClient, and W&B through
``wandb leet inspect --json``, W&B's own reader of the ``.wandb`` transaction log of an (offline)
run: what ``wandb sync`` would upload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# ----------------------------------------------------------------------------- TensorBoard


def tensorboard_run(log_dir: Path) -> Any:
    """An EventAccumulator over every event file in ``log_dir``, loaded in full (no sampling)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def tensorboard_series(accumulator: Any, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def tensorboard_text(accumulator: Any, tag: str) -> str:
    """The last text written under ``tag`` (``SummaryWriter.add_text`` stores it as a string tensor)."""
    event = accumulator.Tensors(f"{tag}/text_summary")[-1]
    return event.tensor_proto.string_val[0].decode()


def tensorboard_texts(accumulator: Any, tag: str) -> list[tuple[int, str]]:
    """Every text written under ``tag``, with its step."""
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in accumulator.Tensors(f"{tag}/text_summary")]


# ----------------------------------------------------------------------------- W&B


def wandb_file(run_dir: Path) -> Path:
    """The one ``.wandb`` file of the one W&B run under ``<run>/wandb``."""
    (path,) = run_dir.glob("wandb/*run-*/run-*.wandb")
    return path


def _inspect(path: Path, *flags: str) -> str:
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(command)} failed (wandb too old for `leet inspect`?): {result.stderr}"
    return result.stdout


def wandb_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a ``.wandb`` file, in order, as W&B prints them (``{"type": "history", ...}``)."""
    return [json.loads(line) for line in _inspect(path).splitlines() if line.strip()]


def wandb_state(path: Path) -> dict[str, Any]:
    """The run as W&B sums it up: ``state``, ``exit_code``, ``config``, ``summary``, ..."""
    return json.loads(_inspect(path, "--summary"))


def wandb_series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """``key`` over steps from the history records (W&B merges the rows of one step into one record)."""
    rows = [record["history"] for record in records if record["type"] == "history"]
    return [(row["step"]["num"], row["item"][key]) for row in rows if key in row["item"]]


def wandb_tables(records: list[dict[str, Any]], key: str, run_files: Path) -> list[tuple[int, dict[str, Any]]]:
    """The tables logged under ``key``, by step, read from the files the history rows point at (their SHA-256
    checked): ``{"columns": [...], "data": [[...], ...]}`` each."""
    import hashlib

    tables = []
    for record in records:
        item = record.get("history", {}).get("item", {}) if record["type"] == "history" else {}
        if item.get(f"{key}._type") == "table-file":
            data = (run_files / item[f"{key}.path"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == item[f"{key}.sha256"], "the table file is not what was logged"
            tables.append((record["history"]["step"]["num"], json.loads(data)))
    return tables


# ----------------------------------------------------------------------------- MLflow


def mlflow_default_store(run_dir: Path) -> str:
    """The store ddptrain writes by default, as docs/loggers.md tells users to open it (``mlflow ui``)."""
    return f"sqlite:///{run_dir}/mlflow.db"


def mlflow_run(tracking_uri: str, experiment_name: str = "ddptrain") -> tuple[Any, Any]:
    """``(client, run)`` for the one run of ``experiment_name`` in the store at ``tracking_uri``, read as a user
    would, by current MLflow with no opt-out variable set (MLflow 3 refuses its old file store without one)."""
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ, "the store must open without MLflow's opt-out variable"
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    assert experiment is not None, f"no MLflow experiment {experiment_name!r} in {tracking_uri}"
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def mlflow_series(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, key))
