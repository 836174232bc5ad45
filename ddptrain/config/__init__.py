"""Typed run configuration: one module per Hydra config group, each with its schema dataclasses, its enums and its
checks side by side (``model``, ``data``, ``parallel``, ``optim``, ``trainer``, ``logger``, mirroring ``conf/``, and
``plan``, the memory plan's keys, which need no YAML), the root run config (``run``), the Hydra glue (``hydra``)
and what the checks share (``checks``).

The schemas are registered in Hydra's ConfigStore (``register_configs``) so that a
misspelled key, a wrong type or an unknown choice fails while Hydra composes the
config, before any worker starts. Checks that relate several fields live in
``validate``; it reports every problem at once, naming keys as the user types them.

This package imports neither torch nor transformers: config errors must surface in
well under a second. The exceptions are parallel.comm_hook=bf16_compress with
parallel.backend=auto, and model.attn_implementation=flash_attention_2, each with
trainer.device=auto, where only torch can say whether the workers will get CUDA;
torch is imported lazily for those cases alone (``checks._cuda_available``).

Every name is importable from here as before (``from ddptrain.config import RunConfig``).
"""

from ddptrain.config.checks import installed_torch_version
from ddptrain.config.data import Batching, DataConfig, SourceConfig, Template, is_jinja
from ddptrain.config.hydra import ASSETS_DIR, COMMAND_LINE_ENV, register_configs, swept_overrides
from ddptrain.config.logger import (
    LoggerConfig,
    MlflowLoggerConfig,
    TensorBoardLoggerConfig,
    WandbLoggerConfig,
    _check_loggers,
)
from ddptrain.config.model import Attention, DType, ModelConfig, ModelInit, resolve_precision
from ddptrain.config.objective import Objective, ObjectiveConfig, PreferenceLossType, Reference
from ddptrain.config.optim import OptimConfig, Scheduler
from ddptrain.config.parallel import Backend, CommHook, ParallelConfig, StartMethod, Strategy
from ddptrain.config.plan import PlanConfig
from ddptrain.config.run import (
    ConfigError,
    RunConfig,
    config_as_dict,
    resolve_global_batch_size,
    to_run_config,
    to_yaml,
    validate,
)
from ddptrain.config.trainer import (
    EVAL_METRICS,
    Device,
    DiagnoseConfig,
    EarlyStoppingConfig,
    OnNonFinite,
    Precision,
    SaveCheckMode,
    TrainerConfig,
)

__all__ = [
    "ASSETS_DIR",
    "COMMAND_LINE_ENV",
    "EVAL_METRICS",
    "Attention",
    "Backend",
    "Batching",
    "CommHook",
    "ConfigError",
    "DType",
    "DataConfig",
    "Device",
    "DiagnoseConfig",
    "EarlyStoppingConfig",
    "LoggerConfig",
    "MlflowLoggerConfig",
    "ModelConfig",
    "ModelInit",
    "Objective",
    "ObjectiveConfig",
    "OnNonFinite",
    "OptimConfig",
    "ParallelConfig",
    "PlanConfig",
    "Precision",
    "PreferenceLossType",
    "Reference",
    "RunConfig",
    "SaveCheckMode",
    "Scheduler",
    "SourceConfig",
    "StartMethod",
    "Strategy",
    "Template",
    "TensorBoardLoggerConfig",
    "TrainerConfig",
    "WandbLoggerConfig",
    "_check_loggers",
    "config_as_dict",
    "installed_torch_version",
    "is_jinja",
    "register_configs",
    "resolve_global_batch_size",
    "resolve_precision",
    "swept_overrides",
    "to_run_config",
    "to_yaml",
    "validate",
]
