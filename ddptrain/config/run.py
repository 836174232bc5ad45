"""The root run config: ``RunConfig`` (one field per group), ``validate`` (every group's checks, all problems at
once, as one ``ConfigError``), the typed config from Hydra's (``to_run_config``), the accumulation a global batch
size gives (``resolve_global_batch_size``), and the config as the loggers and config.yaml record it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import MISSING, DictConfig, MissingMandatoryValue, OmegaConf

from ddptrain.config.data import DataConfig, _check_chat_template, _check_data, _check_sources
from ddptrain.config.logger import LoggerConfig, _check_loggers
from ddptrain.config.model import ModelConfig, _check_model
from ddptrain.config.objective import ObjectiveConfig, _check_objective
from ddptrain.config.optim import OptimConfig, _check_optim
from ddptrain.config.parallel import ParallelConfig, _check_parallel
from ddptrain.config.plan import PlanConfig, _check_plan
from ddptrain.config.trainer import TrainerConfig, _check_trainer


class ConfigError(ValueError):
    """One or more configuration problems, each naming the key and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems))


@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    parallel: ParallelConfig = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)


def validate(cfg: RunConfig) -> None:
    """Check relations between fields; raise ConfigError listing every problem.

    Raises:
        ConfigError: with one line per problem, each naming the key and the fix.
    """
    problems = (
        _check_model(cfg.model, cfg.parallel, cfg.trainer)
        + _check_data(cfg.data)
        + _check_chat_template(cfg.data)
        + _check_sources(cfg.data)
        + _check_parallel(cfg.parallel, cfg.trainer, cfg.optim.grad_accum_steps)
        + _check_optim(cfg.optim, cfg.data)
        + _check_trainer(cfg.trainer)
        + _check_loggers(cfg.logger)
        + _check_plan(cfg.plan)
        + _check_objective(cfg.objective, cfg.data, cfg.model, cfg.trainer)
    )
    if problems:
        raise ConfigError(problems)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Turn a composed DictConfig into typed dataclasses (resolving interpolations) and validate."""
    try:
        run = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as err:
        raise ConfigError([f"{err.full_key} is required: add {err.full_key}=<value> to the command line."]) from None
    assert isinstance(run, RunConfig), type(run)
    validate(run)
    return run


def resolve_global_batch_size(cfg: RunConfig, world_size: int) -> RunConfig:
    """The run config with optim.grad_accum_steps derived from optim.global_batch_size (when it is set).

    Args:
        cfg: a validated run config.
        world_size: the number of processes of the job (all nodes).

    Raises:
        ConfigError: optim.grad_accum_steps set as well, or a global batch that the processes and
            data.micro_batch_size do not divide (naming all three and the nearest values that work).
    """
    o, d = cfg.optim, cfg.data
    if o.global_batch_size is None:
        return cfg
    per_step = world_size * d.micro_batch_size
    if o.grad_accum_steps != 1:
        raise ConfigError(
            [
                f"optim.global_batch_size={o.global_batch_size} and optim.grad_accum_steps={o.grad_accum_steps} are "
                "both set: the first derives the second. Keep one of them."
            ]
        )
    if o.global_batch_size % per_step:
        lower = max(per_step, o.global_batch_size // per_step * per_step)
        raise ConfigError(
            [
                f"optim.global_batch_size={o.global_batch_size} is not a multiple of {world_size} processes × "
                f"data.micro_batch_size={d.micro_batch_size} = {per_step} samples per micro-step: set "
                f"optim.global_batch_size={lower} or {lower + per_step}, or change data.micro_batch_size or the "
                "number of processes (parallel.nproc_per_node)."
            ]
        )
    derived = replace(o, grad_accum_steps=o.global_batch_size // per_step)
    resolved = replace(cfg, optim=derived)
    validate(resolved)  # the derived accumulation meets the checks a given one does (parallel.static_graph)
    return resolved


def config_as_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain nested dicts (enums as their names): what the loggers record."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the run directory's config.yaml holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
