"""What a rank holds all run long under each ``parallel.strategy``: DDP's whole replica, or FSDP2's shards and what
it gathers around them.

**ddp**: every rank holds every parameter in its own dtype, the trainable parameters' gradients (DDP's buckets; a
second copy without ``parallel.gradient_as_bucket_view``) and AdamW's two states per trainable parameter.

**fsdp2** (``torch.distributed.fsdp.fully_shard``, as ``ddptrain/parallel/fsdp.py`` applies it: LoRA before
sharding, one unit per decoder layer plus the root, the embeddings, final norm and LM head; trainable parameters
kept in fp32; ``MixedPrecisionPolicy(param_dtype=bf16 under trainer.precision=bf16 or model.dtype=bf16, else none;
reduce_dtype=fp32)``). FSDP2 cuts each parameter on its first dimension, padded up to a multiple of the ranks, so
that a rank holds ``ceil(rows / N)`` rows of each:

- the shards: frozen parameters in ``model.dtype``, trainable ones as fp32 masters; their gradients (fp32) and
  AdamW's two states (fp32), sharded alike;
- gathered for compute, in param_dtype, each unit padded as the all-gather returns it: the root, never resharded
  after its forward, and the decoder layers in flight: with ``parallel.reshard_after_forward=true`` two (the one
  computing and the one prefetched), in backward as in forward; with false, every layer from its forward to its
  backward;
- the collectives' buffers: one layer's all-gather output beside its gathered copy (FSDP2 copies it out into the
  parameters); the root's unsharded gradients (in param_dtype), formed at the LM head, the first backward, and
  reduce-scattered at the embedding, the last; beside them, the larger of a layer's moment (its unsharded gradients
  and its reduce-scatter input in fp32) and the root's (its reduce-scatter input);
- with ``optim.grad_accum_steps`` above 1, the no-sync gradients: on the micro-steps that skip the reduce-scatter
  (``set_requires_gradient_sync(False)``) FSDP2 keeps every unit's unsharded gradients, in reduce_dtype (fp32),
  until the last micro-step;
- ``parallel.cpu_offload=true``: the shards, their gradients and AdamW's states live in host memory; on a GPU the
  device holds none of them (on a CPU the host is the device: nothing moves).

The buffers and the layers in flight follow FSDP2's algorithm, not a measurement: like the fixed costs, they are
estimates until a GPU calibrates them. The activations and transients of a micro-step are simulated on a model whose
weights are in param_dtype (``step_model``): FSDP2 computes on the gathered bf16 copies, where DDP's fp32 weights
under autocast keep a bf16 copy of each weight for the step (autocast's cache), which DDP's simulation counts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from ddptrain.config import DType, RunConfig, Strategy
from ddptrain.model.precision import TORCH_DTYPES
from ddptrain.plan.simulate import FakeModel

FP32 = 4  # bytes: FSDP2's masters, their gradients, AdamW's states and reduce_dtype
RESHARD = "parallel.reshard_after_forward"
OFFLOAD = "parallel.cpu_offload"


@dataclass(frozen=True)
class Held:
    """A rank's bytes held all run long, on its device (``host``: in host memory instead)."""

    weights: dict[str, int]  # by dtype name
    trainable: int  # parameters
    gradients: int
    optimizer: int
    sharding: dict[str, int] = dataclasses.field(default_factory=dict)  # FSDP2's rows beyond the shards, by label
    host: int = 0  # shards, gradients and optimizer states in host memory (parallel.cpu_offload=true on a GPU)


def param_dtype(cfg: RunConfig, precision: DType) -> DType | None:
    """FSDP2's ``MixedPrecisionPolicy.param_dtype`` as the runtime sets it: bf16 under trainer.precision=bf16 or a
    bf16 model.dtype, else None (each parameter gathered in its own dtype)."""
    return DType.bf16 if DType.bf16 in (precision, cfg.model.dtype) else None


def step_model(model: FakeModel, config: PretrainedConfig, cfg: RunConfig, precision: DType) -> FakeModel:
    """The model a micro-step computes with: DDP's as built; FSDP2's with its weights in param_dtype, where that
    differs from model.dtype (the gathered copies are what the layers compute on)."""
    dtype = param_dtype(cfg, precision)
    if cfg.parallel.strategy != Strategy.fsdp2 or dtype is None or dtype == cfg.model.dtype:
        return model
    changed = dataclasses.replace(cfg.model, dtype=dtype)
    return FakeModel(config, changed, precision, compiled=cfg.trainer.compile, objective=cfg.objective)


def held_memory(
    model: FakeModel, cfg: RunConfig, world_size: int, grad_accum_steps: int, device: str, precision: DType
) -> Held:
    """What one rank holds all run long under cfg.parallel.strategy (see the module's docstring); ``model``: the
    run's model as built (its parameters in model.dtype, LoRA's in fp32)."""
    if cfg.parallel.strategy == Strategy.fsdp2:
        return _fsdp2(model, cfg, world_size, grad_accum_steps, device, precision)
    trainable, grad_bytes = model.trainable_parameters()
    # DDP's buckets hold the gradients; without gradient_as_bucket_view each gradient is a second copy.
    copies = 2 if world_size > 1 and not cfg.parallel.gradient_as_bucket_view else 1
    optimizer = 2 * grad_bytes  # AdamW: exp_avg and exp_avg_sq, in each parameter's dtype
    return Held(model.parameter_bytes(), trainable, copies * grad_bytes, optimizer)


