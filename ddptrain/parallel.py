"""Everything that touches ``torch.distributed``: process group, rank facts, DDP, collectives.

The trainer never imports ``torch.distributed``; it calls the names below. Every
rank calls every collective here; none of them may sit behind ``if rank == 0``.
A world of one process still gets a (local, in-memory) process group, so the same
collectives work in a single-process run and cost nothing there.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.config import Backend, CommHook, Device, ParallelConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
# Where collective tensors must live: NCCL reduces CUDA tensors only, gloo CPU ones.
_collective_device = torch.device("cpu")

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class DistEnv:
    """Facts about this process's place in the job, fixed once the group forms."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_local_rank_zero(self) -> bool:
        return self.local_rank == 0


def launched_by_torchrun() -> bool:
    """True inside a worker that torchrun (or any elastic agent) started."""
    return all(name in os.environ for name in TORCHRUN_VARS)


def init_distributed(cfg: ParallelConfig, device: Device, store_port: int | None = None) -> DistEnv:
    """Join (or, alone, create) the process group and pin this process to its device.

    Args:
        cfg: the ``parallel`` config group.
        device: ``trainer.device``.
        store_port: port of the launcher's TCPStore on 127.0.0.1 (self-launch); None under
            torchrun, where the group forms from torchrun's MASTER_ADDR/MASTER_PORT.

    Returns:
        The DistEnv of this process.

    Raises:
        RuntimeError: CUDA asked for but missing, or nccl asked for without CUDA.
    """
    rank, local_rank, world_size, local_world_size = _rank_facts()
    torch_device = _pick_device(device, local_rank)
    backend = _pick_backend(cfg.backend, torch_device)
    timeout = timedelta(seconds=cfg.timeout_s)
    if world_size == 1 and store_port is None:
        store: dist.Store = dist.HashStore()
    else:
        store = _rendezvous_store(rank, store_port, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    global _collective_device
    _collective_device = torch_device if backend == "nccl" else torch.device("cpu")
    return DistEnv(rank, local_rank, world_size, local_world_size, torch_device, backend)


def _rendezvous_store(rank: int, store_port: int | None, timeout: timedelta) -> dist.Store:
    """The store the group forms over, namespaced by restart attempt.

    Self-launch: the launcher's store on 127.0.0.1. torchrun: MASTER_ADDR:MASTER_PORT, which the
    elastic agent hosts and keeps across ``--max-restarts``; without the per-attempt prefix a
    restarted group reads the dead group's addresses and gloo fails with "Connection refused".
    """
    if store_port is not None:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    else:
        agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=rank == 0 and not agent_hosts_it,
            timeout=timeout,
            wait_for_workers=False,
        )
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _rank_facts() -> tuple[int, int, int, int]:
    if not launched_by_torchrun():
        return 0, 0, 1, 1
    return tuple(int(os.environ[name]) for name in TORCHRUN_VARS)  # type: ignore[return-value]


def _pick_device(device: Device, local_rank: int) -> torch.device:
    want_cuda = device == Device.cuda or (device == Device.auto and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but this torch build sees no CUDA device: use trainer.device=cpu.")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible. "
            "Lower parallel.nproc_per_node (or torchrun --nproc_per_node) to the number of GPUs."
        )
    # Before anything touches CUDA, or every rank allocates a context on GPU 0.
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _pick_backend(backend: Backend, device: torch.device) -> str:
    if backend == Backend.auto:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == Backend.nccl and device.type != "cuda":
        raise RuntimeError("parallel.backend=nccl needs CUDA devices: use parallel.backend=gloo (or auto) on CPU.")
    return backend.value


def teardown() -> None:
    """Leave the process group (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- DDP


@dataclass
class CommCounter:
    """What DDP's communication hook actually sent: calls and bytes per rank (measured in the hook)."""

    calls: int = 0
    syncs: int = 0
    bytes: int = 0

    def take(self) -> tuple[int, int, int]:
        """(calls, syncs, bytes) since the last take."""
        counts = (self.calls, self.syncs, self.bytes)
        self.calls = self.syncs = self.bytes = 0
        return counts


