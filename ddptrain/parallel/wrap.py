"""The strategy's wrapper around the loss module, and its accumulation switch: DDP (``parallel.ddp``) or FSDP2
(``parallel.fsdp``), as ``parallel.strategy`` says."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ddptrain.config import ParallelConfig, Strategy
from ddptrain.parallel.ddp import CommCounter, ddp_grad_sync, wrap_ddp
from ddptrain.parallel.fsdp import FSDPModule, no_reduce_scatter, shard_model
from ddptrain.parallel.group import DistEnv


def wrap_model(
    model: nn.Module,
    cfg: ParallelConfig,
    env: DistEnv,
    counter: CommCounter | None = None,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """DDP around ``model`` (``wrap_ddp``: the model itself on one rank); with ``parallel.strategy=fsdp2`` the model
    sharded in place, whatever the world size (``shard_model``: its units gather their weights in ``compute_dtype``).
    ``counter`` counts what the gradient synchronisation sends."""
    if cfg.strategy == Strategy.fsdp2:
        return shard_model(model, cfg, env, counter or CommCounter(), compute_dtype)
    return wrap_ddp(model, cfg, env, counter)


def load_device(cfg: ParallelConfig, pretrained: bool) -> torch.device | None:
    """Where the model's weights are built or loaded, if not on the training device. FSDP2's: a pretrained model on
    the meta device (no weights until sharded; each rank then reads its rows: ``weights.materialize``), a random one
    on the host (every rank draws the whole model there; ``fully_shard`` then moves each unit to the device and
    keeps its shard). DDP's: on the device (None). ``pretrained``: ``model.init=pretrained``."""
    if cfg.strategy != Strategy.fsdp2:
        return None
    return torch.device("meta" if pretrained else "cpu")


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within this block, the backward of ``model``'s forward synchronises gradients only if ``enabled``: an
    accumulation micro-step runs with enabled=False, the last one syncs them all once (DDP's ``no_sync``; FSDP2's
    ``set_requires_gradient_sync``)."""
    if isinstance(model, FSDPModule):  # every micro-step: the wrapper's type, not each parameter's
        with no_reduce_scatter(model, enabled):
            yield
    else:
        with ddp_grad_sync(model, enabled):
            yield
