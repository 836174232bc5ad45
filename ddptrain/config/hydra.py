"""Hydra glue: ``register_configs`` stores the root schema (``run_schema``) in Hydra's ConfigStore and registers the
``asset`` resolver (files shipped in ddptrain/assets) and the ``swept`` resolver (a sweep job's folder name from
the keys the command line sweeps).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ddptrain.config.run import RunConfig

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The shipped config groups (``conf/`` beside the package): ``python -m ddptrain`` and its helper commands."""


def _asset(name: str) -> str:
    """``${asset:tiny_qwen2}``: absolute path of a file or folder shipped in ddptrain/assets."""
    path = ASSETS_DIR / name
    if not path.exists():
        available = ", ".join(sorted(p.name for p in ASSETS_DIR.iterdir()))
        raise ValueError(f"${{asset:{name}}}: no such bundled asset. Available: {available}.")
    return str(path)


# ``python -m ddptrain``'s command line, for the processes that run a sweep's jobs and resolve their folder names
# (``swept_overrides``): submitit's job processes have their own argv, and inherit the environment.
COMMAND_LINE_ENV = "DDPTRAIN_COMMAND_LINE"


def swept_overrides(task_overrides: list[str], argv: list[str] | None = None) -> str:
    """``${swept:${hydra.overrides.task}}``: a sweep job's folder name from the keys the command line sweeps.

    ``key=value`` of each swept key (swept on the command line, or set by the sweeper: ``hydra.sweeper.params``,
    an Optuna trial), sorted, joined by commas; overrides that every job shares (``trainer.progress_bar=false``)
    would only lengthen every name. A ``/`` in a value becomes ``_``, so a
    swept path does not nest folders.

    Args:
        task_overrides: this job's overrides (``hydra.overrides.task``).
        argv: the command line; None = ``sys.argv`` (Hydra's launchers resolve folder names in the process
            that parsed it).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if argv is None:  # a job run by another process (submitit, a parallel sweep) reads its sweep's command line
        argv = json.loads(os.environ[COMMAND_LINE_ENV]) if COMMAND_LINE_ENV in os.environ else sys.argv
    # Overrides only: not the flags, nor the values some take (``--config-dir recipes``).
    args = [a for a in argv[1:] if not a.startswith("-") and ("=" in a or a.startswith("~"))]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except Exception:  # a command line Hydra itself will reject: it says why
        parsed = []
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
    given = {o.key_or_group for o in parsed}
    # Swept on the command line, or set by the sweeper itself (hydra.sweeper.params, Optuna's trials).
    named = [o for o in task_overrides if (key := o.split("=", 1)[0].lstrip("+~")) in swept or key not in given]
    return ",".join(sorted(named)).replace("/", "_")


def register_configs() -> None:
    """Register the root schema (``run_schema``, first in conf/train.yaml's defaults) and the ``asset`` and
    ``swept`` resolvers.

    The group fields of RunConfig are typed, so every group's YAML is checked against its
    dataclass when Hydra merges it. Idempotent.
    """
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", _asset)
    if not OmegaConf.has_resolver("swept"):
        OmegaConf.register_new_resolver("swept", swept_overrides)
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
