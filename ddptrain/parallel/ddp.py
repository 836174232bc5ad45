"""The DDP wrapper: wrapping the loss module, the communication hooks that count (and time) what all-reduce sends,
and ``grad_sync`` for accumulation."""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.config import CommHook, ParallelConfig
from ddptrain.parallel.collectives import check_replicas_agree
from ddptrain.parallel.group import DistEnv, wrapped

log = logging.getLogger(__name__)


@dataclass
class CommCounter:
    """What the gradient synchronisation actually sent (calls and bytes per rank), and when it ran: DDP's
    communication hook (all-reduce), or FSDP2's reduce-scatters and all-gathers (``parallel.fsdp``).

    The times let ``timing.StepClock`` tell the communication that backward hid from the part it
    waited for: on the CPU, ``hook_intervals`` are the host times spent inside the hook (the autograd
    thread launches the all-reduce there and cannot compute meanwhile); on CUDA, ``last_launch`` is an
    event recorded on the compute stream when the last bucket is handed over, which is when the
    gradients are all computed and only communication is left.
    """

    calls: int = 0
    syncs: int = 0
    bytes: int = 0
    gathers: int = 0
    """FSDP2: all-gathers of sharded weights (forward, and backward where resharded), and their bytes received."""
    gathered_bytes: int = 0
    sharded: bool = False
    """The model is sharded (FSDP2): ``calls``, ``syncs`` and ``bytes`` count reduce-scatters, not all-reduces."""
    timed: bool = False
    """Set before ``wrap_model``: time the hook (trainer.timing)."""
    counting: bool = True
    """False when DDP's built-in all-reduce runs (no hook): nothing was counted."""
    hook_intervals: list[tuple[float, float]] = field(default_factory=list)
    last_launch: Any = None

    def take(self) -> dict[str, int]:
        """The counts since the last take, by the names the metrics record gives them (``<name>_per_step``)."""
        sync = "reducescatter" if self.sharded else "allreduce"
        counts = {f"{sync}_calls": self.calls, f"{sync}_syncs": self.syncs, f"{sync}_bytes": self.bytes}
        if self.sharded:
            counts |= {"allgather_calls": self.gathers, "allgather_bytes": self.gathered_bytes}
        self.calls = self.syncs = self.bytes = self.gathers = self.gathered_bytes = 0
        return counts

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What is sent within the block is not counted (an evaluation's all-gathers are not a step's)."""
        counts = (self.calls, self.syncs, self.bytes, self.gathers, self.gathered_bytes)
        try:
            yield
        finally:
            self.calls, self.syncs, self.bytes, self.gathers, self.gathered_bytes = counts

    def take_times(self) -> tuple[list[tuple[float, float]], Any]:
        """The hook's host intervals and the last launch event since the last call (then forgotten)."""
        times = (self.hook_intervals, self.last_launch)
        self.hook_intervals, self.last_launch = [], None
        return times


def wrap_ddp(model: nn.Module, cfg: ParallelConfig, env: DistEnv, counter: CommCounter | None = None) -> nn.Module:
    """Wrap in DDP when there is more than one rank; a single process gets the model back.

    The communication hook (plain all-reduce unless parallel.comm_hook says otherwise) is
    registered here and counts into ``counter`` every bucket it handles and the bytes of
    every tensor it hands to the all-reduce. Skipped micro-steps (``grad_sync(enabled=False)``)
    run no hook at all.
    """
    if env.world_size == 1:
        return model
    # Every rank built or loaded the same weights (same seed, same files). DDP would broadcast all of
    # them from rank 0, the frozen base included (15 GB per rank for a 7B in bf16); a checksum
    # compared once proves the same for a few bytes of communication.
    check_replicas_agree(model)
    ddp = DDP(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        **_buffer_sync(cfg.broadcast_buffers),
        **_NO_INIT_SYNC,
    )
    wrapped.add(ddp)
    counter = counter or CommCounter()
    if cfg.comm_hook == CommHook.none and not counter.timed:
        # DDP's built-in all-reduce (in C++): no Python call per bucket when nothing is counted or timed.
        counter.counting = False
        return ddp
    state, hook = _comm_hook(cfg, env, counter)
    ddp.register_comm_hook(state, _timed_hook(hook, counter) if counter.timed else hook)
    return ddp


# DDP's start-up broadcast can be switched off from torch 2.6; older releases still broadcast.
_DDP_PARAMETERS = inspect.signature(DDP.__init__).parameters
_NO_INIT_SYNC = {"init_sync": False} if "init_sync" in _DDP_PARAMETERS else {}
# Not re-sending the buffers before each step's forward: ``forward_sync_buffers=False`` from the torch release
# that deprecated ``broadcast_buffers`` (which then warns on every run); ``broadcast_buffers=True`` keeps
# DDP's long-standing behaviour when asked for.
_NO_FORWARD_SYNC = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMETERS else "broadcast_buffers"


