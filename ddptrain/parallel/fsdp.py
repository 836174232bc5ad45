"""FSDP2 (``parallel.strategy=fsdp2``): the model sharded over the ranks with ``torch.distributed.fsdp.fully_shard``,
its all-gathers and reduce-scatters counted as they run, and the few places where a sharded model is handled
otherwise than a replica (accumulation, evaluation and generation, the checks after step 1).

The units: one per decoder layer, then the loss module as the root, which holds what is left (the embedding, the
final norm and the LM head, tied to the embedding: a tied pair must sit in one unit). LoRA is applied before
sharding (``model.build_model``), so every rank's ``lora_A`` and ``lora_B`` are shards of the same full tensors.

Precision: every trainable parameter is kept in fp32 (the masters the optimizer steps; a full fine-tune of a bf16
model is upcast before it is sharded), the frozen base of a LoRA run in ``model.dtype``; ``MixedPrecisionPolicy``
gathers them in the compute dtype (bf16 under ``trainer.precision=bf16``, else as they are) and reduces gradients in
fp32. The step is DDP's: each rank back-propagates its loss sum times world size over the global token count and
the reduce-scatter averages over ranks, which leaves exactly the global token mean.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor

from ddptrain.config import ParallelConfig
from ddptrain.parallel.collectives import check_replicas_agree
from ddptrain.parallel.ddp import CommCounter
from ddptrain.parallel.group import DistEnv


class CountingAllGather(DefaultAllGather):
    """FSDP2's own all-gather, counting each call and the bytes it gathers (the full output buffer: what every rank
    receives) into ``counter``."""

    def __init__(self, counter: CommCounter):
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counter.gathers += 1
        self.counter.gathered_bytes += output_tensor.numel() * output_tensor.element_size()
        with _timed(self.counter, output_tensor):
            return super().__call__(output_tensor, input_tensor, group, async_op)


class CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter, counting each call and the bytes handed to it (the full, unsharded gradients);
    ``last``: the unit whose gradients a backward reduce-scatters last, which ends a gradient synchronisation."""

    def __init__(self, counter: CommCounter, last: bool):
        self.counter, self.last = counter, last

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counter.calls += 1
        self.counter.syncs += int(self.last)
        self.counter.bytes += input_tensor.numel() * input_tensor.element_size()
        with _timed(self.counter, input_tensor):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)


@contextlib.contextmanager
def _timed(counter: CommCounter, tensor: torch.Tensor) -> Iterator[None]:
    """The host time inside one of FSDP2's collectives, into ``counter.hook_intervals`` (``timing.StepClock`` books it
    as communication). On the CPU FSDP2 calls them synchronously (gloo): the rank waits there and computes nothing.
    On CUDA they only queue work on a side stream: not timed (their wait stays in the compute column)."""
    entered = time.perf_counter()
    yield
    if counter.timed and not tensor.is_cuda:  # trainer.timing (the clock takes them at each backward's end)
        counter.hook_intervals.append((entered, time.perf_counter()))


def decoder_layers(loss_module: nn.Module) -> list[nn.Module]:
    """The decoder's layers (``model.layers`` of a transformers causal LM), one FSDP unit each.

    Raises:
        RuntimeError: a model whose decoder keeps no ``layers`` list.
    """
    layers = getattr(loss_module.decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise RuntimeError(
            f"parallel.strategy=fsdp2 shards a decoder's layers, but {type(loss_module.decoder).__name__} has no "
            "`layers` list: use parallel.strategy=ddp for this model family."
        )
    return list(layers)


def shard_model(
    loss_module: nn.Module,
    cfg: ParallelConfig,
    env: DistEnv,
    counter: CommCounter,
    compute_dtype: torch.dtype | None,
) -> nn.Module:
    """Shard ``loss_module`` in place (its class becomes FSDP's, its parameters DTensors) and return it.

    Every rank built the same weights (checked first, as for DDP, by a checksum); each keeps its shard of each
    parameter and frees the rest. A model built on the meta device has no weights yet: ``materialize`` gives each
    rank its shards after this. ``compute_dtype``: what the units gather their parameters in (None: as stored).
    """
    if not any(p.is_meta for p in loss_module.parameters()):
        check_replicas_agree(loss_module)
    for p in loss_module.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # fp32 masters: the optimizer steps these, computed in compute_dtype
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if cfg.cpu_offload else OffloadPolicy()
    mesh = dist.device_mesh.init_device_mesh(env.device.type, (env.world_size,))
    shared = {"mesh": mesh, "mp_policy": policy, "offload_policy": offload}
    layers = decoder_layers(loss_module)
    # Backward ends with the embedding (the root's, when it trains: a full fine-tune), else with the first layer.
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    trains = [any(p.requires_grad for p in layer.parameters()) for layer in layers]
    trains.append(any(p.requires_grad and id(p) not in in_layers for p in loss_module.parameters()))
    last = len(layers) if trains[-1] else trains.index(True)
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward, **shared)
        _count(layer, counter, last=i == last)
    # The root's weights (embedding, LM head) are the first needed in backward: resharding them gains nothing.
    fully_shard(loss_module, reshard_after_forward=False, **shared)
    _count(loss_module, counter, last=last == len(layers))
    counter.counting = counter.sharded = True
    return loss_module


