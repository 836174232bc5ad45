"""The ``logger`` group's schema (``conf/logger/``): where metrics go besides metrics.jsonl (TensorBoard, W&B,
MLflow), and the check that each chosen logger's package is installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TensorBoardLoggerConfig:
    log_dir: str = "tensorboard"
    """Event files go here, relative to the run folder."""


@dataclass
class WandbLoggerConfig:
    project: str = "ddptrain"
    """The W&B project the run goes to."""
    entity: Optional[str] = None
    """The W&B team or user; null = your default entity."""
    name: Optional[str] = None
    """The W&B run name; null = the run folder's name."""
    mode: Optional[str] = None
    """online | offline | disabled; null = W&B's own default (WANDB_MODE, else online)."""
    tags: list[str] = field(default_factory=list)
    """Tags on the W&B run."""


@dataclass
class MlflowLoggerConfig:
    tracking_uri: Optional[str] = None
    """null = a SQLite store inside the run folder (<run>/mlflow.db); or a server such as http://host:5000."""
    experiment_name: str = "ddptrain"
    """The MLflow experiment the run is filed under (created when missing)."""
    run_name: Optional[str] = None
    """null = the run folder's name."""


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl (always written): logger=tensorboard, logger=[tensorboard,wandb]."""

    tensorboard: Optional[TensorBoardLoggerConfig] = None
    wandb: Optional[WandbLoggerConfig] = None
    mlflow: Optional[MlflowLoggerConfig] = None


# The package each logger needs, and the extra that installs it.
_LOGGER_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def _check_loggers(cfg: LoggerConfig) -> list[str]:
    """Each chosen logger's package is importable: a missing one fails here, not in the middle of training."""
    import importlib.util

    problems = []
    for name, (module, extra) in _LOGGER_PACKAGES.items():
        if getattr(cfg, name) is not None and importlib.util.find_spec(module) is None:
            problems.append(f"logger={name} needs the {module} package: pip install 'ddptrain[{extra}]'.")
    return problems
