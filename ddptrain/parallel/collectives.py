"""Collectives every rank calls (sums, gathers, broadcasts, barriers, the late read of a step's results, waiting
for rank 0's work past the collective timeout) and the checks built on them (replicas agree)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.config import ParallelConfig
from ddptrain.process import hangs

log = logging.getLogger(__name__)
T = TypeVar("T")
# Where collective tensors must live: NCCL reduces CUDA tensors only, gloo CPU ones.
_collective_device = torch.device("cpu")
# The store the group formed over (``after_rank_zero`` waits there, past parallel.timeout_s), and that timeout.
_store: dist.Store | None = None
_timeout_s = 600.0


def bind(store: dist.Store, device: torch.device, timeout_s: float) -> None:
    """What the collectives need from the group just formed: its store, the device collective tensors live on
    (CUDA for NCCL, the CPU for gloo) and parallel.timeout_s."""
    global _collective_device, _store, _timeout_s
    _collective_device, _store, _timeout_s = device, store, float(timeout_s)


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


class LateRead:
    """A device value copied to the host without waiting; ``value()`` waits for that copy only.

    The training loop reads the stop votes of step k after queueing step k+1: on a GPU the host
    then never waits for the step in flight (CPU tensors are simply read). When it does wait, the device has not
    finished step k: another rank has not joined one of its collectives. The hang report then shows this rank in
    ``device_wait`` at step k (not in step k+1, where the host is), and the wait gives up after
    ``parallel.timeout_s`` with an error the hang report knows, before NCCL's watchdog would end the process
    (``timeout_grace_s``).

    Args:
        tensor: the value, on the device; the copy is queued after everything queued so far.
        step: the optimizer step whose work the copy follows (1-based, as the hang report counts).
    """

    def __init__(self, tensor: torch.Tensor, step: int):
        self.host = tensor.detach().to("cpu", non_blocking=True)
        self.copied = torch.cuda.Event() if tensor.is_cuda else None
        if self.copied is not None:
            self.copied.record()
        self.waits_in = hangs.Phase("device_wait", step, None, time.time())

    def values(self) -> list[float]:
        """The values (one host read); waits for the device up to ``parallel.timeout_s`` after the step was queued.

        Raises:
            RuntimeError: the device did not get there in time ("Timed out waiting ...ms for the device").
        """
        if self.copied is not None and not self.copied.query():
            with hangs.board.showing(self.waits_in):
                wait_for_device(self.copied, self.waits_in.since + _timeout_s, self.waits_in.step)
        return [float(v) for v in self.host.reshape(-1).tolist()]

    def value(self) -> float:
        """The value of a one-element tensor (``values`` otherwise)."""
        (only,) = self.values()
        return only


DEVICE_POLL_S = 0.0005
"""How often a host that waits for the device looks: ``event.synchronize()`` could not give up at a deadline."""


def wait_for_device(event: Any, deadline: float, step: int | None) -> None:
    """Until ``event`` (a CUDA event, or anything with ``query()``) completes, or ``deadline`` (``time.time()``).

    Raises:
        RuntimeError: the deadline passed; its text is what ``hangs.is_collective_timeout`` looks for.
    """
    while not event.query():
        if time.time() >= deadline:
            raise RuntimeError(
                f"Timed out waiting {_timeout_s * 1000:.0f}ms for the device to finish step {step} "
                f"(parallel.timeout_s={_timeout_s:g}): another rank has not joined one of its collectives"
            )
        time.sleep(DEVICE_POLL_S)


def all_gather_tensor(values: torch.Tensor) -> torch.Tensor:
    """Every rank's ``values`` stacked in rank order: ``[world_size, *values.shape]`` on the input's device.

    Every rank must pass the same shape and dtype.
    """
    local = values.detach().to(_collective_device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.stack(gathered).to(values.device)


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s value of ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    dist.barrier()


def after_rank_zero(work: Callable[[], T], what: str, timeout_s: float, timeout_key: str) -> T | None:
    """``work()`` on every rank (elsewhere than rank 0 a null object's no-op), then the other ranks wait for rank 0's
    to end, up to ``timeout_s``: through a key in the group's store, not a collective, so rank 0 may take longer
    than ``parallel.timeout_s`` (a checkpoint of tens of GB on network storage). Rank 0 leaves its outcome under
    the key, so a failure there ends every rank at once, each with rank 0's error. Every rank calls it, in the
    same order, like a collective.

    Args:
        work: what rank 0 does (a checkpoint writer's ``save``).
        what: for the errors: "save the checkpoint of step 20".
        timeout_s: how long the other ranks wait.
        timeout_key: the config key that sets ``timeout_s``, named in the error.

    Returns:
        ``work()``'s result (on rank 0; None elsewhere).

    Raises:
        RuntimeError: rank 0 failed (its error), or did not finish within ``timeout_s``.
    """
    key = f"ddptrain/after_rank_zero/{next(_rank_zero_works)}"
    if dist.get_world_size() == 1:
        return work()
    assert _store is not None, "init_distributed first"
    if dist.get_rank() == 0:
        try:
            result = work()
        except BaseException as err:
            _store.set(key, f"failed: {type(err).__name__}: {err}"[:2000])
            raise
        _store.set(key, "ok")
        return result
    work()
    outcome = _wait_for_key(key, time.monotonic() + timeout_s)
    if outcome is None:
        raise RuntimeError(
            f"rank 0 did not {what} within {timeout_key}={timeout_s:g} s: raise {timeout_key} if the storage is "
            "this slow, or look for a rank 0 that hung (its stacks: <run>/hang/)."
        )
    if outcome != "ok":
        raise RuntimeError(f"rank 0 could not {what}: {outcome.removeprefix('failed: ')}")
    return None


_rank_zero_works = itertools.count()
AFTER_RANK_ZERO_POLL_S = (0.01, 1.0)
"""The first and the longest pause between two looks at the store (doubling): a short save is seen at once,
a long one costs the store one request a second per waiting rank."""


def _wait_for_key(key: str, deadline: float) -> str | None:
    """The key's value once rank 0 set it, or None at ``deadline`` (``time.monotonic()``). Short looks, not one long
    ``store.wait``: between two, Python's signal handlers run (a second Ctrl-C aborts a save)."""
    assert _store is not None, "init_distributed first"
    pause, longest = AFTER_RANK_ZERO_POLL_S
    while not _store.check([key]):
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, longest)
    return _store.get(key).decode()


def check_same_on_all_ranks(value: Any, what: str, fix: str) -> None:
    """Raise on every rank if ``value`` differs between ranks (e.g. micro-batches per epoch).

    Raises:
        RuntimeError: naming each rank's value and the fix.
    """
    values = all_gather_object(value)
    if any(v != values[0] for v in values):
        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise RuntimeError(f"{what} differs between ranks ({per_rank}). {fix}")


def weights_checksum(model: nn.Module, trainable_only: bool = False) -> tuple[int, int]:
    """A checksum of the parameters' bits (and the buffers', unless ``trainable_only``): equal on all ranks
    iff the replicas agree, exactly. The buffers count because DDP does not re-send them every step
    (parallel.broadcast_buffers=false): they must agree from the start.

    Integer sums of the raw bit patterns, plain and weighted by position (so swapped elements or
    swapped tensors show too), wrapping modulo 2**64: the result does not depend on the order of
    the reduction (thread count, GPU model), where a float sum would. Slices of at most
    ``_CHECKSUM_SLICE`` elements bound the int64 copies; one host read at the end.
    """
    with torch.no_grad():
        parts, offset = [], 0
        tensors = [*model.parameters(), *model.buffers()]
        if trainable_only:
            tensors = [p for p in model.parameters() if p.requires_grad]
        for p in tensors:
            for piece in p.detach().reshape(-1).split(_CHECKSUM_SLICE):
                bits = piece.view(_SAME_SIZE_INT[piece.element_size()]).long()
                position = torch.arange(offset + 1, offset + 1 + bits.numel(), device=bits.device)
                parts.append(torch.stack([bits.sum(), (bits * position).sum()]))
                offset += bits.numel()
        if not parts:
            return 0, 0
        plain, weighted = torch.stack(parts).sum(dim=0).tolist()
        return plain, weighted


_CHECKSUM_SLICE = 1 << 22
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def trainable_checksum(model: nn.Module) -> tuple[int, int]:
    """``weights_checksum`` of the trainable parameters (after step 1: were the gradients synced?)."""
    return weights_checksum(model, trainable_only=True)


def check_replicas_agree(model: nn.Module) -> None:
    """Raise on every rank unless every rank holds the same weights, frozen ones included.

    Raises:
        RuntimeError: naming each rank's checksum and the likely causes.
    """
    check_same_on_all_ranks(
        weights_checksum(model),
        "the model's weights",
        "Every rank must build the same model: point model.name_or_path at the same files on every node, "
        "and keep model.init=random runs on the same seed (trainer.seed) and transformers version.",
    )


def check_every_trainable_param_has_a_gradient(model: nn.Module, cfg: ParallelConfig) -> None:
    """After a step's backward and before the next ``zero_grad``: name trainable parameters that got no
    gradient on any rank (their ``.grad`` is still None).

    Under DDP such a parameter stalls its gradient bucket and the next step fails with
    "Expected to have finished reduction in the prior iteration"; say which ones and why.

    Raises:
        RuntimeError: some did, with several ranks and ``parallel.find_unused_parameters=false``.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):  # FSDP2 reduce-scatters what got a gradient: an unused parameter stalls nothing
        return
    missing = sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None)
    unused = sorted(set().union(*all_gather_object(missing)))
    if not unused:
        return
    names = ", ".join(unused[:10]) + (f" and {len(unused) - 10} more" if len(unused) > 10 else "")
    if dist.get_world_size() > 1 and not cfg.find_unused_parameters:
        raise RuntimeError(
            f"{len(unused)} trainable parameters received no gradient in step 1: {names}. Freeze them "
            "(e.g. narrow model.lora_target_modules), or set parallel.find_unused_parameters=true."
        )
    log.warning("%d trainable parameters received no gradient in step 1: %s", len(unused), names)


def check_trainable_params_agree(model: nn.Module) -> None:
    """After step 1: every rank holds the same trainable weights, so the gradients were synchronised.

    Raises:
        RuntimeError: naming each rank's checksum; the loss was computed outside the DDP-wrapped module.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):  # FSDP2: each rank holds its own shard, which differ by design
        return
    checksums = all_gather_object(trainable_checksum(model))
    if any(c != checksums[0] for c in checksums):
        raise RuntimeError(
            f"trainable parameters differ between ranks after step 1 (checksums {checksums}): gradients "
            "were not synchronised. The loss must be computed inside the DDP-wrapped module."
        )