def wrap_model(model: nn.Module, cfg: ParallelConfig, env: DistEnv, counter: CommCounter | None = None) -> nn.Module:
    """Wrap in DDP when there is more than one rank; a single process gets the model back.

    The communication hook (plain all-reduce unless parallel.comm_hook says otherwise) is
    registered here, wrapped so that ``counter`` sees every bucket it sends. Skipped
    micro-steps (``grad_sync(enabled=False)``) run no hook at all.
    """
    if env.world_size == 1:
        return model
    ddp = DDP(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
    )
    state, hook, wire_bytes = _comm_hook(cfg, env)
    ddp.register_comm_hook(state, _counting(hook, wire_bytes, counter or CommCounter()))
    return ddp


def _comm_hook(cfg: ParallelConfig, env: DistEnv) -> tuple[Any, Any, int | None]:
    """(state, hook, bytes per gradient element on the wire; None when it depends on the bucket)."""
    if cfg.comm_hook == CommHook.none:
        return None, default_hooks.allreduce_hook, None
    if cfg.comm_hook == CommHook.fp16_compress:
        return None, default_hooks.fp16_compress_hook, 2
    if cfg.comm_hook == CommHook.bf16_compress:
        if env.backend != "nccl":
            raise RuntimeError(
                "parallel.comm_hook=bf16_compress needs the nccl backend (PyTorch's hook refuses gloo): "
                "use parallel.comm_hook=fp16_compress on CPU."
            )
        return None, default_hooks.bf16_compress_hook, 2
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=cfg.powersgd_rank, start_powerSGD_iter=2
    )
    return state, powerSGD_hook.powerSGD_hook, None


def _counting(hook: Any, wire_bytes: int | None, counter: CommCounter) -> Any:
    # No annotations: DDP rejects a hook whose ``bucket`` annotation is not the GradBucket class
    # itself, and ``from __future__ import annotations`` would turn it into a string.
    def counted(state, bucket):
        buffer = bucket.buffer()
        counter.calls += 1
        counter.syncs += int(bucket.is_last())
        # PowerSGD sends low-rank factors whose size is known only inside the hook: count the
        # uncompressed size as an upper bound.
        counter.bytes += buffer.numel() * (wire_bytes or buffer.element_size())
        return hook(state, bucket)

    return counted


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP and torch.compile wrappers (what gets saved)."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within this block, backward all-reduces gradients only if ``enabled``.

    Accumulation micro-steps run with enabled=False (DDP's ``no_sync``); the last
    micro-step of an optimizer step syncs the accumulated gradients once.
    """
    if enabled or not isinstance(model, DDP):
        yield
        return
    with model.no_sync():
        yield


# ----------------------------------------------------------------------------- collectives


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks; returns a new tensor on the input's device (the input is untouched)."""
    out = values.detach().to(_collective_device, copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(values.device)


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order (small picklable values only)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s value of ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    dist.barrier()


@contextlib.contextmanager
def local_rank_zero_first(env: DistEnv, timeout_s: int, what: str) -> Iterator[None]:
    """Run the block on local rank 0 first, then on the other ranks (which then hit its cache).

    The waiting ranks block on a barrier of a separate gloo group whose timeout is
    ``timeout_s`` (data.prepare_timeout_s), not the short collective timeout, so slow
    preprocessing never trips ``parallel.timeout_s``.
    """
    if env.world_size == 1:
        yield
        return
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    if not env.is_local_rank_zero:
        log.info("waiting for local rank 0 to finish %s (up to %d s)", what, timeout_s)
        dist.barrier(group=group)
    yield
    if env.is_local_rank_zero:
        dist.barrier(group=group)
    dist.destroy_process_group(group)


def check_same_on_all_ranks(value: Any, what: str, fix: str) -> None:
    """Raise on every rank if ``value`` differs between ranks (e.g. micro-batches per epoch).

    Raises:
        RuntimeError: naming each rank's value and the fix.
    """
    values = all_gather_object(value)
    if any(v != values[0] for v in values):
        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise RuntimeError(f"{what} differs between ranks ({per_rank}). {fix}")


def trainable_checksum(model: nn.Module) -> float:
    """A float64 sum over trainable parameters: equal on all ranks iff the replicas agree (cheaply)."""
    with torch.no_grad():
        total = torch.zeros((), dtype=torch.float64, device="cpu")
        for p in model.parameters():
            if p.requires_grad:
                total += p.detach().double().sum().cpu() + p.detach().double().abs().sum().cpu()
    return float(total)