def _count(unit: FSDPModule, counter: CommCounter, last: bool) -> None:
    unit.set_custom_all_gather(CountingAllGather(counter))
    unit.set_custom_reduce_scatter(CountingReduceScatter(counter, last))


def materialize(module: nn.Module, device: torch.device, rows: Callable[[str, int, int], torch.Tensor]) -> None:
    """A module built on the meta device and sharded, made real: this rank allocates its shards on ``device`` and
    copies into each its rows of the whole parameter, ``rows(name, start, stop)`` (``fully_shard`` cuts the first
    dimension in chunks of ceil(rows / ranks), rank r's starting at r times that), so no rank holds a whole weight.
    The buffers (rotary frequencies, computed when the model was built) are kept as they are, on their device. Every
    rank calls it; no collective runs."""
    buffers = dict(module.named_buffers(remove_duplicate=False))
    module.to_empty(device=device)
    for name, buffer in buffers.items():  # as they were, where they were (offload: on the device, not with the shards)
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = buffer
    with torch.no_grad():
        for name, param in module.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param  # fully_shard: no 0-dim parameters
            chunk = -(-param.shape[0] // param.device_mesh.size()) if isinstance(param, DTensor) else 0
            start = chunk * param.device_mesh.get_local_rank() if isinstance(param, DTensor) else 0
            local.copy_(rows(name, start, start + local.shape[0]))


def is_sharded(model: nn.Module) -> bool:
    """The model, or the module its parameters belong to, is sharded (FSDP2): its parameters are DTensors."""
    return isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters())


def whole_trainable(model: nn.Module, rank: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A sharded model's trainable tensors, gathered whole onto rank 0's host, by ``state_dict`` key (a tied key
    too, the same tensor): what a replica's ``state_dict`` would give for them. ``dtype``: what they are saved in
    (a bf16 model's full fine-tune trains fp32 masters and saves bf16, as it computes); None keeps theirs. Every rank
    calls it (one all-gather per tensor); the others get an empty dict. Frozen weights (a LoRA base) are not
    gathered."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    gathered: dict[int, torch.Tensor] = {}
    whole = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in trainable:
            continue
        if id(tensor) not in gathered:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            kept = full.detach().to("cpu", dtype or full.dtype, copy=True) if rank == 0 else full[:0]
            gathered[id(tensor)] = kept
        whole[key] = gathered[id(tensor)]
    return whole if rank == 0 else {}


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    weights, optim = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": weights, "optimizer": optim}


def save_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, rank: int) -> Path:
    """Every rank writes its shards of the trainable weights and of the optimizer state to ``folder``
    (``torch.distributed.checkpoint``: a file per rank, the metadata last, by rank 0). Every rank calls it."""
    import torch.distributed.checkpoint as dcp

    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)  # what an interrupted save left: not mixed into this one
    dist.barrier()
    dcp.save(_sharded_state(model, optimizer), checkpoint_id=folder)
    return folder


def load_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load what ``save_shards`` wrote into the sharded model and its optimizer, on any number of ranks
    (``torch.distributed.checkpoint`` cuts each tensor for this layout). Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=folder)
    # Not strict: the frozen weights (a LoRA base) come from where the run built them, not from the checkpoint; every
    # trainable one is in ``state``, and dcp.load refused a checkpoint that lacks any of them.
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
    )


@contextlib.contextmanager
def no_reduce_scatter(model: nn.Module, enabled: bool) -> Iterator[None]:
    """``grad_sync`` for a sharded model: an accumulation micro-step keeps its unsharded gradients (no
    reduce-scatter); the last one reduce-scatters them all once. FSDP2 reads the flag in the backward, after this
    block (which holds the forward): it stays set until the next micro-step sets it again, the last one to true."""
    model.set_requires_gradient_sync(enabled)
    yield


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Within the block the root unit's weights (embedding, LM head) are whole on every rank, for calls that do not
    go through the loss module's ``forward`` (evaluation's sums, generation); each layer gathers its own as it runs.
    Every rank must enter it. A replica: nothing to do."""
    if not is_sharded(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