def _fsdp2(model: FakeModel, cfg: RunConfig, n: int, grad_accum_steps: int, device: str, precision: DType) -> Held:
    p = cfg.parallel
    gathered_dtype = param_dtype(cfg, precision)
    compute = TORCH_DTYPES[gathered_dtype].itemsize if gathered_dtype else None

    def gathered(param: nn.Parameter) -> int:
        """Bytes of a parameter gathered whole: its padded rows, in param_dtype (else its own, fp32 if trained)."""
        size = compute or (FP32 if param.requires_grad else param.element_size())
        return n * _shard_elements(param, n) * size

    def grads(param: nn.Parameter) -> int:
        """Bytes of its unsharded gradient: in param_dtype, else the fp32 master's."""
        return param.numel() * (compute or FP32) if param.requires_grad else 0

    def padded_fp32(param: nn.Parameter) -> int:
        """Bytes of its reduce-scatter input: its padded rows, in reduce_dtype (fp32)."""
        return n * _shard_elements(param, n) * FP32 if param.requires_grad else 0

    root, layer = _unit_measures(model)
    weights: dict[str, int] = {}
    for name in set(model.parameter_bytes()) | {"float32"}:
        weights[name] = model.carried(lambda m, dt=name: _sum(m, lambda q: _shard_bytes(q, n, dt)))
    weights = {name: size for name, size in weights.items() if size}
    trainable = model.trainable_parameters()[0]
    sharded_grads = model.carried(lambda m: _sum(m, lambda q: _shard_elements(q, n) * FP32 * q.requires_grad))
    optimizer = 2 * sharded_grads  # AdamW: exp_avg and exp_avg_sq, fp32 like the masters

    in_flight = model.layers if not p.reshard_after_forward else min(2, model.layers)
    depth = f"all {in_flight}" if in_flight == model.layers else str(in_flight)
    dtype_name = str(TORCH_DTYPES[gathered_dtype]).removeprefix("torch.") if gathered_dtype else "as stored"
    sharding = {
        f"gathered: root + {depth} layers ({dtype_name})": root(gathered) + in_flight * layer(gathered),
        "all-gather, reduce-scatter buffers": layer(gathered)
        + root(grads)
        + max(layer(grads) + layer(padded_fp32), root(padded_fp32)),
    }
    if grad_accum_steps > 1:
        sharding[f"no-sync gradients (optim.grad_accum_steps={grad_accum_steps})"] = trainable * FP32
    shards = sum(weights.values()) + sharded_grads + optimizer
    if p.cpu_offload and device == "cuda":
        weights = dict.fromkeys(weights, 0)
        return Held(weights, trainable, 0, 0, sharding, host=shards)
    return Held(weights, trainable, sharded_grads, optimizer, sharding)


def _shard_elements(param: nn.Parameter, n: int) -> int:
    """Elements of one rank's shard: ``ceil(rows / n)`` rows of the first dimension (FSDP2 pads it to n's multiple)."""
    if param.dim() == 0:
        return 1
    rows = param.shape[0]
    return math.ceil(rows / n) * (param.numel() // rows if rows else 0)


def _shard_bytes(param: nn.Parameter, n: int, dtype_name: str) -> int:
    """A rank's shard of ``param`` if it is held in ``dtype_name``: frozen ones in their own, trainable ones in fp32."""
    held = "float32" if param.requires_grad else str(param.dtype).removeprefix("torch.")
    if held != dtype_name:
        return 0
    return _shard_elements(param, n) * (FP32 if param.requires_grad else param.element_size())


def _sum(module: nn.Module, measure: Callable[[nn.Parameter], int]) -> int:
    return sum(measure(q) for q in module.parameters())  # each shared parameter once (a tied LM head)


def decoder_layers(module: nn.Module) -> nn.ModuleList:
    """The model's decoder layers, FSDP2's units: the ``nn.ModuleList`` that holds the most parameters."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m)]
    assert lists, f"no decoder layers in {type(module).__name__}"
    return max(lists, key=lambda m: sum(q.numel() for q in m.parameters()))


def _unit_measures(
    model: FakeModel,
) -> tuple[Callable[[Callable[[nn.Parameter], int]], int], Callable[[Callable[[nn.Parameter], int]], int]]:
    """Two functions of a per-parameter measure: its sum over the root unit (every parameter outside the decoder
    layers), and over the largest decoder layer."""

    def root(measure: Callable[[nn.Parameter], int]) -> int:
        def of(module: nn.Module) -> int:
            inside = {id(q) for q in decoder_layers(module).parameters()}
            return sum(measure(q) for q in module.parameters() if id(q) not in inside)

        return model.carried(of)

    def layer(measure: Callable[[nn.Parameter], int]) -> int:
        return model.carried(lambda module: max(_sum(unit, measure) for unit in decoder_layers(module)))

    return root, layer
