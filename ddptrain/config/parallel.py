"""The ``parallel`` group's schema (``conf/parallel/``): processes, backend, DDP's options, gradient compression,
restarts and how self-launched workers start, and their checks (some depend on ``trainer.device``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

import ddptrain.config.checks as checks
from ddptrain.config.checks import _positive
from ddptrain.config.trainer import Device, Precision, TrainerConfig


class Backend(str, Enum):
    auto = "auto"  # nccl on CUDA, gloo on CPU
    nccl = "nccl"
    gloo = "gloo"


class Strategy(str, Enum):
    ddp = "ddp"  # every rank holds the whole model, its gradients and optimizer states; gradients all-reduced
    fsdp2 = "fsdp2"  # each rank holds 1/N of them; a layer's weights all-gathered for its compute (fully_shard)


class StartMethod(str, Enum):
    spawn = "spawn"  # each rank a fresh interpreter that imports torch, transformers and peft itself
    forkserver = "forkserver"  # one server process imports them once; each rank (and restart) is a fork of it


class CommHook(str, Enum):
    none = "none"
    fp16_compress = "fp16_compress"
    bf16_compress = "bf16_compress"
    powersgd = "powersgd"


@dataclass
class ParallelConfig:
    nproc_per_node: Optional[int] = 1
    """Processes on this machine; null = adopt torchrun's count (or 1 when self-launched)."""
    strategy: Strategy = Strategy.ddp
    """ddp: a whole replica per rank (the fastest while it fits). fsdp2: parameters, gradients and optimizer states
    sharded over the ranks (``torch.distributed.fsdp.fully_shard``, one unit per decoder layer plus the root), each
    layer's weights gathered for its forward and backward; trainable weights kept in fp32, computed in the autocast
    dtype. For what does not fit DDP: a full fine-tune, a model larger than one device (README, "DDP or FSDP2")."""
    reshard_after_forward: bool = True
    """fsdp2: free each decoder layer's gathered weights after its forward and gather them again for its backward
    (one layer's in memory at a time); false keeps them to the backward: fewer all-gathers, every layer's memory."""
    cpu_offload: bool = False
    """fsdp2: keep the sharded parameters, gradients and optimizer states in host memory (the optimizer steps on the
    CPU); each layer's weights go to the device for its compute. For a model whose shards do not fit the device."""
    backend: Backend = Backend.auto
    timeout_s: int = 600
    """Collective timeout: a hung rank fails the run after this many seconds, not days."""
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    """Only when some trainable parameter gets no gradient (the pre-flight says when)."""
    static_graph: bool = False
    """DDP's static-graph mode; refused with optim.grad_accum_steps > 1 (PyTorch's reducer asserts under no_sync)."""
    gradient_as_bucket_view: bool = True
    """Gradients alias DDP's all-reduce buckets: saves one gradient copy of memory."""
    broadcast_buffers: bool = False
    """true: DDP sends rank 0's buffers to every rank before the forward that syncs gradients, a blocking
    collective per optimizer step where every rank waits for the slowest.
    Decoder LMs hold only constant buffers (rotary frequencies), proven equal on every rank at start-up;
    true for models whose buffers change while training (BatchNorm statistics)."""
    comm_hook: CommHook = CommHook.none
    """Compress gradients before all-reduce (bf16_compress needs nccl)."""
    powersgd_rank: int = 1
    max_restarts: int = 0
    """Self-launch only: restart the worker group this many times after a failure."""
    start_method: StartMethod = StartMethod.spawn
    """Self-launch only: how the workers start. ``forkserver`` imports the libraries once in a server process and
    forks each rank from it, restarts included: every launch after a process's first skips the imports (each further
    2-rank job of a sweep 2.4 s instead of 7.0 s on 2 cores, bench/README.md)."""


def _check_parallel(p: ParallelConfig, t: TrainerConfig, grad_accum_steps: int) -> list[str]:
    problems = _positive({"parallel.nproc_per_node": p.nproc_per_node, "parallel.timeout_s": p.timeout_s})
    if p.static_graph and grad_accum_steps > 1:
        # PyTorch's reducer with static_graph does not expect no_sync micro-steps: the first backward
        # dies with "expect_autograd_hooks_ INTERNAL ASSERT FAILED" (reducer.cpp).
        problems.append(
            f"parallel.static_graph=true with optim.grad_accum_steps={grad_accum_steps} crashes DDP at the first "
            "backward (PyTorch's static graph does not support no_sync accumulation): set "
            "parallel.static_graph=false, or optim.grad_accum_steps=1."
        )
    # Only bf16_compress needs the backend that parallel.backend=auto will pick (and so, maybe, torch).
    if p.comm_hook == CommHook.bf16_compress and _resolved_backend(p.backend, t.device) == Backend.gloo:
        if p.backend == Backend.gloo:
            why = "parallel.backend=gloo"
        elif t.device == Device.cpu:
            why = "parallel.backend=auto means gloo with trainer.device=cpu"
        else:
            why = "parallel.backend=auto means gloo here (trainer.device=auto and no CUDA device is visible)"
        problems.append(
            f"parallel.comm_hook=bf16_compress needs NCCL (PyTorch's hook refuses gloo), but {why}: "
            "use parallel.comm_hook=fp16_compress (or none) on CPU, or train on GPUs with parallel.backend=nccl."
        )
    if p.max_restarts < 0:
        problems.append(f"parallel.max_restarts={p.max_restarts} must be 0 or more.")
    return problems + _check_strategy(p, t)


def _check_strategy(p: ParallelConfig, t: TrainerConfig) -> list[str]:
    """What parallel.strategy=fsdp2 does not do (yet), and its keys set without it."""
    if p.strategy != Strategy.fsdp2:
        sharded_only = {
            "parallel.cpu_offload=true": p.cpu_offload,
            "parallel.reshard_after_forward=false": not p.reshard_after_forward,
        }
        return [
            f"{setting} shards nothing under parallel.strategy=ddp: set parallel.strategy=fsdp2 (or drop it)."
            for setting, given in sharded_only.items()
            if given
        ]
    problems = []
    if p.comm_hook != CommHook.none:
        problems.append(
            f"parallel.comm_hook={p.comm_hook.value} compresses DDP's all-reduce; parallel.strategy=fsdp2 "
            "reduce-scatters in fp32: set parallel.comm_hook=none."
        )
    if t.compile:
        problems.append(
            "trainer.compile=true with parallel.strategy=fsdp2 is not supported yet: set trainer.compile=false "
            "(or parallel.strategy=ddp)."
        )
    if t.precision == Precision.fp16:
        problems.append(
            "trainer.precision=fp16 with parallel.strategy=fsdp2 is not supported yet (its GradScaler has not been "
            "proven on sharded gradients): use trainer.precision=bf16, which needs no scaler (or fp32)."
        )
    return problems


def _resolved_backend(backend: Backend, device: Device) -> Backend:
    """What parallel.backend=auto becomes in the workers (ddptrain.parallel picks the same way)."""
    if backend != Backend.auto:
        return backend
    on_cuda = device == Device.cuda or (device == Device.auto and checks._cuda_available())
    return Backend.nccl if on_cuda else Backend.gloo