def _buffer_sync(broadcast_buffers: bool) -> dict[str, bool]:
    return {"broadcast_buffers": True} if broadcast_buffers else {_NO_FORWARD_SYNC: False}


def _comm_hook(cfg: ParallelConfig, env: DistEnv, counter: CommCounter) -> tuple[Any, Any]:
    """(state, hook) for ``DDP.register_comm_hook``; the hook counts what it sends into ``counter``."""
    if cfg.comm_hook == CommHook.none:
        return None, _allreduce_hook(counter)
    if cfg.comm_hook == CommHook.fp16_compress:
        return None, _compress_hook(torch.float16, counter)
    if cfg.comm_hook == CommHook.bf16_compress:
        if env.backend != "nccl":
            raise RuntimeError(
                "parallel.comm_hook=bf16_compress needs the nccl backend (PyTorch's hook refuses gloo): "
                "use parallel.comm_hook=fp16_compress on CPU."
            )
        return None, _compress_hook(torch.bfloat16, counter)
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=cfg.powersgd_rank, start_powerSGD_iter=2
    )
    return state, _powersgd_hook(counter)


# The hooks carry no annotations: DDP rejects a hook whose ``bucket`` annotation is not the
# GradBucket class itself, and ``from __future__ import annotations`` would turn it into a string.
# They mirror torch's default_hooks (allreduce_hook, fp16/bf16_compress_hook), counting on the way.


def _timed_hook(hook: Any, counter: CommCounter) -> Any:
    """``hook``, recording when it runs (see ``CommCounter``): two clock reads per bucket, no device sync."""

    def timed(state, bucket):
        if bucket.is_last() and bucket.buffer().is_cuda:
            counter.last_launch = torch.cuda.Event(enable_timing=True)
            counter.last_launch.record()
        entered = time.perf_counter()
        future = hook(state, bucket)
        counter.hook_intervals.append((entered, time.perf_counter()))
        return future

    return timed


def _count_bucket(counter: CommCounter, bucket: Any) -> None:
    counter.calls += 1
    counter.syncs += int(bucket.is_last())


def _average_async(tensor: torch.Tensor, counter: CommCounter) -> torch.futures.Future:
    """Start averaging ``tensor`` in place over ranks; count the bytes handed to the all-reduce."""
    counter.bytes += tensor.numel() * tensor.element_size()
    # Divide first: a sum of fp16 gradients over many ranks can overflow where their mean does not.
    tensor.div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future()


def _allreduce_hook(counter: CommCounter) -> Any:
    """DDP's own behaviour: average the bucket as it is (fp32 gradients send 4 bytes each)."""

    def allreduce(state, bucket):
        _count_bucket(counter, bucket)
        return _average_async(bucket.buffer(), counter).then(lambda fut: fut.value()[0])

    return allreduce


def _compress_hook(dtype: torch.dtype, counter: CommCounter) -> Any:
    """Average a copy of the bucket cast to ``dtype``, then write the result back into the bucket."""

    def compressed_allreduce(state, bucket):
        _count_bucket(counter, bucket)
        buffer = bucket.buffer()

        def decompress(fut):
            # In place: the bucket's own memory (gradient views) holds the result, no second fp32 copy.
            return buffer.copy_(fut.value()[0])

        return _average_async(buffer.to(dtype), counter).then(decompress)

    return compressed_allreduce


def _powersgd_hook(counter: CommCounter) -> Any:
    """torch's PowerSGD hook, counting the bytes it all-reduces.

    Before ``start_powerSGD_iter`` it averages the bucket as it is. After, it all-reduces the
    tensors it does not compress, then the P factors, then the Q factors (the last two from
    callbacks, after the hook returns); their element counts are exactly what it adds to
    ``state.compression_stats()``'s "after compression" total while it splits the bucket.
    """

    def powersgd(state, bucket):
        _count_bucket(counter, bucket)
        buffer = bucket.buffer()
        full_bucket = state.iter < state.start_powerSGD_iter
        elements_before = state.compression_stats()[2]
        future = powerSGD_hook.powerSGD_hook(state, bucket)
        elements = buffer.numel() if full_bucket else state.compression_stats()[2] - elements_before
        counter.bytes += elements * buffer.element_size()
        return future

    return powersgd


@contextlib.contextmanager
def ddp_grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within this block, backward all-reduces gradients only if ``enabled``.

    Accumulation micro-steps run with enabled=False (DDP's ``no_sync``); the last
    micro-step of an optimizer step syncs the accumulated gradients once. ``model`` may be
    torch.compile's wrapper around DDP: its forward still runs DDP's, which reads the flag.
    """
    ddp = _find_ddp(model)
    if enabled or ddp is None:
        yield
        return
    with ddp.no_sync():
        yield


def _find_ddp(model: nn.Module) -> DDP | None:
    """The DDP module ``model`` is or wraps (through torch.compile's ``_orig_mod``), or None."""
    while not isinstance(model, DDP):
        if not hasattr(model, "_orig_mod"):
            return None
        model = model._orig_mod
    return model
